"""Writers of small synthetic Llama checkpoints in every format Kiln ingests.

Weights are random but valid: integer formats draw random codes, positive scales and (asymmetric)
zero points, then pack them with the source-format encoders; FP8 formats quantize random bf16
weights. Everything is seeded, so the same call writes the same bytes (artifact ids are stable).

    write_checkpoint(path, "gptq", bits=4, group_size=128, sym=True, act_order=False, v2=False)
    write_checkpoint(path, "awq" | "ct-pack" | "ct-fp8" | "ct-int8" | "fp8" | "dense", ...)
    write_dense_checkpoint(path, dims=LARGE, ...)   # big bf16 checkpoints, written layer by layer
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kernels.base import IntWeight
from kernels.codecs.awq import encode_awq
from kernels.codecs.compressed_tensors import encode_pack_quantized
from kernels.codecs.fp8 import quantize_fp8
from kernels.codecs.gptq import encode_gptq

FORMATS = ("dense", "gptq", "awq", "ct-pack", "ct-fp8", "ct-int8", "fp8")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Dims:
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 512
    tie_word_embeddings: bool = False

    def module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """checkpoint module name -> (N, K)."""
        a, m = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        hd, h, i = self.head_dim, self.hidden, self.intermediate
        return {
            f"{a}.q_proj": (self.heads * hd, h),
            f"{a}.k_proj": (self.kv_heads * hd, h),
            f"{a}.v_proj": (self.kv_heads * hd, h),
            f"{a}.o_proj": (h, self.heads * hd),
            f"{m}.gate_proj": (i, h),
            f"{m}.up_proj": (i, h),
            f"{m}.down_proj": (h, i),
        }


TINY = Dims()


def llama_config(dims: Dims, dtype: str, quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": dims.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }
    if quantization is not None:
        cfg["quantization_config"] = quantization
    return cfg


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def random_int_weight(
    n: int, k: int, *, bits: int, group_size: int, sym: bool, scale_dtype: torch.dtype,
    g_idx: torch.Tensor | None, gen: torch.Generator, zero_range: tuple[int, int] | None = None,
) -> IntWeight:  # fmt: skip
    groups = 1 if group_size in (-1, 0) else k // group_size
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    zeros = None
    if not sym:
        lo, hi = zero_range or (1, (1 << bits) - 2)
        zeros = torch.randint(lo, hi + 1, (groups, n), generator=gen, dtype=torch.int32).to(torch.uint8)
    return IntWeight(codes=codes, scales=scales, bits=bits, group_size=group_size, zeros=zeros, g_idx=g_idx)


def act_order_g_idx(k: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """A non-monotonic g_idx: input channel k belongs to group (perm[k] // group_size)."""
    return (torch.randperm(k, generator=gen) // group_size).to(torch.int32)


def _input_group(module: str) -> str:
    """Modules that read the same activations (and so share act-order g_idx): q/k/v, gate/up."""
    for shared, members in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
        if module.rsplit(".", 1)[-1] in members:
            return module.rsplit(".", 1)[0] + "." + shared
    return module


def _quant_config(fmt: str, o: dict[str, Any]) -> dict[str, Any] | None:
    bits, gs, sym, ao = o["bits"], o["group_size"], o["sym"], o["act_order"]
    if fmt == "dense":
        return None
    if fmt == "gptq":
        return {
            "quant_method": "gptq", "bits": bits, "group_size": gs, "desc_act": ao, "sym": sym,
            "checkpoint_format": "gptq_v2" if o["v2"] and not o["mislabel"] else "gptq", "lm_head": False,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            **({"dynamic": o["dynamic"]} if o["dynamic"] else {}),
        }  # fmt: skip
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": o["ignore"] or None}  # fmt: skip
    if fmt == "fp8":
        cfg: dict[str, Any] = {
            "quant_method": "fp8",
            "activation_scheme": "static" if o["static_act"] else "dynamic",
        }
        if o["fp8_strategy"] == "block":
            cfg["weight_block_size"] = list(o["block"])
        if o["ignore"]:
            cfg["ignored_layers"] = o["ignore"]
        return cfg
    if fmt == "ct-pack":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "group" if gs > 0 else "channel", "group_size": gs if gs > 0 else None,
                   "actorder": "group" if ao else None}  # fmt: skip
        return _ct("pack-quantized", weights, None, o["ignore"])
    if fmt == "ct-fp8":
        strategy = o["fp8_strategy"]
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
                   "block_structure": list(o["block"]) if strategy == "block" else None}  # fmt: skip
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        return _ct("float-quantized", weights, acts, o["ignore"])
    if fmt == "ct-int8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "channel"}
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
        return _ct("int-quantized", weights, acts, o["ignore"])
    raise ValueError(f"unknown synthetic format {fmt!r}; known: {FORMATS}")


def _ct(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None, ignore: list[str]) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head", *ignore],
        "kv_cache_scheme": None,
    }


def _encode(
    fmt: str, module: str, n: int, k: int, o: dict[str, Any], gen: torch.Generator,
    g_idx_cache: dict[str, torch.Tensor], truth: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:  # fmt: skip
    bits, gs, sym = o["bits"], o["group_size"], o["sym"]
    dense_dtype = _dtype(o["dtype"])
    if fmt in ("fp8", "ct-fp8"):
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dense_dtype)
        q = quantize_fp8(w, o["fp8_strategy"], block_size=tuple(o["block"]))
        truth[module] = q.dequantize()
        if fmt == "fp8":
            key = "weight_scale_inv" if q.strategy == "block" else "weight_scale"
            scale = q.scale.reshape(()) if q.strategy == "tensor" else q.scale
            out = {"weight": q.weight, key: scale}
            if o["static_act"]:
                out["input_scale"] = torch.tensor(0.01, dtype=torch.float32)
            return out
        if q.strategy == "tensor":
            scale = q.scale.reshape(1)
        elif q.strategy == "channel":
            scale = q.scale.reshape(n, 1)
        else:
            scale = q.scale
        return {"weight": q.weight, "weight_scale": scale}
    if fmt == "ct-int8":
        weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
        scale = (torch.rand(n, 1, generator=gen) * 0.01 + 0.001).to(dense_dtype)
        truth[module] = weight.float() * scale.float()
        return {"weight": weight, "weight_scale": scale}
    g_idx = None
    if o["act_order"]:
        group = _input_group(module)
        if group not in g_idx_cache:
            g_idx_cache[group] = act_order_g_idx(k, gs, gen)
        g_idx = g_idx_cache[group].clone()
    scale_dtype = torch.float16 if fmt in ("gptq", "awq") else dense_dtype
    w = random_int_weight(
        n, k, bits=bits, group_size=gs, sym=sym, scale_dtype=scale_dtype, g_idx=g_idx, gen=gen
    )
    truth[module] = w.dequantize()
    if fmt == "gptq":
        if o["mislabel"]:
            return encode_gptq(w, v2=True)  # v2 bytes under a v1 label
        return encode_gptq(w, v2=o["v2"])
    if fmt == "awq":
        if w.zeros is None:
            w.zeros = torch.full_like(w.scales, 8, dtype=torch.uint8)
        return encode_awq(w)
    return encode_pack_quantized(w)


def write_checkpoint(
    path: Path,
    fmt: str,
    *,
    dims: Dims = TINY,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    act_order: bool = False,
    v2: bool = False,
    mislabel: bool = False,
    fp8_strategy: str = "tensor",
    block: tuple[int, int] = (128, 128),
    dtype: str | None = None,
    sharded: bool = False,
    ignore: list[str] | None = None,
    dynamic: dict[str, Any] | None = None,
    seed: int = 0,
    quant_config_file: str | None = None,
    truth: dict[str, torch.Tensor] | None = None,
    static_act: bool = False,
) -> Path:
    """Write a synthetic checkpoint directory; returns `path`.

    `ignore` lists checkpoint module names left dense (in the format's own ignore list);
    `quant_config_file` moves the quantization config out of config.json into that file.
    `truth`, when given, is filled with every linear module's exact weight ((N, K) float32, as the
    writer generated it before packing) — the ground truth a converted artifact must reproduce.
    """
    truth = {} if truth is None else truth
    if dtype is None:
        dtype = "float16" if fmt in ("gptq", "awq") else "bfloat16"
    opts = {"bits": bits, "group_size": group_size, "sym": sym, "act_order": act_order, "v2": v2,
            "mislabel": mislabel, "fp8_strategy": fp8_strategy, "block": block, "dtype": dtype,
            "ignore": list(ignore or []), "dynamic": dynamic, "static_act": static_act}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    dense_dtype = _dtype(dtype)
    path.mkdir(parents=True, exist_ok=True)
    g_idx_cache: dict[str, torch.Tensor] = {}
    dynamic_negative = [p[2:] for p in (dynamic or {}) if p.startswith("-:")]
    files: list[dict[str, torch.Tensor]] = [{}]
    files[0]["model.embed_tokens.weight"] = (torch.randn(dims.vocab, dims.hidden, generator=gen) * 0.02).to(
        dense_dtype
    )
    for layer in range(dims.layers):
        out = files[-1]
        if sharded and layer > 0:
            out = {}
            files.append(out)
        for ln in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{layer}.{ln}.weight"] = (1 + 0.1 * torch.randn(dims.hidden, generator=gen)).to(
                dense_dtype
            )
        for module, (n, k) in dims.module_shapes(layer).items():
            fused = _input_group(module).replace(".qkv", ".qkv_proj").replace(".gate_up", ".gate_up_proj")
            dense = (
                fmt == "dense"
                or module in opts["ignore"]
                or any(re.match(p, fused) for p in dynamic_negative)
            )
            if dense:
                out[f"{module}.weight"] = (torch.randn(n, k, generator=gen) * 0.05).to(dense_dtype)
                truth[module] = out[f"{module}.weight"].float()
            else:
                for suffix, t in _encode(fmt, module, n, k, opts, gen, g_idx_cache, truth).items():
                    out[f"{module}.{suffix}"] = t
    files[-1]["model.norm.weight"] = torch.ones(dims.hidden, dtype=dense_dtype)
    if not dims.tie_word_embeddings:
        files[-1]["lm_head.weight"] = (torch.randn(dims.vocab, dims.hidden, generator=gen) * 0.02).to(
            dense_dtype
        )
        truth["lm_head"] = files[-1]["lm_head.weight"].float()
    _save(path, files)
    quant = _quant_config(fmt, opts)
    config = llama_config(dims, dtype, None if quant_config_file else quant)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if quant_config_file and quant is not None:
        (path / quant_config_file).write_text(json.dumps(quant, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def _save(path: Path, files: list[dict[str, torch.Tensor]]) -> None:
    if len(files) == 1:
        save_file(files[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {
        "metadata": {"total_size": sum(t.nbytes for f in files for t in f.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_dense_checkpoint(path: Path, dims: Dims, *, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A large unquantized checkpoint written one decoder layer per file (bounded memory)."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dt = _dtype(dtype)
    n_files = dims.layers + 1
    weight_map: dict[str, str] = {}
    total = 0

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dt)

    for i in range(n_files):
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        if i == dims.layers:
            tensors["model.embed_tokens.weight"] = rand(dims.vocab, dims.hidden)
            tensors["model.norm.weight"] = torch.ones(dims.hidden, dtype=dt)
            if not dims.tie_word_embeddings:
                tensors["lm_head.weight"] = rand(dims.vocab, dims.hidden)
        else:
            for module, (n, k) in dims.module_shapes(i).items():
                tensors[f"{module}.weight"] = rand(n, k)
            for ln in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{i}.{ln}.weight"] = torch.ones(dims.hidden, dtype=dt)
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(llama_config(dims, dtype), indent=2))
    return path


def dims_for_bytes(target_bytes: int, *, hidden: int = 2048, intermediate: int = 8192) -> Dims:
    """Dims of a bf16 Llama whose weights total at least `target_bytes`."""
    base = replace(
        TINY, hidden=hidden, intermediate=intermediate, heads=hidden // 128, kv_heads=hidden // 512,
        head_dim=128, vocab=32000,
    )  # fmt: skip
    per_layer = sum(n * k for n, k in base.module_shapes(0).values()) * 2
    fixed = 2 * base.vocab * hidden * 2
    layers = max(1, -(-(target_bytes - fixed) // per_layer))
    return replace(base, layers=layers)
