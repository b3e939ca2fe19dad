"""A GGUF file's metadata as the files of a Hugging Face checkpoint directory (issue 27, "GGUF in").

llama.cpp's GGUF keeps the model config, the tokenizer and the chat template as key/value metadata
(`general.architecture`, `{arch}.block_count`, `tokenizer.ggml.tokens`, ...) and names tensors its
own way (`blk.3.attn_q.weight`). This module gives what the converter reads from a Hugging Face
checkpoint instead:

- `hf_config`: config.json, for the architectures runtime/model_layout.py runs (llama, also what
  Mistral files use, and llama files with experts as Mixtral; qwen2; qwen3; qwen3moe), checked
  with `ModelConfig.from_hf`;
- `hf_tensor_name`: a GGUF tensor's checkpoint name. GGUF stores a mixture-of-experts layer's
  experts stacked, one 3-D tensor per projection, (experts, out, in) in numpy order; its name is
  the expert group's followed by the per-expert part, without `.weight`
  (`model.layers.3.mlp.experts.gate_proj`, `model.layers.3.block_sparse_moe.experts.w1`), and
  `expert_weight_name` names expert e's slice (`model.layers.3.mlp.experts.7.gate_proj.weight`);
- `needs_qk_unpermute`: llama.cpp's converter permutes the q and k rows of LLaMA-family files;
- `tokenizer_files`: tokenizer.json, rebuilt with the `tokenizers` library to split text as
  llama.cpp does (its pre-tokenizer by `tokenizer.ggml.pre`, its control and user-defined tokens),
  tokenizer_config.json (chat template, special tokens), special_tokens_map.json and
  generation_config.json.

`metadata` maps every key to its value: scalars as Python values, arrays as lists.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kernels.errors import UnsupportedError
from runtime.model_layout import ARCHITECTURES, ExpertNaming, ModelConfig, ModelConfigError
from services.convert.errors import ConversionError

Metadata = Mapping[str, Any]

ARCHITECTURE_KEY = "general.architecture"
TOKENS_KEY = "tokenizer.ggml.tokens"
BOS_KEY = "tokenizer.ggml.bos_token_id"
PAD_KEY = "tokenizer.ggml.padding_token_id"
UNK_KEY = "tokenizer.ggml.unknown_token_id"
# eos, then the end-of-turn and end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>)
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
OUTPUT_TENSOR = "output.weight"
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # llama3 rope scaling, precomputed (one divisor per pair)
DTYPE = "bfloat16"
DEFAULT_ROPE_THETA = 10000.0  # llama.cpp's and transformers' default
# Llama 3.1 / 3.2's llama3 rope scaling (the factor varies): tried first when fitting rope_freqs.
LLAMA3_ROPE = {"original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_FACTOR_RTOL = 1e-4  # rope_freqs is float32


@dataclass(frozen=True)
class _Family:
    hf_class: str
    model_type: str
    fixed: Mapping[str, Any]  # config values the GGUF architecture implies


FAMILIES: Mapping[str, _Family] = {
    "llama": _Family("LlamaForCausalLM", "llama", {}),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False}),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3", {}),
    # llama.cpp always renormalizes Qwen3-MoE's top-k routing weights; every layer is sparse.
    "qwen3moe": _Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
}
MIXTRAL = _Family("MixtralForCausalLM", "mixtral", {"sliding_window": None})  # llama + expert_count
# GGUF architectures (and the config classes made from them) whose q/k rows llama.cpp permuted.
PERMUTED_QK = frozenset({"llama", "LlamaForCausalLM", "MixtralForCausalLM"})


# --- typed reads -----------------------------------------------------------------------------


def _missing(key: str) -> ConversionError:
    return ConversionError(f"GGUF metadata lacks {key!r}; the file is incomplete or not a model")


def _wrong(key: str, value: Any, want: str) -> ConversionError:
    shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:80]
    return ConversionError(f"GGUF metadata {key!r} = {shown}: must be {want}")


def _opt_int(metadata: Metadata, key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _wrong(key, value, "an unsigned integer")
    return int(value)


def _int(metadata: Metadata, key: str) -> int:
    value = _opt_int(metadata, key)
    if value is None:
        raise _missing(key)
    return value


def _opt_real(metadata: Metadata, key: str) -> float | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _wrong(key, value, "a finite number")
    return float(value)


def _opt_text(metadata: Metadata, key: str) -> str | None:
    value = metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise _wrong(key, value, "a string")
    return value


def _text(metadata: Metadata, key: str) -> str:
    value = _opt_text(metadata, key)
    if value is None:
        raise _missing(key)
    return value


def _opt_flag(metadata: Metadata, key: str) -> bool | None:
    value = metadata.get(key)
    if value is not None and not isinstance(value, bool):
        raise _wrong(key, value, "true or false")
    return value


def _list(metadata: Metadata, key: str, kind: type, want: str) -> list[Any] | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise _wrong(key, value, want)
    return value


def _tokens(metadata: Metadata) -> list[str]:
    tokens = _list(metadata, TOKENS_KEY, str, "a list of strings")
    if not tokens:
        raise _missing(TOKENS_KEY)
    return tokens


# --- config.json -----------------------------------------------------------------------------


def hf_config(
    metadata: Metadata, tensor_names: Iterable[str], *, rope_factors: Iterable[float] | None = None
) -> dict[str, Any]:
    """config.json of the Hugging Face checkpoint this GGUF was converted from.

    `tensor_names`: the file's tensor names (no `output.weight`: the embeddings are tied).
    `rope_factors`: the values of the `rope_freqs.weight` tensor, required when the file has it
    (llama.cpp stores Llama 3's rope scaling as these precomputed factors, not as metadata).
    ConversionError names a missing or wrong-typed key; UnsupportedError an architecture or rope
    scaling Kiln does not run."""
    arch = _text(metadata, ARCHITECTURE_KEY)
    names = frozenset(tensor_names)
    family = _family(metadata, arch)
    dims = _dimensions(metadata, arch)
    base = _opt_real(metadata, f"{arch}.rope.freq_base")
    theta = DEFAULT_ROPE_THETA if base is None else base
    vocab = _vocab_size(metadata, arch)
    config: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "vocab_size": vocab,
        **dims,
        **_mlp(metadata, arch, family),
        "rms_norm_eps": _rms_norm_eps(metadata, arch),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(metadata, arch, names, rope_factors, dims["head_dim"], theta),
        "tie_word_embeddings": OUTPUT_TENSOR not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        **_config_token_ids(metadata, vocab),
        "torch_dtype": DTYPE,
        **family.fixed,
    }
    try:
        ModelConfig.from_hf(config, where="config.json from GGUF metadata")
    except ModelConfigError as e:
        raise ConversionError(f"the GGUF metadata gives a config Kiln cannot use: {e}") from e
    return config


def _family(metadata: Metadata, arch: str) -> _Family:
    family = FAMILIES.get(arch)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedError(f"GGUF {ARCHITECTURE_KEY} {arch!r} is not supported; supported: {supported}")
    if arch == "llama" and (_opt_int(metadata, f"{arch}.expert_count") or 0) > 0:
        return MIXTRAL
    return family


def _dimensions(metadata: Metadata, arch: str) -> dict[str, int]:
    """The attention and model sizes. head_dim as llama.cpp takes it: attention.key_length, else
    embedding_length / head_count; Kiln rotates every dimension of a head and needs v's as k's."""
    hidden = _int(metadata, f"{arch}.embedding_length")
    heads = _int(metadata, f"{arch}.attention.head_count")
    if heads == 0:
        raise _wrong(f"{arch}.attention.head_count", heads, "positive")
    kv_heads = _opt_int(metadata, f"{arch}.attention.head_count_kv")
    head_dim = _opt_int(metadata, f"{arch}.attention.key_length") or hidden // heads
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        value = _opt_int(metadata, key)
        if value is not None and value != head_dim:
            raise UnsupportedError(
                f"GGUF metadata {key!r} = {value} differs from the head size {head_dim}; Kiln runs "
                "models whose v heads and rotary dimensions span whole heads"
            )
    return {
        "hidden_size": hidden,
        "num_hidden_layers": _int(metadata, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": heads if kv_heads is None else kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int(metadata, f"{arch}.context_length"),
    }


def _mlp(metadata: Metadata, arch: str, family: _Family) -> dict[str, Any]:
    """intermediate_size and, for mixture-of-experts models, the expert counts and sizes."""
    dense = _opt_int(metadata, f"{arch}.feed_forward_length")
    expert = _opt_int(metadata, f"{arch}.expert_feed_forward_length")
    if family.hf_class == "Qwen3MoeForCausalLM":
        if expert is None:
            raise _missing(f"{arch}.expert_feed_forward_length")
        return {
            "intermediate_size": expert if dense is None else dense,
            "moe_intermediate_size": expert,
            "num_experts": _int(metadata, f"{arch}.expert_count"),
            "num_experts_per_tok": _int(metadata, f"{arch}.expert_used_count"),
        }
    size = expert if family is MIXTRAL and expert is not None else dense
    if size is None:
        raise _missing(f"{arch}.feed_forward_length")
    if family is MIXTRAL:
        return {
            "intermediate_size": size,
            "num_local_experts": _int(metadata, f"{arch}.expert_count"),
            "num_experts_per_tok": _int(metadata, f"{arch}.expert_used_count"),
        }
    return {"intermediate_size": size}


def _rms_norm_eps(metadata: Metadata, arch: str) -> float:
    key = f"{arch}.attention.layer_norm_rms_epsilon"
    value = _opt_real(metadata, key)
    if value is None:
        raise _missing(key)
    return value


def _vocab_size(metadata: Metadata, arch: str) -> int:
    """Rows of the embedding: `{arch}.vocab_size`, else the number of tokens."""
    key = f"{arch}.vocab_size"
    size = _opt_int(metadata, key)
    tokens = _list(metadata, TOKENS_KEY, str, "a list of strings")
    if size is None:
        if not tokens:
            raise ConversionError(f"GGUF metadata has neither {key!r} nor {TOKENS_KEY!r}")
        return len(tokens)
    if tokens is not None and len(tokens) > size:
        raise ConversionError(f"GGUF metadata {TOKENS_KEY!r} lists {len(tokens)} tokens; {key!r} is {size}")
    return size


def _rope_scaling(
    metadata: Metadata,
    arch: str,
    names: frozenset[str],
    rope_factors: Iterable[float] | None,
    head_dim: int,
    theta: float,
) -> dict[str, Any] | None:
    kind_key = f"{arch}.rope.scaling.type"
    kind = _opt_text(metadata, kind_key)
    if ROPE_FREQS_TENSOR in names and kind in (None, "none"):
        if rope_factors is None:
            raise ConversionError(
                f"the GGUF file has {ROPE_FREQS_TENSOR!r} (llama3 rope scaling, precomputed); pass "
                "its values as hf_config(..., rope_factors=...)"
            )
        return llama3_rope_scaling(rope_factors, head_dim, theta)
    if kind is None:  # files before rope.scaling.*: rope.scale_linear
        linear = _opt_real(metadata, f"{arch}.rope.scale_linear")
        return None if linear is None or linear == 1.0 else {"rope_type": "linear", "factor": linear}
    if kind == "none":
        return None
    factor_key = f"{arch}.rope.scaling.factor"
    factor = _opt_real(metadata, factor_key)
    if factor is None:
        raise _missing(factor_key)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _int(metadata, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise UnsupportedError(f"GGUF metadata {kind_key!r} = {kind!r}: supported are none, linear and yarn")


def llama3_rope_scaling(factors: Iterable[float], head_dim: int, theta: float) -> dict[str, Any] | None:
    """The llama3 rope_scaling that gives `factors` (`rope_freqs.weight`: the divisor of each rotary
    pair's frequency), None when they are all 1. Only the ratios of original_max_position_embeddings,
    low_freq_factor and high_freq_factor matter, so Llama 3.1's (8192, 1, 4) are tried first, then
    the values fitted to the interpolated band with low_freq_factor 1; either must give `factors`."""
    values = [float(f) for f in factors]
    if len(values) != head_dim // 2 or not all(math.isfinite(v) and v > 0 for v in values):
        raise ConversionError(
            f"{ROPE_FREQS_TENSOR!r} holds {len(values)} values; {head_dim // 2} finite positive ones "
            "(one per rotary pair) expected"
        )
    factor = max(values)
    if factor <= 1.0 + ROPE_FACTOR_RTOL:
        return None
    wavelens = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    candidates = [LLAMA3_ROPE]
    fitted = _fit_llama3_band(values, wavelens, factor)
    if fitted is not None:
        candidates.append(fitted)
    for params in candidates:
        expected = _llama3_factors(wavelens, factor, params)
        if all(math.isclose(e, v, rel_tol=ROPE_FACTOR_RTOL) for e, v in zip(expected, values, strict=True)):
            return {"rope_type": "llama3", "factor": factor, **params}
    raise ConversionError(f"{ROPE_FREQS_TENSOR!r}: its factors are not those of a llama3 rope scaling")


def _llama3_factors(wavelens: list[float], factor: float, params: Mapping[str, Any]) -> list[float]:
    """llama.cpp's converter's rope_freqs for these parameters (transformers' llama3 rope)."""
    orig = params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    out = []
    for w in wavelens:
        if w < orig / high:
            out.append(1.0)
        elif w > orig / low:
            out.append(factor)
        else:
            smooth = (orig / w - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _fit_llama3_band(values: list[float], wavelens: list[float], factor: float) -> dict[str, Any] | None:
    """In the band, smooth = a / wavelen - b (a = orig / (high - low), b = low / (high - low)), and
    smooth follows from each factor; least squares over the band's pairs, then low = 1."""
    band = [
        (1 / w, (1 / v - 1 / factor) / (1 - 1 / factor))
        for w, v in zip(wavelens, values, strict=True)
        if 1 + ROPE_FACTOR_RTOL < v < factor * (1 - ROPE_FACTOR_RTOL)
    ]
    if len(band) < 2:
        return None
    n = len(band)
    mean_x = sum(x for x, _ in band) / n
    mean_s = sum(s for _, s in band) / n
    var = sum((x - mean_x) ** 2 for x, _ in band)
    if var == 0:
        return None
    a = sum((x - mean_x) * (s - mean_s) for x, s in band) / var
    b = a * mean_x - mean_s
    if a <= 0 or b <= 0:
        return None
    orig = max(1, round(a / b))
    low = b * orig / a
    return {
        "original_max_position_embeddings": orig,
        "low_freq_factor": low,
        "high_freq_factor": low + orig / a,
    }


def _eos_ids(metadata: Metadata, vocab: int) -> list[int]:
    ids: list[int] = []
    for key in EOS_KEYS:
        value = _opt_int(metadata, key)
        if value is not None and value not in ids:
            ids.append(_in_vocab(key, value, vocab))
    return ids


def _config_token_ids(metadata: Metadata, vocab: int) -> dict[str, Any]:
    """bos_token_id, eos_token_id (one id or a list) and pad_token_id, as the file gives them."""
    out: dict[str, Any] = {}
    for name, key in (("bos_token_id", BOS_KEY), ("pad_token_id", PAD_KEY)):
        value = _opt_int(metadata, key)
        if value is not None:
            out[name] = _in_vocab(key, value, vocab)
    eos = _eos_ids(metadata, vocab)
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _in_vocab(key: str, token_id: int, vocab: int) -> int:
    if token_id >= vocab:
        raise ConversionError(f"GGUF metadata {key!r} = {token_id}: beyond the vocabulary of {vocab}")
    return token_id


# --- tensor names ----------------------------------------------------------------------------

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BIASED_TENSORS = frozenset({"attn_q", "attn_k", "attn_v"})  # Qwen2's q/k/v biases
EXPERT_PARTS = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}  # gate, up, down: ExpertNaming.parts order
ROUTER_TENSOR = "ffn_gate_inp"
STACKED_SUFFIX = "_exps"  # blk.N.ffn_gate_exps: every expert's gate projection, stacked
IGNORED_TENSORS = frozenset({ROPE_FREQS_TENSOR})  # hf_config turns it into rope_scaling
# blk.<layer>.<part>[.<expert>].<weight|bias>; the expert index: Mixtral files before stacked experts
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)(?:\.(\d+))?\.(weight|bias)")


def hf_tensor_name(gguf_name: str, config: Mapping[str, Any]) -> str | None:
    """The checkpoint name of GGUF tensor `gguf_name` in the model `config` (hf_config's) describes;
    None for `rope_freqs.weight`, which no checkpoint holds. A stacked expert tensor
    (`blk.N.ffn_gate_exps.weight`, (experts, out, in)) gets the expert group's name and the part,
    without `.weight`: model.layers.N.mlp.experts.gate_proj (Qwen3-MoE),
    model.layers.N.block_sparse_moe.experts.w1 (Mixtral); `expert_weight_name` names one expert's.
    ConversionError names a tensor Kiln's layout has no place for."""
    if gguf_name in IGNORED_TENSORS:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_TENSORS and suffix == "weight":
        return f"{GLOBAL_TENSORS[stem]}.weight"
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None:
        raise _unknown_tensor(gguf_name, config)
    layer, part, expert, suffix = int(match[1]), match[2], match[3], match[4]
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layer >= layers:
        raise ConversionError(f"GGUF tensor {gguf_name!r}: layer {layer} of a model of {layers} layers")
    prefix = f"model.layers.{layer}"
    if expert is None and part in BLOCK_TENSORS and (suffix == "weight" or part in BIASED_TENSORS):
        return f"{prefix}.{BLOCK_TENSORS[part]}.{suffix}"
    naming = _expert_naming(config)
    if naming is None or suffix != "weight":
        raise _unknown_tensor(gguf_name, config)
    group = f"{prefix}.{naming.block}"
    if expert is None and part == ROUTER_TENSOR:
        return f"{group}.gate.weight"
    if expert is None and part.endswith(STACKED_SUFFIX) and part[: -len(STACKED_SUFFIX)] in EXPERT_PARTS:
        return f"{group}.experts.{naming.parts[0][EXPERT_PARTS[part[: -len(STACKED_SUFFIX)]]]}"
    if expert is not None and part in EXPERT_PARTS:
        experts = config.get("num_experts") or config.get("num_local_experts")
        if not isinstance(experts, int) or int(expert) >= experts:
            raise ConversionError(f"GGUF tensor {gguf_name!r}: expert {expert} of {experts}")
        return f"{group}.experts.{int(expert)}.{naming.parts[0][EXPERT_PARTS[part]]}.weight"
    raise _unknown_tensor(gguf_name, config)


def expert_weight_name(stacked: str, expert: int) -> str:
    """Expert `expert`'s weight inside a stacked expert tensor hf_tensor_name named:
    model.layers.3.mlp.experts.gate_proj -> model.layers.3.mlp.experts.<expert>.gate_proj.weight."""
    group, _, part = stacked.rpartition(".")
    if not group.endswith(".experts") or stacked.endswith(".weight"):
        raise ConversionError(f"{stacked!r} names no stacked expert tensor")
    return f"{group}.{expert}.{part}.weight"


def _expert_naming(config: Mapping[str, Any]) -> ExpertNaming | None:
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    family = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    return family.experts if family is not None else None


def _unknown_tensor(gguf_name: str, config: Mapping[str, Any]) -> ConversionError:
    archs = config.get("architectures")
    return ConversionError(f"GGUF tensor {gguf_name!r} has no place in a {archs} checkpoint")


def needs_qk_unpermute(config_or_arch: Mapping[str, Any] | str) -> bool:
    """Whether llama.cpp's converter permuted the q and k rows (and biases) for its rotary layout:
    LLaMA-family files (general.architecture "llama": Llama, Mistral, Mixtral), not Qwen's.
    Takes the GGUF metadata, hf_config's config, or an architecture name (GGUF's or the class)."""
    if isinstance(config_or_arch, str):
        return config_or_arch in PERMUTED_QK
    arch = config_or_arch.get(ARCHITECTURE_KEY)
    if arch is None:
        archs = config_or_arch.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
    return isinstance(arch, str) and arch in PERMUTED_QK


# --- tokenizer files -------------------------------------------------------------------------

MODEL_KEY = "tokenizer.ggml.model"
PRE_KEY = "tokenizer.ggml.pre"
MERGES_KEY = "tokenizer.ggml.merges"
SCORES_KEY = "tokenizer.ggml.scores"
TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"
ADD_BOS_KEY = "tokenizer.ggml.add_bos_token"
ADD_EOS_KEY = "tokenizer.ggml.add_eos_token"
ADD_SPACE_PREFIX_KEY = "tokenizer.ggml.add_space_prefix"
HF_JSON_KEY = "tokenizer.huggingface.json"  # a Hugging Face tokenizer.json, verbatim, when present
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
CHAT_TEMPLATE_NAMES_KEY = (
    "tokenizer.chat_templates"  # names of more templates: tokenizer.chat_template.<name>
)
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type) that are added tokens
TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 2, 3, 4
SPIECE_SPACE = "\u2581"
SPECIAL_TOKEN_KEYS = {
    "bos_token": BOS_KEY,
    "eos_token": EOS_KEYS[0],
    "unk_token": UNK_KEY,
    "pad_token": PAD_KEY,
}
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), as the Hugging Face tokenizers write them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE, for one `tokenizer.ggml.pre`."""

    split: str | None  # a regex isolating the pieces; None: the byte-level (GPT-2) regex
    digits: bool = False  # every digit a piece of its own first (StarCoder, SmolLM)
    nfc: bool = False  # the Hugging Face tokenizer normalizes to NFC first (Qwen2); llama.cpp does not
    ignore_merges: bool = False  # a piece that is a token is taken whole (Llama 3, Tekken)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_STARCODER = PreTokenizer(None, digits=True)
_LLAMA3 = PreTokenizer(LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer(QWEN2_SPLIT, nfc=True)
PRE_TOKENIZERS: Mapping[str, PreTokenizer] = {
    "gpt-2": PreTokenizer(None),
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "smollm": _STARCODER,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "tekken": PreTokenizer(TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
}


def tokenizer_files(metadata: Metadata) -> dict[str, bytes]:
    """The tokenizer files of the Hugging Face checkpoint, by name: tokenizer.json,
    tokenizer_config.json (special tokens, add_bos_token, chat template, model_max_length),
    special_tokens_map.json and generation_config.json (bos / eos / pad ids). Byte-level BPE
    (`tokenizer.ggml.model` gpt2) and SentencePiece BPE (llama) vocabularies; tokenizer.json splits
    text as llama.cpp does, with control tokens special and user-defined ones added tokens."""
    tokens = _tokens(metadata)
    specials = _special_tokens(metadata, tokens)
    tokenizer_json, add_bos = _tokenizer_json(metadata, tokens)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(_opt_flag(metadata, ADD_EOS_KEY)),
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    template = _chat_template(metadata)
    if template is not None:
        config["chat_template"] = template
    arch = _opt_text(metadata, ARCHITECTURE_KEY)
    context = _opt_int(metadata, f"{arch}.context_length") if arch else None
    if context:
        config["model_max_length"] = context
    return {
        "tokenizer.json": tokenizer_json.encode(),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(specials),
        "generation_config.json": _json(_config_token_ids(metadata, len(tokens))),
    }


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


def _special_tokens(metadata: Metadata, tokens: list[str]) -> dict[str, str]:
    out = {}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = _opt_int(metadata, key)
        if token_id is not None:
            out[name] = tokens[_in_vocab(key, token_id, len(tokens))]
    return out


def _chat_template(metadata: Metadata) -> str | list[dict[str, str]] | None:
    """The default template, or transformers' list of named ones when the file has more."""
    default = _opt_text(metadata, CHAT_TEMPLATE_KEY)
    names = _list(metadata, CHAT_TEMPLATE_NAMES_KEY, str, "a list of template names") or []
    named = [
        {"name": n, "template": _text(metadata, f"{CHAT_TEMPLATE_KEY}.{n}")} for n in names if n != "default"
    ]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default is not None else []) + named


def _tokenizer_json(metadata: Metadata, tokens: list[str]) -> tuple[str, bool]:
    """tokenizer.json and whether it adds bos."""
    from tokenizers import Tokenizer

    embedded = _opt_text(metadata, HF_JSON_KEY)
    model = _text(metadata, MODEL_KEY)
    if embedded is not None:
        try:
            Tokenizer.from_str(embedded)
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise ConversionError(f"GGUF metadata {HF_JSON_KEY!r} is no tokenizer.json: {e}") from e
        return embedded, bool(_opt_flag(metadata, ADD_BOS_KEY))
    if model == "gpt2":
        tokenizer, default_bos = _byte_level_bpe(metadata, tokens)
    elif model == "llama":
        tokenizer, default_bos = _sentencepiece_bpe(metadata, tokens), True
    else:
        raise UnsupportedError(f"GGUF metadata {MODEL_KEY!r} = {model!r}: supported are gpt2 and llama")
    _add_tokens(tokenizer, tokens, _token_types(metadata, len(tokens)))
    flag = _opt_flag(metadata, ADD_BOS_KEY)
    add_bos = default_bos if flag is None else flag
    add_eos = bool(_opt_flag(metadata, ADD_EOS_KEY))
    tokenizer.post_processor = _post_processor(metadata, tokens, model == "gpt2", add_bos, add_eos)
    return tokenizer.to_str(), add_bos


def _vocab_ids(tokens: list[str]) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ConversionError(f"GGUF metadata {TOKENS_KEY!r} lists a token twice")
    return vocab


def _byte_level_bpe(metadata: Metadata, tokens: list[str]) -> tuple[Any, bool]:
    """GPT-2-style BPE over bytes, split first as llama.cpp does for the file's pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    name = _opt_text(metadata, PRE_KEY)
    pre = PRE_TOKENIZERS.get(name or "")
    if pre is None:
        supported = ", ".join(sorted(PRE_TOKENIZERS))
        raise UnsupportedError(f"GGUF metadata {PRE_KEY!r} = {name!r}: supported are {supported}")
    merges = [_merge(m) for m in _list(metadata, MERGES_KEY, str, "a list of strings") or []]
    if not merges:
        raise _missing(MERGES_KEY)
    try:
        model = models.BPE(_vocab_ids(tokens), merges, ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises plain Exception on a merge of unknown tokens
        raise ConversionError(f"GGUF metadata {MERGES_KEY!r}: {e}") from e
    tokenizer = Tokenizer(model)
    if pre.nfc:
        tokenizer.normalizer = normalizers.NFC()
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre.add_bos


def _merge(merge: str) -> tuple[str, str]:
    """`left right`, split at the first space after the first character (as llama.cpp does)."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ConversionError(f"GGUF metadata {MERGES_KEY!r} holds {merge[:40]!r}, which is no pair")
    return merge[:cut], merge[cut + 1 :]


def _sentencepiece_bpe(metadata: Metadata, tokens: list[str]) -> Any:
    """SentencePiece BPE as Hugging Face converts it (LlamaTokenizerFast, legacy): merges ranked by
    the merged piece's score, ▁ for spaces, a ▁ before the text, unknown bytes as <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _list(metadata, SCORES_KEY, numbers.Real, "a list of numbers")
    if scores is None or len(scores) != len(tokens):
        raise ConversionError(f"GGUF metadata {SCORES_KEY!r} must hold one score per token")
    vocab = _vocab_ids(tokens)
    unk_id = _opt_int(metadata, UNK_KEY)
    unk = tokens[_in_vocab(UNK_KEY, unk_id, len(tokens))] if unk_id is not None else None
    model = models.BPE(
        vocab, _merges_by_score(tokens, scores, vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tokenizer = Tokenizer(model)
    prefix = _opt_flag(metadata, ADD_SPACE_PREFIX_KEY) is not False
    prepend = [normalizers.Prepend(SPIECE_SPACE)] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", SPIECE_SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, by the token's score, highest first (ties: by
    token order, then by the left and right ids), as transformers' SentencePieceExtractor ranks them."""
    ranked: list[tuple[float, tuple[str, str]]] = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((float(score), pair) for pair in pairs)
    ranked.sort(key=lambda item: -item[0])
    return [pair for _, pair in ranked]


def _token_types(metadata: Metadata, count: int) -> list[int]:
    types = _list(metadata, TOKEN_TYPE_KEY, numbers.Integral, "a list of integers")
    if types is None:
        return [1] * count
    if len(types) != count:
        raise ConversionError(f"GGUF metadata {TOKEN_TYPE_KEY!r} has {len(types)} entries for {count} tokens")
    return [int(t) for t in types]


def _add_tokens(tokenizer: Any, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens as special tokens, user-defined ones as added tokens: llama.cpp
    matches both in text before splitting it (control ones when asked to parse special tokens)."""
    from tokenizers import AddedToken

    special = [t for t, k in zip(tokens, types, strict=True) if k in (TOKEN_UNKNOWN, TOKEN_CONTROL)]
    added = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])


def _post_processor(
    metadata: Metadata, tokens: list[str], byte_level: bool, add_bos: bool, add_eos: bool
) -> Any:
    """bos before (and eos after) each sequence when the file says so."""
    from tokenizers import processors

    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    ends = []
    for add, key in ((add_bos, BOS_KEY), (add_eos, EOS_KEYS[0])):
        token_id = _opt_int(metadata, key) if add else None
        if add and token_id is None:
            raise ConversionError(
                f"GGUF metadata asks for {key.removesuffix('_id')} tokens but lacks {key!r}"
            )
        ends.append([] if token_id is None else [(tokens[_in_vocab(key, token_id, len(tokens))], token_id)])
    (bos, eos) = ends
    if bos or eos:
        single = [f"{t}:0" for t, _ in bos] + ["$A:0"] + [f"{t}:0" for t, _ in eos]
        pair = single + [f"{t}:1" for t, _ in bos] + ["$B:1"] + [f"{t}:1" for t, _ in eos]
        steps.append(
            processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=list(dict.fromkeys(bos + eos))
            )
        )
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)
