"""Writes small, real Kiln artifacts for runtime tests without the converter.

A tiny random Hugging Face model (transformers' own classes, so it doubles as the reference) is
split per TP rank (Megatron: q/k/v and gate/up rows column-parallel, o/down columns row-parallel),
prepared by the `dense` kernel, and written as rank{r}.safetensors + config/tokenizer files +
manifest.json (last), following runtime/artifact/manifest.py.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from kernels.base import DenseWeight, LinearSpec, ShardSpec
from kernels.registry import get_kernel
from runtime.artifact.manifest import (
    MANIFEST_NAME,
    FileEntry,
    LayerEntry,
    Manifest,
    SourceInfo,
    Verification,
    artifact_id,
    sha256_file,
    source_digest,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte-level: every byte is a token (multi-byte chars span tokens)
BOS_ID, EOS_ID = 256, 258


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small random config: hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 259."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.15,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        common["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model_type = "llama"
    elif arch == "qwen2":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        model_type = "qwen2"
    elif arch == "mistral":
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        common["sliding_window"] = 256
        model_type = "mistral"
    elif arch == "smollm2":  # Llama with tied embeddings
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
        common["tie_word_embeddings"] = True
        model_type = "llama"
    else:
        raise ValueError(arch)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def _spec(
    name: str,
    n: int,
    k: int,
    k_full: int,
    *,
    row_parallel: bool,
    bias: bool,
    shards: tuple[ShardSpec, ...] = (),
) -> LinearSpec:
    return LinearSpec(
        name=name,
        scheme="dense",
        n=n,
        k=k,
        k_full=k_full,
        bits=32,
        row_parallel=row_parallel,
        has_bias=bias,
        act_dtype="float32",
        shards=shards,
    )


def write_artifact(
    model: PreTrainedModel,
    out_root: Path,
    *,
    tp: int = 1,
    target: str = "cpu",
    lm_head_layer: bool = False,
) -> Path:
    """Write `model` as an artifact under out_root/<artifact_id>/ and return that directory."""
    cfg = model.config
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hq, hkv = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
    inter = cfg.intermediate_size // tp
    dense = get_kernel("dense")
    layers: dict[str, LayerEntry] = {}
    rank_tensors: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def add_layer(
        name: str, per_rank: list[tuple[torch.Tensor, torch.Tensor | None]], spec: LinearSpec
    ) -> None:
        tensors_names: list[str] = []
        for r, (w, b) in enumerate(per_rank):
            prepared = dense.prepare(DenseWeight(weight=w.contiguous(), bias=b), spec)
            tensors_names = sorted(prepared)
            for suffix, t in prepared.items():
                rank_tensors[r][f"{name}.{suffix}"] = t.contiguous().clone()
        layers[name] = LayerEntry(
            kernel=dense.name, layout_version=dense.layout_version, spec=spec.to_json(), tensors=tensors_names
        )

    def rows(t: torch.Tensor, r: int, size: int) -> torch.Tensor:
        return t[r * size : (r + 1) * size]

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        q, k, v = (sd[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
        has_qkv_bias = f"{p}.self_attn.q_proj.bias" in sd
        qkv_shards = (
            ShardSpec(f"{p}.self_attn.q_proj", hq * hd),
            ShardSpec(f"{p}.self_attn.k_proj", hkv * hd),
            ShardSpec(f"{p}.self_attn.v_proj", hkv * hd),
        )
        per_rank = []
        for r in range(tp):
            w = torch.cat([rows(q, r, hq * hd), rows(k, r, hkv * hd), rows(v, r, hkv * hd)])
            b = None
            if has_qkv_bias:
                qb, kb, vb = (sd[f"{p}.self_attn.{x}_proj.bias"] for x in "qkv")
                b = torch.cat([rows(qb, r, hq * hd), rows(kb, r, hkv * hd), rows(vb, r, hkv * hd)])
            per_rank.append((w, b))
        add_layer(
            f"{p}.self_attn.qkv_proj",
            per_rank,
            _spec(
                f"{p}.self_attn.qkv_proj",
                (hq + 2 * hkv) * hd,
                cfg.hidden_size,
                cfg.hidden_size,
                row_parallel=False,
                bias=has_qkv_bias,
                shards=qkv_shards,
            ),
        )
        o = sd[f"{p}.self_attn.o_proj.weight"]
        add_layer(
            f"{p}.self_attn.o_proj",
            [(o[:, r * hq * hd : (r + 1) * hq * hd], None) for r in range(tp)],
            _spec(
                f"{p}.self_attn.o_proj",
                cfg.hidden_size,
                hq * hd,
                cfg.num_attention_heads * hd,
                row_parallel=True,
                bias=False,
            ),
        )
        gate, up = sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]
        add_layer(
            f"{p}.mlp.gate_up_proj",
            [(torch.cat([rows(gate, r, inter), rows(up, r, inter)]), None) for r in range(tp)],
            _spec(
                f"{p}.mlp.gate_up_proj",
                2 * inter,
                cfg.hidden_size,
                cfg.hidden_size,
                row_parallel=False,
                bias=False,
                shards=(ShardSpec(f"{p}.mlp.gate_proj", inter), ShardSpec(f"{p}.mlp.up_proj", inter)),
            ),
        )
        down = sd[f"{p}.mlp.down_proj.weight"]
        add_layer(
            f"{p}.mlp.down_proj",
            [(down[:, r * inter : (r + 1) * inter], None) for r in range(tp)],
            _spec(
                f"{p}.mlp.down_proj",
                cfg.hidden_size,
                inter,
                cfg.intermediate_size,
                row_parallel=True,
                bias=False,
            ),
        )

    other = ["model.embed_tokens.weight", "model.norm.weight"]
    other += [
        f"model.layers.{i}.{n}.weight"
        for i in range(cfg.num_hidden_layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    tied = bool(cfg.tie_word_embeddings)
    if lm_head_layer:
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        add_layer(
            "lm_head",
            [(head, None)] * tp,
            _spec(
                "lm_head", cfg.vocab_size, cfg.hidden_size, cfg.hidden_size, row_parallel=False, bias=False
            ),
        )
    elif not tied:
        other.append("lm_head.weight")
    for r in range(tp):
        for name in other:
            rank_tensors[r][name] = sd[name]

    hf_config = cfg.to_dict()
    hf_config["architectures"] = [type(model).__name__]
    weights_digest = hashlib.sha256(sd["model.embed_tokens.weight"].numpy().tobytes()).hexdigest()
    src_files = {
        "config.json": hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest(),
        "model.safetensors": weights_digest,
    }
    options = {"lm_head_layer": lm_head_layer}
    aid = artifact_id(source_digest(src_files), target, tp, "auto", {"dense": dense.layout_version}, options)
    out = out_root / aid
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    write_tokenizer(out)
    files: list[FileEntry] = []
    for r in range(tp):
        name = f"rank{r}.safetensors"
        save_file(rank_tensors[r], str(out / name))
        files.append(
            FileEntry(name=name, size=(out / name).stat().st_size, sha256=sha256_file(out / name), rank=r)
        )
    for path in sorted(out.iterdir()):
        if path.suffix != ".safetensors":
            files.append(FileEntry(name=path.name, size=path.stat().st_size, sha256=sha256_file(path)))
    manifest = Manifest(
        artifact_id=aid,
        kiln_version="test",
        created_at=dt.datetime.now(dt.UTC).isoformat(),
        source=SourceInfo(
            uri="memory://tiny", format="dense", digest=source_digest(src_files), files=src_files
        ),
        target=target,
        tp=tp,
        method="auto",
        options=options,
        architecture=type(model).__name__,
        act_dtype="float32",
        hf_config=hf_config,
        layers=layers,
        other_tensors=other,
        files=files,
        verification=Verification(ok=True, layers_checked=0, layers_exact=0, max_rel_err=0.0, seconds=0.0),
    )
    (out / MANIFEST_NAME).write_bytes(manifest.to_json_bytes())
    return out
