"""Writers of small synthetic Llama checkpoints in every format Kiln ingests.

Weights are random but valid: integer formats draw random codes, positive scales and (asymmetric)
zero points, then pack them with the source-format encoders; FP8 formats quantize random bf16
weights. Everything is seeded, so the same call writes the same bytes (artifact ids are stable).

    write_checkpoint(path, "gptq", bits=4, group_size=128, sym=True, act_order=False, v2=False)
    write_checkpoint(path, "awq" | "ct-pack" | "ct-fp8" | "ct-int8" | "ct-nvfp4" | "ct-mxfp4" | "fp8" |
                     "dense", ...)
    write_large_checkpoint(path, dims, fmt="dense" | "ct-pack" | ...)  # big checkpoints, layer by layer

Mixture-of-experts and Qwen3 checkpoints come from the same writer through `Dims`' architecture and
MoE fields (presets QWEN3_TINY, QWEN3_MOE_TINY, MIXTRAL_TINY, QWEN2_MOE_TINY): every expert is a
separate Linear (`model.layers.{i}.mlp.experts.{e}.gate_proj|up_proj|down_proj`, Mixtral
`block_sparse_moe.experts.{e}.w1|w3|w2`) quantized like any other module (per-expert act-order
g_idx shared by an expert's gate and up), the router (`mlp.gate` / `block_sparse_moe.gate`, (E, H)) and
Qwen2-MoE's `shared_expert_gate` (1, H) stay dense. `defect=` writes the bad inputs MoE loaders must
refuse (MOE_DEFECTS). Llama checkpoints (the default Dims) are written exactly as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kernels.base import Fp4Weight, IntWeight
from kernels.codecs.awq import encode_awq
from kernels.codecs.compressed_tensors import encode_pack_quantized
from kernels.codecs.fp4 import pack_fp4
from kernels.codecs.fp8 import quantize_fp8
from kernels.codecs.gptq import encode_gptq

FORMATS = ("dense", "gptq", "awq", "ct-pack", "ct-fp8", "ct-int8", "ct-nvfp4", "ct-mxfp4", "fp8")
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
    # Architecture and mixture-of-experts fields (the defaults write a dense Llama, as always).
    architecture: str = "LlamaForCausalLM"  # a key of ARCHITECTURES
    num_experts: int = 0  # > 0: MoE layers with this many experts
    top_k: int = 2  # num_experts_per_tok
    moe_intermediate: int = 0  # per expert; 0: `intermediate` (Mixtral has only the one size)
    norm_topk_prob: bool = True  # Qwen MoE: renormalise the top-k weights (Mixtral always does)
    decoder_sparse_step: int = 1  # Qwen MoE: layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense MLP of `intermediate`)
    shared_expert_intermediate: int = 0  # Qwen2-MoE: the shared expert's size (its sigmoid gate: (1, H))
    expert_parts: tuple[str, str, str] | None = None  # (gate, up, down) in an expert; None: the arch's

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r}; known: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[self.architecture]
        if self.num_experts and arch.moe_block is None:
            raise ValueError(f"{self.architecture} has no experts; num_experts must be 0")
        if arch.moe_block is not None and self.num_experts <= 0:
            raise ValueError(f"{self.architecture} needs num_experts > 0")
        mixtral = self.architecture == "MixtralForCausalLM"
        if mixtral and (self.mlp_only_layers or self.decoder_sparse_step != 1):
            raise ValueError("Mixtral has no dense layers (mlp_only_layers / decoder_sparse_step)")
        if self.shared_expert_intermediate and self.architecture != "Qwen2MoeForCausalLM":
            raise ValueError("only Qwen2MoeForCausalLM has a shared expert")

    @property
    def arch(self) -> Arch:
        return ARCHITECTURES[self.architecture]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_intermediate(self) -> int:
        return self.moe_intermediate or self.intermediate

    @property
    def parts(self) -> tuple[str, str, str]:
        """Module names of an expert's gate, up and down projections."""
        return self.expert_parts or self.arch.expert_parts

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.is_moe_layer(i)]

    def moe_block(self, layer: int) -> str:
        """`model.layers.{layer}.mlp` (Qwen MoE) or `model.layers.{layer}.block_sparse_moe` (Mixtral)."""
        return f"model.layers.{layer}.{self.arch.moe_block}"

    def router(self, layer: int) -> str:
        return f"{self.moe_block(layer)}.gate"

    def expert_prefix(self, layer: int, expert: int) -> str:
        return f"{self.moe_block(layer)}.experts.{expert}"

    def expert_module(self, layer: int, expert: int, part: int) -> str:
        """Checkpoint module of an expert's gate (0), up (1) or down (2) projection."""
        return f"{self.expert_prefix(layer, expert)}.{self.parts[part]}"

    def module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """checkpoint module name -> (N, K) of every quantizable linear (experts one by one)."""
        a, m = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        hd, h, i = self.head_dim, self.hidden, self.intermediate
        shapes = {
            f"{a}.q_proj": (self.heads * hd, h),
            f"{a}.k_proj": (self.kv_heads * hd, h),
            f"{a}.v_proj": (self.kv_heads * hd, h),
            f"{a}.o_proj": (h, self.heads * hd),
        }
        if not self.is_moe_layer(layer):
            shapes.update({f"{m}.gate_proj": (i, h), f"{m}.up_proj": (i, h), f"{m}.down_proj": (h, i)})
            return shapes
        ie = self.expert_intermediate
        for e in range(self.num_experts):
            gate, up, down = (self.expert_module(layer, e, p) for p in range(3))
            shapes.update({gate: (ie, h), up: (ie, h), down: (h, ie)})
        if self.shared_expert_intermediate:
            s, ish = f"{m}.shared_expert", self.shared_expert_intermediate
            shapes.update({f"{s}.gate_proj": (ish, h), f"{s}.up_proj": (ish, h), f"{s}.down_proj": (h, ish)})
        return shapes

    def dense_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """Linear modules always stored dense: the MoE router and Qwen2-MoE's shared-expert gate."""
        if not self.is_moe_layer(layer):
            return {}
        shapes = {self.router(layer): (self.num_experts, self.hidden)}
        if self.shared_expert_intermediate:
            shapes[f"model.layers.{layer}.mlp.shared_expert_gate"] = (1, self.hidden)
        return shapes


@dataclass(frozen=True)
class Arch:
    """What the writer needs to know of an architecture."""

    model_type: str
    qk_norm: bool = False  # Qwen3: q_norm / k_norm (head_dim,) per layer
    qkv_bias: bool = False  # Qwen2-MoE: q/k/v biases
    moe_block: str | None = None  # module holding router + experts
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    num_experts_key: str = "num_experts"


ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": Arch("llama"),
    "Qwen3ForCausalLM": Arch("qwen3", qk_norm=True),
    "Qwen3MoeForCausalLM": Arch("qwen3_moe", qk_norm=True, moe_block="mlp"),
    "MixtralForCausalLM": Arch(
        "mixtral",
        moe_block="block_sparse_moe",
        expert_parts=("w1", "w3", "w2"),
        num_experts_key="num_local_experts",
    ),
    "Qwen2MoeForCausalLM": Arch("qwen2_moe", qkv_bias=True, moe_block="mlp"),
}


TINY = Dims()
# Qwen3 dense; Qwen3-MoE with one dense layer (mlp_only_layers) after an MoE one, Marlin-compatible
# experts (N % 64 == 0, K % 128 == 0); Mixtral; Qwen2-MoE with a shared expert.
QWEN3_TINY = Dims(architecture="Qwen3ForCausalLM")
QWEN3_MOE_TINY = Dims(
    architecture="Qwen3MoeForCausalLM", num_experts=8, top_k=2, moe_intermediate=128, mlp_only_layers=(1,)
)
MIXTRAL_TINY = Dims(architecture="MixtralForCausalLM", intermediate=128, num_experts=4, top_k=2)
QWEN2_MOE_TINY = Dims(
    architecture="Qwen2MoeForCausalLM", num_experts=4, top_k=2, moe_intermediate=128, norm_topk_prob=False,
    shared_expert_intermediate=256,
)  # fmt: skip

# Bad MoE inputs (write_checkpoint(defect=...)); all touch the first MoE layer only.
MOE_DEFECTS = (
    "missing-expert",  # every tensor of the last expert absent
    "missing-expert-part",  # expert 1's down projection absent
    "unequal-experts",  # expert 1 twice as wide (gate/up (2I, H), down (H, 2I))
    "router-wrong-size",  # router (E + 1, H)
    "config-more-experts",  # config.json says E + 1 experts; tensors and router hold E
    "config-fewer-experts",  # config.json says E - 1 experts
    "partial-quant",  # expert 0 dense and listed as such (ignore list / GPTQ dynamic "-:" rule)
    "partial-quant-unlisted",  # expert 0 dense while the quantization config claims it quantized
)


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


def model_config(
    dims: Dims, dtype: str, quantization: dict[str, Any] | None = None, *, num_experts: int | None = None
) -> dict[str, Any]:
    """config.json of any architecture (a Llama exactly as `llama_config`); `num_experts` overrides
    the count the config claims (bad inputs)."""
    if dims.architecture == "LlamaForCausalLM":
        return llama_config(dims, dtype, quantization)
    arch = dims.arch
    cfg = llama_config(dims, dtype)
    cfg["architectures"] = [dims.architecture]
    cfg["model_type"] = arch.model_type
    cfg["rope_theta"] = 1000000.0
    if dims.architecture != "MixtralForCausalLM":
        cfg["rms_norm_eps"] = 1e-6
        cfg["use_sliding_window"] = False
    cfg["sliding_window"] = None
    if dims.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        cfg["attention_bias"] = False
    if dims.is_moe:
        experts = dims.num_experts if num_experts is None else num_experts
        cfg[arch.num_experts_key] = experts
        cfg["num_experts_per_tok"] = dims.top_k
        cfg["router_aux_loss_coef"] = 0.001
        cfg["output_router_logits"] = False
        if dims.architecture == "MixtralForCausalLM":
            cfg["intermediate_size"] = dims.expert_intermediate
        else:
            cfg["moe_intermediate_size"] = dims.expert_intermediate
            cfg["norm_topk_prob"] = dims.norm_topk_prob
            cfg["decoder_sparse_step"] = dims.decoder_sparse_step
            cfg["mlp_only_layers"] = list(dims.mlp_only_layers)
        if dims.shared_expert_intermediate:
            cfg["shared_expert_intermediate_size"] = dims.shared_expert_intermediate
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
    groups = (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj", "w1", "w3")))
    for shared, members in groups:
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
    if fmt == "ct-nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "tensor_group", "group_size": 16,
                   "scale_dtype": "torch.float8_e4m3fn"}  # fmt: skip
        return _ct("nvfp4-pack-quantized", weights, None, o["ignore"])
    if fmt == "ct-mxfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}  # fmt: skip
        return _ct("mxfp4-pack-quantized", weights, None, o["ignore"])
    raise ValueError(f"unknown synthetic format {fmt!r}; known: {FORMATS}")


def _encode_fp4(
    fmt: str, module: str, n: int, k: int, gen: torch.Generator, globals_: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Random E2M1 codes with compressed-tensors' FP4 tensors: NVFP4 E4M3 scales per 16 and a global
    divisor shared by the modules reading the same input (as llm-compressor fuses q/k/v and gate/up),
    MXFP4 E8M0 bytes per 32."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if fmt == "ct-mxfp4":
        scales = torch.randint(118, 124, (n, k // 32), generator=gen, dtype=torch.uint8)
        truth[module] = Fp4Weight(codes, scales, "mxfp4").dequantize()
        return {"weight_packed": pack_fp4(codes), "weight_scale": scales}
    scales = (torch.rand(n, k // 16, generator=gen) * 440 + 8).to(torch.float8_e4m3fn)
    group = "global:" + _input_group(module)  # keyed apart from the act-order g_idx of the same cache
    if group not in globals_:
        globals_[group] = (torch.rand(1, generator=gen) * 4000 + 2000).float()  # ≈ 448 * 6 / amax
    divisor = globals_[group]
    truth[module] = Fp4Weight(codes, scales, "nvfp4", 1.0 / divisor).dequantize()
    return {"weight_packed": pack_fp4(codes), "weight_scale": scales, "weight_global_scale": divisor.clone()}


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
    if fmt in ("ct-nvfp4", "ct-mxfp4"):
        return _encode_fp4(fmt, module, n, k, gen, g_idx_cache, truth)
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
    defect: str | None = None,
    router_in_ignore: bool = True,
) -> Path:
    """Write a synthetic checkpoint directory; returns `path`.

    `ignore` lists checkpoint module names left dense (in the format's own ignore list);
    `quant_config_file` moves the quantization config out of config.json into that file.
    `truth`, when given, is filled with every linear module's exact weight ((N, K) float32, as the
    writer generated it before packing) — the ground truth a converted artifact must reproduce.
    MoE `dims` add every expert and router (and shared expert / its gate) to `truth`; routers are
    named in the format's ignore list (compressed-tensors `ignore`, fp8 `ignored_layers`, AWQ
    `modules_to_not_convert`; GPTQ has none) unless `router_in_ignore` is False. `defect` (one of
    MOE_DEFECTS) writes a bad MoE checkpoint.
    """
    truth = {} if truth is None else truth
    if dtype is None:
        dtype = "float16" if fmt in ("gptq", "awq") else "bfloat16"
    plan = _MoEPlan.make(dims, fmt, defect)
    ignore = list(ignore or [])
    if plan.listed_dense:
        if fmt == "gptq":
            dynamic = {**(dynamic or {}), **{f"-:{re.escape(p)}\\..*": {} for p in plan.listed_dense}}
        else:
            ignore += [f"{p}.{part}" for p in plan.listed_dense for part in dims.parts]
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
    always_dense: list[str] = []
    for layer in range(dims.layers):
        out = files[-1]
        if sharded and layer > 0:
            out = {}
            files.append(out)
        for ln in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{layer}.{ln}.weight"] = (1 + 0.1 * torch.randn(dims.hidden, generator=gen)).to(
                dense_dtype
            )
        if dims.arch.qk_norm:
            for qk in ("q_norm", "k_norm"):
                out[f"model.layers.{layer}.self_attn.{qk}.weight"] = (
                    1 + 0.1 * torch.randn(dims.head_dim, generator=gen)
                ).to(dense_dtype)
        for module, (n, k) in plan.module_shapes(layer).items():
            fused = _input_group(module).replace(".qkv", ".qkv_proj").replace(".gate_up", ".gate_up_proj")
            dense = (
                fmt == "dense"
                or module in opts["ignore"]
                or any(re.match(p, fused) for p in dynamic_negative)
                or module.rsplit(".", 1)[0] in plan.unlisted_dense
            )
            if dense:
                out[f"{module}.weight"] = (torch.randn(n, k, generator=gen) * 0.05).to(dense_dtype)
                truth[module] = out[f"{module}.weight"].float()
            else:
                for suffix, t in _encode(fmt, module, n, k, opts, gen, g_idx_cache, truth).items():
                    out[f"{module}.{suffix}"] = t
            if dims.arch.qkv_bias and module.endswith((".q_proj", ".k_proj", ".v_proj")):
                out[f"{module}.bias"] = (0.1 * torch.randn(n, generator=gen)).to(dense_dtype)
        for module, (n, k) in plan.dense_shapes(layer).items():
            out[f"{module}.weight"] = (torch.randn(n, k, generator=gen) * 0.05).to(dense_dtype)
            truth[module] = out[f"{module}.weight"].float()
            always_dense.append(module)
    files[-1]["model.norm.weight"] = torch.ones(dims.hidden, dtype=dense_dtype)
    if not dims.tie_word_embeddings:
        files[-1]["lm_head.weight"] = (torch.randn(dims.vocab, dims.hidden, generator=gen) * 0.02).to(
            dense_dtype
        )
        truth["lm_head"] = files[-1]["lm_head.weight"].float()
    _save(path, files)
    config_opts = opts
    if router_in_ignore and always_dense:
        config_opts = {**opts, "ignore": opts["ignore"] + always_dense}
    quant = _quant_config(fmt, config_opts)
    config = model_config(dims, dtype, None if quant_config_file else quant, num_experts=plan.config_experts)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if quant_config_file and quant is not None:
        (path / quant_config_file).write_text(json.dumps(quant, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


@dataclass(frozen=True)
class _MoEPlan:
    """What a `defect` changes in an MoE checkpoint (all in the first MoE layer); empty otherwise."""

    dims: Dims
    layer: int = -1
    skipped: frozenset[str] = frozenset()  # modules not written
    reshaped: tuple[tuple[str, tuple[int, int]], ...] = ()  # module -> (N, K) written instead
    router_rows: int | None = None
    config_experts: int | None = None  # num_experts claimed by config.json
    listed_dense: tuple[str, ...] = ()  # expert prefixes written dense and named in the quant config
    unlisted_dense: frozenset[str] = frozenset()  # expert prefixes written dense, config unaware

    @classmethod
    def make(cls, dims: Dims, fmt: str, defect: str | None) -> _MoEPlan:
        if defect is None:
            return cls(dims)
        if defect not in MOE_DEFECTS:
            raise ValueError(f"unknown MoE defect {defect!r}; known: {MOE_DEFECTS}")
        if not dims.moe_layers():
            raise ValueError(f"defect {defect!r} needs MoE dims with at least one MoE layer")
        if defect.startswith("partial-quant") and fmt == "dense":
            raise ValueError(f"defect {defect!r} needs a quantized format")
        layer, e, h, i = dims.moe_layers()[0], dims.num_experts, dims.hidden, dims.expert_intermediate
        if defect == "missing-expert":
            return cls(dims, layer, skipped=frozenset(dims.expert_module(layer, e - 1, p) for p in range(3)))
        if defect == "missing-expert-part":
            return cls(dims, layer, skipped=frozenset({dims.expert_module(layer, 1, 2)}))
        if defect == "unequal-experts":
            gate, up, down = (dims.expert_module(layer, 1, p) for p in range(3))
            return cls(dims, layer, reshaped=((gate, (2 * i, h)), (up, (2 * i, h)), (down, (h, 2 * i))))
        if defect == "router-wrong-size":
            return cls(dims, layer, router_rows=e + 1)
        if defect == "config-more-experts":
            return cls(dims, layer, config_experts=e + 1)
        if defect == "config-fewer-experts":
            return cls(dims, layer, config_experts=e - 1)
        if defect == "partial-quant":
            return cls(dims, layer, listed_dense=(dims.expert_prefix(layer, 0),))
        return cls(dims, layer, unlisted_dense=frozenset({dims.expert_prefix(layer, 0)}))

    def module_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        shapes = self.dims.module_shapes(layer)
        if layer != self.layer:
            return shapes
        shapes.update(dict(self.reshaped))
        return {m: nk for m, nk in shapes.items() if m not in self.skipped}

    def dense_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        shapes = self.dims.dense_shapes(layer)
        if layer == self.layer and self.router_rows is not None:
            shapes[self.dims.router(layer)] = (self.router_rows, self.dims.hidden)
        return shapes


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


def write_large_checkpoint(
    path: Path,
    dims: Dims,
    *,
    fmt: str = "dense",
    dtype: str = "bfloat16",
    seed: int = 0,
    group_size: int = 128,
) -> Path:
    """A large checkpoint written one decoder layer per file (bounded memory; no ground truth kept);
    any architecture without biases (Llama, Qwen3, Qwen3-MoE, Mixtral). `fmt` other than "dense"
    quantizes every decoder linear (4-bit, symmetric, `group_size`) as `write_checkpoint` does."""
    if dims.arch.qkv_bias or dims.shared_expert_intermediate:
        raise ValueError("write_large_checkpoint writes no biases or shared experts; use write_checkpoint")
    opts = {"bits": 4, "group_size": group_size, "sym": True, "act_order": False, "v2": False,
            "mislabel": False, "fp8_strategy": "tensor", "block": (128, 128), "dtype": dtype, "ignore": [],
            "dynamic": None, "static_act": False}  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dt = _dtype(dtype)
    n_files = dims.layers + 1
    always_dense = [m for i in range(dims.layers) for m in dims.dense_shapes(i)]
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
                if fmt == "dense":
                    tensors[f"{module}.weight"] = rand(n, k)
                else:
                    for suffix, t in _encode(fmt, module, n, k, opts, gen, {}, {}).items():
                        tensors[f"{module}.{suffix}"] = t
            for module, (n, k) in dims.dense_shapes(i).items():
                tensors[f"{module}.weight"] = rand(n, k)
            for ln in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{i}.{ln}.weight"] = torch.ones(dims.hidden, dtype=dt)
            if dims.arch.qk_norm:
                for qk in ("q_norm", "k_norm"):
                    tensors[f"model.layers.{i}.self_attn.{qk}.weight"] = torch.ones(dims.head_dim, dtype=dt)
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = model_config(dims, dtype, _quant_config(fmt, {**opts, "ignore": list(always_dense)}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def dims_for_bytes(target_bytes: int, *, hidden: int = 2048, intermediate: int = 8192, **moe: Any) -> Dims:
    """Dims of a bf16 model whose weights total at least `target_bytes`: a Llama, or with `moe`
    (architecture=, num_experts=, moe_intermediate=, ...) a mixture-of-experts model."""
    base = replace(
        TINY, hidden=hidden, intermediate=intermediate, heads=hidden // 128, kv_heads=hidden // 512,
        head_dim=128, vocab=32000, **moe,
    )  # fmt: skip
    per_layer = sum(n * k for n, k in {**base.module_shapes(0), **base.dense_shapes(0)}.values()) * 2
    fixed = 2 * base.vocab * hidden * 2
    layers = max(1, -(-(target_bytes - fixed) // per_layer))
    return replace(base, layers=layers)
