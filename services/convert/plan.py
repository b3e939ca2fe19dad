"""The conversion plan: a list of units (services/convert/units: linear layers, MoE expert groups),
each with its scheme, per-rank spec, the kernel chosen for the target and every kernel rejected on
the way (vLLM's choose_mp_linear_kernel idea), plus the tensors copied as they are.

A unit "falls back" when the kernel that would take its scheme at a kernel-friendly shape refused
its actual (per-rank) shape, e.g. Marlin's N % 64 / K % 128 rules; the registry says so and the plan
shows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kernels.base import Target
from kernels.cpu_w4a8 import CpuW4A8Kernel
from kernels.cpu_w8a8 import CpuW8A8Kernel
from kernels.errors import UnsupportedError
from kernels.registry import is_kiln_layout
from runtime.model_layout import EMBEDDING_MODULE, ModelConfig
from services.convert import cpu_defaults
from services.convert.checkpoint import Checkpoint
from services.convert.choices import (
    FP8_SCHEMES,
    GPU_LAYOUTS,
    HEAD_QUANTS,
    KILN_GPU_LAYOUT,
    METHODS,
    NO_HEAD_QUANT,
)
from services.convert.errors import ConversionError
from services.convert.formats.base import DENSE, CheckpointFormat
from services.convert.limits import check_pattern_work
from services.convert.safetensors_io import DTYPES
from services.convert.units import UNIT_KINDS, PlanUnit
from services.convert.units.base import HEADER_ENTRY_BYTES, PlanContext, PlanRow

_FLOAT_ACT = {"bfloat16": "bfloat16", "float16": "float16", "bf16": "bfloat16", "fp16": "float16"}
# Tensor suffixes that only quantized layers have: left over after planning they mean a layer Kiln
# does not know, which it must not silently pass through.
QUANTIZED_SUFFIXES = (
    "qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
    "weight_g_idx", "weight_shape", "weight_scale_inv", "input_scale", "weight_global_scale",
    "weight_scale_2", "input_global_scale",
)  # fmt: skip
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
# Static activation / KV-cache scales: the kernels quantize activations dynamically (or, for FP4
# W4A4 sources, run them 16-bit) and the runtime has its own KV-cache handling, so these are dropped
# (and the plan says so).
DROPPED_SCALE_SUFFIXES = ("input_scale", "input_global_scale", "output_scale", "k_scale", "v_scale")


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
    units: list[PlanUnit]
    other_tensors: list[str]
    notes: list[str] = field(default_factory=list)
    expert_parallel: bool = False
    other_bytes: int = 0  # the other tensors as one rank file stores them
    quantize_head: str | None = None  # what lm_head was quantized to (--quantize-head or the default)
    int8_activation_bits: tuple[int, ...] = ()  # weight bits on int8 activations (cpu_defaults.py)
    kiln_layouts: bool = False  # --gpu-layout kiln on a GPU target

    def rank_bytes(self) -> list[int]:
        """Tensor bytes of each rank file, from the kernels' declared layouts (optional tensors, such as
        an act-order permutation that turns out trivial, counted: an upper bound by at most those)."""
        return [
            self.other_bytes + sum(u.stored_bytes(rank, self.target) for u in self.units)
            for rank in range(self.tp)
        ]

    def header_reserve(self) -> int:
        """Bytes to reserve for a rank file's safetensors header (about twice what it will need)."""
        other = sum(len(n) + HEADER_ENTRY_BYTES for n in self.other_tensors)
        return 4096 + sum(u.header_bytes() for u in self.units) + other

    @property
    def rows(self) -> list[PlanRow]:
        return [u.row() for u in self.units]

    @property
    def options(self) -> dict[str, Any]:
        """What besides source, target, tp, method and layouts determines the artifact's bytes."""
        options: dict[str, Any] = {"fp8_scheme": self.fp8_scheme} if self.method == "fp8" else {}
        if self.expert_parallel:
            options["expert_parallel"] = True
        if self.quantize_head:
            options["quantize_head"] = self.quantize_head
        if (acts := cpu_defaults.options_entry(self.int8_activation_bits)) is not None:
            options["int8_activations"] = acts
        if self.kiln_layouts:
            options["gpu_layout"] = KILN_GPU_LAYOUT
        return options

    def layout_versions(self) -> dict[str, int]:
        return {u.kernel.name: u.kernel.layout_version for u in self.units}

    @property
    def num_fallbacks(self) -> int:
        return sum(u.fallback for u in self.units)

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


def other_tensor_bytes(ckpt: Checkpoint, names: list[str], act_dtype: str) -> int:
    """What the pipeline writes for the other tensors (sm75's fp16 narrows bf16 / fp32 ones)."""
    total = 0
    for name in names:
        info = ckpt.tensors[name]
        narrowed = act_dtype == "float16" and info.dtype in ("BF16", "F32")
        total += math.prod(info.shape) * (2 if narrowed else DTYPES[info.dtype].itemsize)
    return total


def act_dtype_for(model: ModelConfig, target: Target) -> str:
    if not target.has_bf16:
        return "float16"
    dtype = _FLOAT_ACT.get(model.torch_dtype.removeprefix("torch."))
    if dtype:
        return dtype
    return "float32" if target is Target.CPU else "bfloat16"


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
    quantize_head: str | None = None,
    int8_activations: bool | None = None,
    gpu_layout: str | None = None,
) -> Plan:
    """`quantize_head` / `int8_activations` None: the target's default (services/convert/cpu_defaults.py)."""
    _check_options(ckpt, fmt, tp, method, fp8_scheme)
    model = ModelConfig.from_hf(ckpt.config)
    act_dtype = act_dtype_for(model, target)
    has_lm_head = any(ckpt.has(f"lm_head.{s}") for s in ("weight", "qweight", "weight_packed"))
    _check_head_quant(quantize_head, target, model, has_lm_head)
    four_bit = target is Target.CPU and cpu_defaults.has_4bit_layers(fmt, model)
    head_16 = four_bit and cpu_defaults.head_is_16_bit(ckpt, fmt, model, has_lm_head)
    head = cpu_defaults.head_quant(quantize_head, target, head_16)
    acts = cpu_defaults.int8_activation_bits(int8_activations, target, four_bit)
    if gpu_layout is not None and gpu_layout not in GPU_LAYOUTS:
        raise ConversionError(f"--gpu-layout {gpu_layout!r} is not supported; use {', '.join(GPU_LAYOUTS)}")
    kiln_layouts = target.is_gpu and gpu_layout == KILN_GPU_LAYOUT
    ctx = PlanContext(
        ckpt, fmt, target, model, tp, method, fp8_scheme, act_dtype, disabled_kernels, expert_parallel,
        has_lm_head, head, acts, kiln_layouts,
    )  # fmt: skip
    check_pattern_work(fmt.name, fmt.pattern_count, sum(kind.module_count(ctx) for kind in UNIT_KINDS))
    units = [unit for kind in UNIT_KINDS for unit in kind.plan(ctx)]
    # A quantized tied head reads the embedding, which is still stored as it is for the lookup.
    consumed = {name for unit in units for name in unit.source_tensors} - {EMBEDDING_TENSOR}
    others, dropped, skipped = _other_tensors(ckpt, model, consumed)
    notes = list(fmt.notes)
    if skipped:
        notes.append(
            f"{len(skipped)} tensors of the {model.extra_layers} multi-token prediction layer(s) after the "
            f"last decoder layer (e.g. {skipped[0]}) are skipped, as vLLM skips them: they only serve "
            "speculative decoding"
        )
    notes += [note for kind in UNIT_KINDS for note in kind.notes(ctx)]
    if dropped:
        notes.append(
            f"{len(dropped)} static activation / KV-cache scale tensors (e.g. {dropped[0]}) are not used: "
            "the kernels quantize activations dynamically"
        )
    if tp > 1:
        notes.append("embeddings, norms and lm_head are replicated on every rank (vocabulary not sharded)")
    if model.tie_word_embeddings and not has_lm_head and not head:
        notes.append(f"tied embeddings: lm_head reuses {EMBEDDING_TENSOR}")
    if head:
        tied = f" from the tied {EMBEDDING_TENSOR} (kept 16-bit for the lookup)" if not has_lm_head else ""
        why = f"--quantize-head {head}" if quantize_head else f"cpu default for a 4-bit checkpoint: {head}"
        notes.append(f"{why}: lm_head quantized online{tied} (--quantize-head none keeps it)")
    if acts:
        notes.append(_int8_activations_note(units, requested=int8_activations is not None))
    if kiln_layouts:
        notes.append(_kiln_layouts_note(units))
    return Plan(
        source=ckpt.uri, format=fmt.name, quantization=fmt.quantization, target=target, tp=tp,
        method=method, fp8_scheme=fp8_scheme, act_dtype=act_dtype, model=model, units=units,
        other_tensors=others, notes=notes, expert_parallel=expert_parallel,
        other_bytes=other_tensor_bytes(ckpt, others, act_dtype), quantize_head=head,
        int8_activation_bits=acts, kiln_layouts=kiln_layouts,
    )  # fmt: skip


EMBEDDING_TENSOR = f"{EMBEDDING_MODULE}.weight"


def _kiln_layouts_note(units: list[PlanUnit]) -> str:
    kiln = [u for u in units if is_kiln_layout(u.kernel)]
    names = sorted({u.kernel.name for u in kiln})
    taken = f"{len(kiln)} unit(s) in {', '.join(names)}" if kiln else "no unit takes one"
    return (
        f"--gpu-layout kiln: Kiln's own GPU layouts where one takes the layer ({taken}); kiln serve's "
        "decode kernels read them, vLLM's plugin runs them with Kiln's Triton kernels (--gpu-layout "
        "marlin keeps vLLM's Marlin bytes)"
    )


def _int8_activations_note(units: list[PlanUnit], *, requested: bool) -> str:
    why = "--int8-activations" if requested else "cpu default for a 4-bit checkpoint"
    w4a8 = sum(1 for u in units if u.kernel.name == CpuW4A8Kernel.name)
    w8a8 = sum(1 for u in units if u.kernel.name == CpuW8A8Kernel.name)
    if not w4a8 + w8a8:
        return (
            f"{why}: no layer is a 4-bit integer one without act-order or a symmetric "
            "channelwise 8-bit one; nothing changes"
        )
    parts = [f"{w4a8} 4-bit layer(s) per token and weight group (cpu_w4a8)"] if w4a8 else []
    parts += [f"{w8a8} 8-bit layer(s) per token (cpu_w8a8)"] if w8a8 else []
    keep = "" if requested else " (--no-int8-activations keeps 16-bit activations)"
    return (
        f"{why}: int8 activations times integer weights with integer dot products in "
        f"{' and '.join(parts)}: faster decode, slightly different numerics{keep}"
    )


def _check_head_quant(
    quantize_head: str | None, target: Target, model: ModelConfig, has_lm_head: bool
) -> None:
    if quantize_head is None or quantize_head == NO_HEAD_QUANT:
        return
    if quantize_head not in HEAD_QUANTS:
        raise UnsupportedError(
            f"--quantize-head {quantize_head!r} is not supported; use {', '.join(HEAD_QUANTS)}"
        )
    if target is not Target.CPU:
        raise UnsupportedError(
            f"--quantize-head is for the cpu target (its cpu_int8 kernel); {target.value} keeps lm_head "
            "in the checkpoint's precision, as vLLM does: convert without --quantize-head for GPU targets"
        )
    if not has_lm_head and not model.tie_word_embeddings:
        raise UnsupportedError("--quantize-head: the checkpoint has no lm_head and does not tie embeddings")


def _check_options(ckpt: Checkpoint, fmt: CheckpointFormat, tp: int, method: str, fp8_scheme: str) -> None:
    if method not in METHODS:
        raise UnsupportedError(f"method {method!r} is not supported; use one of {', '.join(METHODS)}")
    if fp8_scheme not in FP8_SCHEMES:
        raise UnsupportedError(
            f"--fp8-scheme {fp8_scheme!r} is not supported; use one of {', '.join(FP8_SCHEMES)}"
        )
    if tp < 1:
        raise UnsupportedError(f"tp must be >= 1, got {tp}")
    fmt.check_method(method)


def _other_tensors(
    ckpt: Checkpoint, model: ModelConfig, consumed: set[str]
) -> tuple[list[str], list[str], list[str]]:
    """The tensors no unit reads: (copied as they are, dropped static scales, skipped extra layers);
    a leftover that only a quantized layer or an expert would have is refused."""
    others: list[str] = []
    dropped: list[str] = []
    extra = tuple(f"model.layers.{model.num_layers + i}." for i in range(model.extra_layers))
    skipped = [name for name in sorted(ckpt.tensors) if name.startswith(extra)] if extra else []
    for name, info in sorted(ckpt.tensors.items()):
        if name in consumed or name.endswith(IGNORED_TENSOR_SUFFIXES) or (extra and name.startswith(extra)):
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
    return others, dropped, skipped


__all__ = ["DENSE", "Plan", "PlanRow", "build_plan"]
