"""Synthetic GGUF files, written with llama.cpp's own `gguf` writer from a tiny transformers model.

As llama.cpp's converter does for a LLaMA-family model: q/k projection rows are permuted for its
rotary layout, then every tensor is stored in the GGML type asked for it (quantized by the `gguf`
package's reference quantizers; K-quants, which it cannot make, as random blocks). The byte-level
tokenizer of `tiny_artifacts` goes into the metadata. `write_llama_gguf` returns the model with the
weights a reader must reproduce (each tensor's GGUF dequantization, q/k rows back in Hugging Face
order): the reference to compare a converted artifact against.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel

from devtools.builders.tiny_artifacts import (
    BOS_ID,
    CHATML_TEMPLATE,
    EOS_ID,
    SPECIAL_TOKENS,
    _bytes_to_unicode,
)
from kernels.codecs.gguf import permute_qk_rows

Q = GGMLQuantizationType
# K-quants, written as random blocks (`random_k_blocks`): the byte offsets of their fp16 scales
K_QUANTS: dict[Q, tuple[int, ...]] = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
}  # fmt: skip
# transformers keeps an MoE layer's gate and up projections fused: (E, 2I, H), gate rows first
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", ("ffn_gate_exps", "ffn_up_exps"))
MERGED = "!!"  # one merge: a BPE vocabulary with none is not a file llama.cpp writes
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1  # the model's vocab_size must match
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """model.layers.3.mlp.down_proj.weight -> blk.3.ffn_down.weight; a stacked expert parameter
    (model.layers.0.mlp.experts.down_proj, no suffix) -> blk.0.ffn_down_exps.weight."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    if ".experts." in hf_name:
        stem, suffix = hf_name, "weight"
    _, _, rest = stem.partition("model.layers.")
    layer, _, module = rest.partition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def _tokenizer_metadata(writer: GGUFWriter) -> None:
    chars = _bytes_to_unicode()
    tokens = [chars[b] for b in range(256)] + SPECIAL_TOKENS + [MERGED]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    types = [TokenType.NORMAL] * 256 + [TokenType.CONTROL] * len(SPECIAL_TOKENS) + [TokenType.NORMAL]
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(MERGED)])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _model_metadata(writer: GGUFWriter, model: PreTrainedModel) -> None:
    _config_metadata(writer, model.config)


def _config_metadata(writer: GGUFWriter, cfg: PretrainedConfig) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_experts", None):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_0)


def write_llama_gguf(
    path: Path, model: PreTrainedModel, types: dict[str, Q], *, weight_sized_k: bool = False
) -> PreTrainedModel:
    """Write `model` (LlamaForCausalLM or Qwen3MoeForCausalLM, default rope, `VOCAB_SIZE` tokens) to
    GGUF `path`; `types` maps a substring of a Hugging Face parameter name to its GGML type (first
    match; default F32 for 1-D tensors, F16 for the rest). K-quant tensors hold random blocks
    (`random_k_blocks`; `weight_sized_k`: super-block scales giving weights of a trained model's size,
    |w| ≈ 0.05, so that log-probs stay in a realistic range). Returns a copy of the model holding the
    weights the file decodes to."""
    arch = {"llama": "llama", "qwen3_moe": "qwen3moe"}[model.config.model_type]
    reference = copy.deepcopy(model)
    ref_params = dict(reference.named_parameters())
    writer = GGUFWriter(str(path), arch)
    _model_metadata(writer, model)
    _tokenizer_metadata(writer)
    for name, param in model.named_parameters():
        kind = next((t for key, t in types.items() if key in name), Q.F32 if param.dim() == 1 else Q.F16)
        w = param.detach().float()
        if name.endswith(FUSED_EXPERTS[0]):
            halves = w.chunk(2, dim=1)
            layer = name.removesuffix(FUSED_EXPERTS[0])
            decoded = [
                _add(
                    writer,
                    f"{layer.replace('model.layers.', 'blk.')}{part}.weight",
                    h,
                    kind,
                    None,
                    weight_sized_k,
                )
                for part, h in zip(FUSED_EXPERTS[1], halves, strict=True)
            ]
            decoded_w = torch.cat(decoded, dim=1)
        else:
            n_head = _qk_heads(model, arch, name)
            decoded_w = _add(writer, gguf_name(name), w, kind, n_head, weight_sized_k)
        with torch.no_grad():
            ref_params[name].copy_(decoded_w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _qk_heads(model: PreTrainedModel, arch: str, name: str) -> int | None:
    """Heads of a q / k projection whose rows llama.cpp permutes (LLaMA-family files only)."""
    if arch != "llama":
        return None
    cfg = model.config
    heads = {
        "self_attn.q_proj.weight": cfg.num_attention_heads,
        "self_attn.k_proj.weight": cfg.num_key_value_heads,
    }
    return next((h for suffix, h in heads.items() if name.endswith(suffix)), None)


def _add(
    writer: GGUFWriter, name: str, w: torch.Tensor, kind: Q, n_head: int | None, weight_sized_k: bool = False
) -> torch.Tensor:
    """Store `w` as `kind` (q/k rows permuted first when `n_head`); the values a reader decodes."""
    stored = permute_qk_rows(w, n_head) if n_head else w
    data = stored.numpy().astype(np.float16 if kind == Q.F16 else np.float32)
    if kind in K_QUANTS:
        d_range = WEIGHT_SIZED_K_SCALES[kind] if weight_sized_k else DEFAULT_K_SCALES
        data = random_k_blocks(tuple(w.shape), kind, seed=len(name), d_range=d_range)
    elif kind not in (Q.F32, Q.F16):
        data = quantize(np.ascontiguousarray(stored.numpy()), kind)
    writer.add_tensor(name, data, raw_dtype=kind)
    decoded = np.array(dequantize(data, kind), dtype=np.float32).reshape(tuple(w.shape))
    return torch.from_numpy(_unpermute(decoded, n_head) if n_head else decoded)


DEFAULT_K_SCALES = (1e-4, 2e-3)  # fp16 super-block scales d (and dmin) of `random_k_blocks`
# d ranges giving |w| ≈ 0.05 under random sub-block scales (Q4_K / Q5_K: 6-bit, Q6_K: int8) and codes
WEIGHT_SIZED_K_SCALES: dict[Q, tuple[float, float]] = {
    Q.Q4_K: (5e-5, 3e-4),
    Q.Q5_K: (2.5e-5, 1.5e-4),
    Q.Q6_K: (1e-5, 6e-5),
}


def random_k_blocks(
    shape: tuple[int, ...], kind: Q, seed: int, d_range: tuple[float, float] = DEFAULT_K_SCALES
) -> np.ndarray:
    """Random K-quant blocks (the `gguf` package has no K-quant quantizer): random codes and 6-bit
    sub-block scales/mins under fp16 super-block scales drawn from `d_range`; (*shape[:-1], bytes)."""
    block, size = GGML_QUANT_SIZES[kind]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    for offset in K_QUANTS[kind]:
        scale = rng.uniform(*d_range, (raw.shape[0], 1)).astype(np.float16)  # d, dmin
        raw[:, offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(*shape[:-1], k // block * size)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's q/k row permutation, written independently of Kiln's codec."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LARGE_CHUNK_VALUES = 1 << 22  # values generated and quantized at a time by `write_large_llama_gguf`


def write_large_llama_gguf(
    path: Path,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int = 128,
    kind: Q = Q.Q4_0,
    seed: int = 0,
) -> None:
    """A LLaMA GGUF too big to build as a transformers model: random weights (std 0.02) written tensor by
    tensor. Every tensor's info goes into the header first; then each tensor is generated, quantized a
    few rows at a time into its stored bytes and written before the next one is made, so the writer holds
    one tensor's stored bytes at most. Embeddings tied (F16, `VOCAB_SIZE` rows), norms F32 (ones),
    every linear layer `kind`; the q/k rows are random, so llama.cpp's permutation is left out."""
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        vocab_size=VOCAB_SIZE, tie_word_embeddings=True,
    )  # fmt: skip
    tensors = large_llama_tensors(cfg, kind)
    writer = GGUFWriter(str(path), "llama")
    _config_metadata(writer, cfg)
    _tokenizer_metadata(writer)
    for name, (shape, ggml_type) in tensors.items():
        stored = _stored_shape(shape, ggml_type)
        dtype = np.dtype({Q.F32: np.float32, Q.F16: np.float16}.get(ggml_type, np.uint8))
        raw = None if ggml_type in (Q.F32, Q.F16) else ggml_type
        writer.add_tensor_info(name, stored, dtype, int(np.prod(stored)) * dtype.itemsize, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(seed)
    for shape, ggml_type in tensors.values():
        writer.write_tensor_data(_random_stored(shape, ggml_type, gen))
    writer.close()


def large_llama_tensors(cfg: LlamaConfig, kind: Q) -> dict[str, tuple[tuple[int, ...], Q]]:
    """GGUF name -> (shape in torch order, GGML type) of every tensor, in llama.cpp's file order."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    tensors: dict[str, tuple[tuple[int, ...], Q]] = {"token_embd.weight": ((cfg.vocab_size, h), Q.F16)}
    for layer in range(cfg.num_hidden_layers):
        shapes = {
            "attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_norm": (h,), "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i),
        }  # fmt: skip
        for part, shape in shapes.items():
            tensors[f"blk.{layer}.{part}.weight"] = (shape, Q.F32 if len(shape) == 1 else kind)
    tensors["output_norm.weight"] = ((h,), Q.F32)
    return tensors


def _stored_shape(shape: tuple[int, ...], ggml_type: Q) -> tuple[int, ...]:
    """A quantized tensor's bytes as (rows, bytes per row); a float tensor's shape as it is."""
    if ggml_type in (Q.F32, Q.F16):
        return shape
    block, size = GGML_QUANT_SIZES[ggml_type]
    return (*shape[:-1], shape[-1] // block * size)


def _random_stored(shape: tuple[int, ...], ggml_type: Q, gen: torch.Generator) -> np.ndarray:
    """One tensor's stored values: ones for a norm, else N(0, 0.02) weights (quantized a few rows at a
    time when `ggml_type` is a block type)."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    if ggml_type == Q.F16:
        return (torch.randn(shape, generator=gen) * 0.02).numpy().astype(np.float16)
    rows, k = shape
    out = np.empty(_stored_shape(shape, ggml_type), dtype=np.uint8)
    step = max(1, LARGE_CHUNK_VALUES // k)
    for start in range(0, rows, step):
        chunk = torch.randn((min(step, rows - start), k), generator=gen) * 0.02
        out[start : start + chunk.shape[0]] = quantize(chunk.numpy(), ggml_type)
    return out
