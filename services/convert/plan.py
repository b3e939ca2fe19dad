"""The conversion plan: for every linear layer, its scheme, per-rank LinearSpec, the kernel chosen
for the target and every kernel rejected on the way (vLLM's choose_mp_linear_kernel idea).

A layer "falls back" when the kernel that would take its scheme at a kernel-friendly shape refused
this layer's actual (per-rank) shape, e.g. Marlin's N % 64 / K % 128 rules; the plan says so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kernels.base import LinearKernel, LinearSpec, ShardSpec, StoredTensor, Target
from kernels.errors import NoKernelError, UnsupportedError
from kernels.registry import candidates, choose_kernel
from runtime.model_layout import LinearLayout, ModelConfig, expert_groups, linear_layouts, rank_shape
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError
from services.convert.experts import PlannedExperts, plan_experts
from services.convert.formats.base import DENSE, CheckpointFormat, LayerQuant
from services.convert.limits import check_pattern_work
from services.convert.spec import FP8_SCHEMES, METHODS

ONLINE_FP8_BLOCK = (128, 128)
_IDEAL_DIM = 4096  # a shape every kernel takes, to tell a shape fallback from a scheme mismatch
_FLOAT_ACT = {"bfloat16": "bfloat16", "float16": "float16", "bf16": "bfloat16", "fp16": "float16"}
# Tensor suffixes that only quantized layers have: left over after planning they mean a layer Kiln
# does not know, which it must not silently pass through.
QUANTIZED_SUFFIXES = (
    "qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
    "weight_g_idx", "weight_shape", "weight_scale_inv", "input_scale",
)  # fmt: skip
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
# Static activation / KV-cache scales: the kernels quantize activations dynamically and the runtime
# has its own KV-cache handling, so these are dropped (and the plan says so).
DROPPED_SCALE_SUFFIXES = ("input_scale", "output_scale", "k_scale", "v_scale")


@dataclass
class PlannedLayer:
    layout: LinearLayout
    quant: LayerQuant  # as stored in the checkpoint (agreed by every shard)
    target_quant: LayerQuant  # what the artifact holds (online FP8 changes dense -> fp8)
    specs: list[LinearSpec]  # one per TP rank
    kernel: LinearKernel
    rejected: list[tuple[str, str]]
    fallback: bool
    source_tensors: list[str]

    @property
    def online_fp8(self) -> bool:
        return self.quant.scheme == "dense" and self.target_quant.scheme == "fp8"

    @property
    def name(self) -> str:
        return self.layout.name


@dataclass(frozen=True)
class PlanRow:
    layer: str
    shards: list[str]
    scheme: str
    kernel: str
    fallback: bool
    rejections: list[tuple[str, str]]
    n: int
    k: int

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rejections"] = [{"kernel": k, "reason": r} for k, r in self.rejections]
        return d


@dataclass
class Plan:
    source: str
    format: str
    quantization: dict[str, Any] | None
    target: Target
    tp: int
    method: str
    fp8_scheme: str
    act_dtype: str
    model: ModelConfig
    layers: list[PlannedLayer]
    other_tensors: list[str]
    notes: list[str] = field(default_factory=list)
    expert_groups: list[PlannedExperts] = field(default_factory=list)
    expert_parallel: bool = False
    other_bytes: int = 0  # the other tensors as one rank file stores them

    def rank_bytes(self) -> list[int]:
        """Tensor bytes of each rank file, from the kernels' declared layouts (optional tensors, such as
        an act-order permutation that turns out trivial, counted: an upper bound by at most those)."""
        t = self.target
        return [
            self.other_bytes
            + sum(stored_bytes(pl.kernel.stored_tensors(pl.specs[rank], t)) for pl in self.layers)
            + sum(stored_bytes(pe.kernel.stored_tensors(pe.specs[rank], t)) for pe in self.expert_groups)
            for rank in range(self.tp)
        ]

    @property
    def rows(self) -> list[PlanRow]:
        return [
            PlanRow(
                layer=pl.name,
                shards=[s.module for s in pl.layout.shards],
                scheme=pl.target_quant.describe() + (" (online)" if pl.online_fp8 else ""),
                kernel=pl.kernel.name,
                fallback=pl.fallback,
                rejections=list(pl.rejected),
                n=pl.specs[0].n,
                k=pl.specs[0].k,
            )
            for pl in self.layers
        ] + [
            PlanRow(
                layer=pe.name,
                shards=[f"{pe.layout.expert_prefix.format(e='*')}.{p}" for p in pe.layout.parts],
                scheme=f"{pe.describe()}, {pe.target_quant.describe()}"
                + (" (online)" if pe.online_fp8 else ""),
                kernel=pe.kernel.name,
                fallback=pe.fallback,
                rejections=list(pe.rejected),
                n=pe.specs[0].w13.n,
                k=pe.specs[0].w13.k,
            )
            for pe in self.expert_groups
        ]

    @property
    def options(self) -> dict[str, Any]:
        """What besides source, target, tp, method and layouts determines the artifact's bytes."""
        options: dict[str, Any] = {"fp8_scheme": self.fp8_scheme} if self.method == "fp8" else {}
        if self.expert_parallel:
            options["expert_parallel"] = True
        return options

    def layout_versions(self) -> dict[str, int]:
        kernels = [*(pl.kernel for pl in self.layers), *(pe.kernel for pe in self.expert_groups)]
        return {k.name: k.layout_version for k in kernels}

    @property
    def num_fallbacks(self) -> int:
        return sum(pl.fallback for pl in self.layers) + sum(pe.fallback for pe in self.expert_groups)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "format": self.format,
            "quantization": self.quantization,
            "target": self.target.value,
            "tp": self.tp,
            "method": self.method,
            "options": self.options,
            "act_dtype": self.act_dtype,
            "architecture": self.model.architecture,
            "notes": self.notes,
            "layers": [r.to_json() for r in self.rows],
            "other_tensors": self.other_tensors,
            "fallbacks": self.num_fallbacks,
            "expected_bytes": {"per_rank": (per_rank := self.rank_bytes()), "total": sum(per_rank)},
        }


def stored_bytes(tensors: dict[str, StoredTensor]) -> int:
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values())


def other_tensor_bytes(ckpt: Checkpoint, names: list[str], act_dtype: str) -> int:
    """What the pipeline writes for the other tensors (sm75's fp16 narrows bf16 / fp32 ones)."""
    total = 0
    for name in names:
        info = ckpt.tensors[name]
        narrowed = act_dtype == "float16" and info.dtype in ("BF16", "F32")
        total += math.prod(info.shape) * 2 if narrowed else info.nbytes
    return total


def act_dtype_for(model: ModelConfig, target: Target) -> str:
    if not target.has_bf16:
        return "float16"
    dtype = _FLOAT_ACT.get(model.torch_dtype.removeprefix("torch."))
    if dtype:
        return dtype
    return "float32" if target is Target.CPU else "bfloat16"


def _agree(fmt: CheckpointFormat, layout: LinearLayout) -> LayerQuant:
    quants = [(s.module, fmt.layer_quant(s.module, layout)) for s in layout.shards]
    first = quants[0][1]
    if any(q != first for _, q in quants[1:]):
        detail = ", ".join(f"{m}: {q.describe()}" for m, q in quants)
        raise UnsupportedError(
            f"the shards of fused layer {layout.name} are quantized differently ({detail}); all shards of "
            "qkv_proj / gate_up_proj must share scheme, bits, group size and ignore status"
        )
    return first


def online_fp8_quant(fp8_scheme: str) -> LayerQuant:
    """What --method fp8 turns a dense layer into (vLLM's online FP8)."""
    return LayerQuant(
        "fp8",
        bits=8,
        fp8_strategy=fp8_scheme,  # type: ignore[arg-type]
        block_size=ONLINE_FP8_BLOCK if fp8_scheme == "block" else None,
    )


def _target_quant(quant: LayerQuant, layout: LinearLayout, method: str, fp8_scheme: str) -> LayerQuant:
    # lm_head and MoE routers stay in the checkpoint's precision, as vLLM leaves them
    if method != "fp8" or layout.replicated or quant.scheme != "dense":
        return quant
    return online_fp8_quant(fp8_scheme)


def rank_specs(
    layout: LinearLayout, q: LayerQuant, model: ModelConfig, tp: int, act_dtype: str, has_bias: bool
) -> list[LinearSpec]:
    specs = []
    for rank in range(tp):
        shape = rank_shape(layout, model, rank, tp)
        shard_sizes, k = shape.shard_sizes, shape.k
        specs.append(
            LinearSpec(
                name=layout.name,
                scheme=q.scheme,
                n=sum(shard_sizes),
                k=k,
                k_full=layout.k,
                bits=q.bits,
                group_size=q.group_size,
                symmetric=q.symmetric,
                act_order=q.act_order,
                fp8_strategy=q.fp8_strategy,
                block_size=q.block_size,
                row_parallel=layout.row_parallel and tp > 1,
                has_bias=has_bias,
                act_dtype=act_dtype,
                int8_activations=q.int8_activations,
                shards=tuple(
                    ShardSpec(s.module, size) for s, size in zip(layout.shards, shard_sizes, strict=True)
                )
                if layout.fused
                else (),
            )
        )
    return specs


def _check_fp8_blocks(layout: LinearLayout, spec: LinearSpec, tp: int) -> None:
    """vLLM's validate_fp8_block_shape: per-rank slices must hold whole FP8 blocks."""
    if spec.fp8_strategy != "block" or spec.block_size is None or tp == 1:
        return
    bn, bk = spec.block_size
    if spec.row_parallel and spec.k % bk:
        raise UnsupportedError(
            f"{layout.name}: {spec.k} input features per rank (tp={tp}) are not a multiple of the "
            f"FP8 block {bk}"
        )
    sizes = [s.size for s in spec.shards] or [spec.n]
    if not spec.row_parallel and any(size % bn for size in sizes):
        raise UnsupportedError(
            f"{layout.name}: per-rank output features {sizes} (tp={tp}) are not multiples of the FP8 block "
            f"{bn}; use a smaller tp or a per-tensor / channel FP8 scheme"
        )


def _ideal(spec: LinearSpec) -> LinearSpec:
    ratio = spec.k_full // spec.k if spec.k else 1
    return dataclasses.replace(spec, n=_IDEAL_DIM, k=_IDEAL_DIM, k_full=_IDEAL_DIM * ratio, shards=())


def choose(spec: LinearSpec, target: Target, disabled: tuple[str, ...]) -> tuple[LinearKernel, list, bool]:
    """The kernel, its rejections, and whether a kernel ahead of it would have taken this scheme at a
    kernel-friendly shape (i.e. the layer fell back because of its shape)."""
    choice = choose_kernel(spec, target, disabled)
    order = [k.name for k in candidates(target)]
    try:
        preferred = choose_kernel(_ideal(spec), target, disabled).kernel.name
    except NoKernelError:
        preferred = choice.kernel.name
    return choice.kernel, choice.rejected, order.index(preferred) < order.index(choice.kernel.name)


def build_plan(
    ckpt: Checkpoint,
    fmt: CheckpointFormat,
    target: Target,
    *,
    tp: int = 1,
    method: str = "auto",
    fp8_scheme: str = "tensor",
    disabled_kernels: tuple[str, ...] = (),
    expert_parallel: bool = False,
) -> Plan:
    if method not in METHODS:
        raise UnsupportedError(f"method {method!r} is not supported; use one of {', '.join(METHODS)}")
    if fp8_scheme not in FP8_SCHEMES:
        raise UnsupportedError(
            f"--fp8-scheme {fp8_scheme!r} is not supported; use one of {', '.join(FP8_SCHEMES)}"
        )
    if tp < 1:
        raise UnsupportedError(f"tp must be >= 1, got {tp}")
    if method == "fp8" and fmt.quantization is not None:
        raise UnsupportedError(
            f"--method fp8 quantizes an unquantized (bf16/fp16/fp32) checkpoint online, but {ckpt.uri} is "
            f"already quantized ({fmt.describe()}); use --method auto to keep its quantization"
        )
    model = ModelConfig.from_hf(ckpt.config)
    act_dtype = act_dtype_for(model, target)
    has_lm_head = any(ckpt.has(f"lm_head.{s}") for s in ("weight", "qweight", "weight_packed"))
    layouts = linear_layouts(model, has_lm_head)
    group_layouts = expert_groups(model)
    modules = sum(len(lay.shards) for lay in layouts) + sum(3 * g.num_experts for g in group_layouts)
    check_pattern_work(fmt.name, fmt.pattern_count, modules)
    layers: list[PlannedLayer] = []
    consumed: set[str] = set()
    for layout in layouts:
        quant = _agree(fmt, layout)
        tq = _target_quant(quant, layout, method, fp8_scheme)
        sources = [t for s in layout.shards for t in fmt.source_tensors(s.module, quant)]
        consumed.update(sources)
        has_bias = all(ckpt.has(f"{s.module}.bias") for s in layout.shards)
        specs = rank_specs(layout, tq, model, tp, act_dtype, has_bias)
        _check_fp8_blocks(layout, specs[0], tp)
        kernel, rejected, fallback = choose(specs[0], target, disabled_kernels)
        for spec in specs[1:]:
            ok, reason = kernel.can_implement(spec, target)
            if not ok:
                raise UnsupportedError(
                    f"{layout.name}: kernel {kernel.name} rejects a TP rank's shape: {reason}"
                )
        layers.append(PlannedLayer(layout, quant, tq, specs, kernel, rejected, fallback, sources))
    online = online_fp8_quant(fp8_scheme) if method == "fp8" else None
    groups = [
        plan_experts(
            ckpt, fmt, group, target=target, tp=tp, expert_parallel=expert_parallel, target_quant=online,
            act_dtype=act_dtype, disabled=disabled_kernels,
        )
        for group in group_layouts
    ]  # fmt: skip
    if expert_parallel and not groups:
        raise UnsupportedError(f"--ep places whole experts per rank, but {model.architecture} has no experts")
    for pe in groups:
        consumed.update(pe.source_tensors)
    others = []
    dropped = []
    for name, info in sorted(ckpt.tensors.items()):
        if name in consumed or name.endswith(IGNORED_TENSOR_SUFFIXES):
            continue
        suffix = name.rsplit(".", 1)[-1]
        if suffix in DROPPED_SCALE_SUFFIXES:
            dropped.append(name)
            continue
        if ".experts." in name:
            raise ConversionError(
                f"tensor {name} belongs to an expert the model config does not have (config.json says "
                f"{model.moe.num_experts if model.moe else 0} experts per layer); fix num_experts or the "
                "checkpoint"
            )
        if suffix in QUANTIZED_SUFFIXES or info.dtype == "F8_E4M3":
            raise ConversionError(
                f"tensor {name} belongs to a quantized layer Kiln does not know (only Llama-family "
                "q/k/v/o/gate/up/down projections and lm_head are converted)"
            )
        others.append(name)
    notes = list(fmt.notes)
    if dropped:
        notes.append(
            f"{len(dropped)} static activation / KV-cache scale tensors (e.g. {dropped[0]}) are not used: "
            "the kernels quantize activations dynamically"
        )
    if tp > 1:
        notes.append("embeddings, norms and lm_head are replicated on every rank (vocabulary not sharded)")
    if model.tie_word_embeddings and not has_lm_head:
        notes.append("tied embeddings: lm_head reuses model.embed_tokens.weight")
    return Plan(
        source=ckpt.uri,
        format=fmt.name,
        quantization=fmt.quantization,
        target=target,
        tp=tp,
        method=method,
        fp8_scheme=fp8_scheme,
        act_dtype=act_dtype,
        model=model,
        layers=layers,
        other_tensors=others,
        notes=notes,
        expert_groups=groups,
        expert_parallel=expert_parallel,
        other_bytes=other_tensor_bytes(ckpt, others, act_dtype),
    )


__all__ = ["DENSE", "Plan", "PlanRow", "PlannedLayer", "build_plan"]
