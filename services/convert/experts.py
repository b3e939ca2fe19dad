"""Mixture-of-experts layers in the conversion: one plan row and one expert-group kernel per layer.

Planning: every expert's gate, up and down projections must be quantized alike (the format decides
per module, so an ignore list or a `dynamic` rule covering some experts and not others is refused,
naming the expert); every expert's tensors must be present. The group's `MoESpec` per rank follows
`runtime.model_layout.expert_placement` (TP: a slice of every expert; EP: whole experts).

Conversion streams expert by expert: read one expert's three projections, decode them, slice them for
each rank that holds the expert, fuse gate|up into w13, quantize online to FP8 when asked, prepare
them with the group's kernel, verify them against the source, and write them into the rank files'
stacked tensors (reserved up front), before the next expert is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.base import (
    DenseWeight,
    IntWeight,
    LinearSpec,
    ShardSpec,
    SourceWeight,
    StoredTensor,
    Target,
    check_stored,
)
from kernels.codecs.fp8 import quantize_fp8
from kernels.errors import LayoutError, NoKernelError, UnsupportedError
from kernels.moe_base import W2, W13, MoEKernel, MoESpec
from kernels.registry import MOE_PRIORITY, choose_moe_kernel
from runtime.artifact.manifest import ExpertGroupEntry, LayerVerification, Rejection
from runtime.model_layout import ExpertGroupLayout, RowRange, expert_placement
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, VerificationError
from services.convert.formats.base import CheckpointFormat, LayerQuant
from services.convert.safetensors_io import StreamingSafetensorsWriter
from services.convert.tp import fuse, slice_cols, slice_rows
from services.convert.verify import compare, compare_int_stored, worst_of

PART_NAMES = ("gate", "up", "down")
_IDEAL_EXPERT = (4096, 1024)  # (hidden, intermediate) every expert kernel takes, to spot shape fallbacks


@dataclass
class PlannedExperts:
    layout: ExpertGroupLayout
    quant: LayerQuant  # as stored, agreed by every expert's three projections
    target_quant: LayerQuant  # what the artifact holds (online FP8 changes dense -> fp8)
    specs: list[MoESpec]  # one per rank
    kernel: MoEKernel
    rejected: list[tuple[str, str]]
    fallback: bool
    source_tensors: list[str]
    expert_parallel: bool

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def online_fp8(self) -> bool:
        return self.quant.scheme == "dense" and self.target_quant.scheme == "fp8"

    def describe(self) -> str:
        g, spec = self.layout, self.specs[0]
        return (
            f"{g.num_experts} experts × (w13 {spec.w13.n}×{spec.w13.k}, w2 {spec.w2.n}×{spec.w2.k})"
            f"{' per rank' if len(self.specs) > 1 else ''}"
        )


def _as_named_in(ckpt: Checkpoint, group: ExpertGroupLayout) -> ExpertGroupLayout:
    """The group with its projections named as this checkpoint names them (the architecture's
    alternatives: Mixtral's w1 / w3 / w2 become gate_proj / up_proj / down_proj in llm-compressor's
    output)."""
    for parts in (group.parts, *group.alternatives):
        named = group.named(parts)
        if any(name.startswith(named.module(0, 0) + ".") for name in ckpt.tensors):
            return named
    return group


def _expert_quant(fmt: CheckpointFormat, group: ExpertGroupLayout) -> LayerQuant:
    """The one quantization every expert's gate / up / down shares, or a clear refusal."""
    first: tuple[str, LayerQuant] | None = None
    for e in range(group.num_experts):
        w13, w2 = group.w13(e), group.w2(e)
        for part, layout in ((0, w13), (1, w13), (2, w2)):
            module = group.module(e, part)
            q = fmt.layer_quant(module, layout)
            if first is None:
                first = (module, q)
            elif q != first[1]:
                raise UnsupportedError(
                    f"expert group {group.name}: expert {e}'s {PART_NAMES[part]} projection ({module}) is "
                    f"{q.describe()} but {first[0]} is {first[1].describe()}; every expert of a layer must "
                    "be quantized alike (check the quantization config's ignore / targets / dynamic rules)"
                )
    assert first is not None
    return first[1]


def _expert_sources(
    fmt: CheckpointFormat, ckpt: Checkpoint, group: ExpertGroupLayout, quant: LayerQuant
) -> list[str]:
    names: list[str] = []
    present = {name.rsplit(".", 1)[0] for name in ckpt.tensors}  # every module with a tensor
    for e in range(group.num_experts):
        for part in range(3):
            module = group.module(e, part)
            if module not in present:
                raise ConversionError(
                    f"expert group {group.name}: expert {e} is missing ({module} has no tensors in the "
                    f"checkpoint; config.json says {group.num_experts} experts per layer)"
                )
            names += fmt.source_tensors(module, quant)
    return names


def _moe_spec(
    group: ExpertGroupLayout, q: LayerQuant, rank: int, tp: int, expert_parallel: bool, act_dtype: str
) -> MoESpec:
    place = expert_placement(group, rank, tp, expert_parallel)
    i = place.intermediate

    def linear(
        name: str, n: int, k: int, k_full: int, row_parallel: bool, shards: tuple[ShardSpec, ...]
    ) -> LinearSpec:
        return LinearSpec(
            name=name, scheme=q.scheme, n=n, k=k, k_full=k_full, bits=q.bits, group_size=q.group_size,
            symmetric=q.symmetric, act_order=q.act_order, fp8_strategy=q.fp8_strategy,
            block_size=q.block_size, row_parallel=row_parallel, act_dtype=act_dtype,
            int8_activations=q.int8_activations, shards=shards,
        )  # fmt: skip

    w13 = linear(
        f"{group.name}.{W13}", 2 * i, group.hidden, group.hidden, False,
        (ShardSpec(f"{group.name}.gate", i), ShardSpec(f"{group.name}.up", i)),
    )  # fmt: skip
    w2 = linear(f"{group.name}.{W2}", group.hidden, i, group.intermediate, tp > 1 and not expert_parallel, ())
    return MoESpec(
        name=group.name,
        num_experts=place.num_experts,
        top_k=group.top_k,
        w13=w13,
        w2=w2,
        first_expert=place.first_expert,
        total_experts=group.num_experts,
    )


def _ideal(spec: MoESpec) -> MoESpec:
    h, i = _IDEAL_EXPERT
    w13 = dataclasses.replace(spec.w13, n=2 * i, k=h, k_full=h, shards=())
    w2 = dataclasses.replace(spec.w2, n=h, k=i, k_full=i)
    return dataclasses.replace(spec, w13=w13, w2=w2)


def plan_experts(
    ckpt: Checkpoint,
    fmt: CheckpointFormat,
    group: ExpertGroupLayout,
    *,
    target: Target,
    tp: int,
    expert_parallel: bool,
    target_quant: LayerQuant | None,
    act_dtype: str,
    disabled: tuple[str, ...],
) -> PlannedExperts:
    """`target_quant`: the online FP8 scheme when converting a dense checkpoint with --method fp8."""
    group = _as_named_in(ckpt, group)
    quant = _expert_quant(fmt, group)
    tq = target_quant if target_quant is not None and quant.scheme == "dense" else quant
    sources = _expert_sources(fmt, ckpt, group, quant)
    specs = [_moe_spec(group, tq, r, tp, expert_parallel, act_dtype) for r in range(tp)]
    choice = choose_moe_kernel(specs[0], target, disabled)
    for spec in specs[1:]:
        ok, reason = choice.kernel.can_implement(spec, target)
        if not ok:
            raise UnsupportedError(
                f"{group.name}: kernel {choice.kernel.name} rejects a rank's shape: {reason}"
            )
    try:
        preferred = choose_moe_kernel(_ideal(specs[0]), target, disabled).kernel.name
    except NoKernelError:
        preferred = choice.kernel.name
    order = MOE_PRIORITY[target]
    fallback = order.index(preferred) < order.index(choice.kernel.name)
    return PlannedExperts(
        group, quant, tq, specs, choice.kernel, choice.rejected, fallback, sources, expert_parallel
    )


def _decode_expert(
    ckpt: Checkpoint, fmt: CheckpointFormat, pe: PlannedExperts, expert: int
) -> tuple[SourceWeight, SourceWeight, SourceWeight]:
    group = pe.layout
    modules = [group.module(expert, part) for part in range(3)]
    names = [n for m in modules for n in fmt.source_tensors(m, pe.quant)]
    tensors = ckpt.read(names)
    weights = [fmt.decode(m, pe.quant, tensors) for m in modules]
    expected = [(group.intermediate, group.hidden)] * 2 + [(group.hidden, group.intermediate)]
    for part, (w, want) in enumerate(zip(weights, expected, strict=True)):
        check_source_shape(
            modules[part],
            w,
            want,
            f"expert group {group.name}: expert {expert}'s {PART_NAMES[part]} projection",
        )
    return weights[0], weights[1], weights[2]


def check_source_shape(module: str, w: SourceWeight, want: tuple[int, int], what: str = "") -> None:
    """A decoded checkpoint weight against the (N, K) the model config gives it."""
    t = w.codes if isinstance(w, IntWeight) else w.weight
    shape = (int(t.shape[0]), int(t.shape[1]))
    if shape != want:
        raise ConversionError(
            f"{what + ' (' + module + ')' if what else module} is {shape[0]}×{shape[1]}; the model config "
            f"gives it {want[0]}×{want[1]} (config.json dimensions and the tensors disagree)"
        )


def _rank_expert(
    pe: PlannedExperts,
    spec: MoESpec,
    rank: int,
    tp: int,
    gate: SourceWeight,
    up: SourceWeight,
    down: SourceWeight,
) -> tuple[SourceWeight, SourceWeight]:
    """This rank's (w13, w2) of one expert: whole under EP, the intermediate slice under TP."""
    group = pe.layout
    if pe.expert_parallel or tp == 1:
        return fuse([gate, up], ["gate", "up"]), down
    i = spec.intermediate
    rows = RowRange(rank * i, i)
    w13 = fuse(
        [slice_rows(gate, rows, f"{group.name} gate"), slice_rows(up, rows, f"{group.name} up")],
        ["gate", "up"],
    )
    return w13, slice_cols(down, rank, tp, f"{group.name} down")


def _online_fp8(pe: PlannedExperts, w: SourceWeight) -> SourceWeight:
    assert isinstance(w, DenseWeight)
    tq = pe.target_quant
    q = quantize_fp8(w.weight, tq.fp8_strategy or "tensor", block_size=tq.block_size or (128, 128))
    q.bias = w.bias
    return q


def reserve_group(pe: PlannedExperts, target: Target, writers: list[StreamingSafetensorsWriter]) -> list[str]:
    """Make room for the group's stacked tensors in every rank file; returns their names (sorted)."""
    names: list[str] = []
    for rank, spec in enumerate(pe.specs):
        stored = pe.kernel.stored_tensors(spec, target)
        for suffix, t in sorted(stored.items()):
            writers[rank].reserve(f"{pe.name}.{suffix}", t.dtype, t.shape)
        names = sorted(stored)
    return names


def convert_experts(
    ckpt: Checkpoint,
    fmt: CheckpointFormat,
    pe: PlannedExperts,
    target: Target,
    writers: list[StreamingSafetensorsWriter],
) -> ExpertGroupEntry:
    tp = len(pe.specs)
    tensors = reserve_group(pe, target, writers)
    worst: LayerVerification | None = None
    for expert in range(pe.layout.num_experts):
        gate, up, down = _decode_expert(ckpt, fmt, pe, expert)
        for rank, spec in enumerate(pe.specs):
            local = expert - spec.first_expert
            if not 0 <= local < spec.num_experts:
                continue
            ref13, ref2 = _rank_expert(pe, spec, rank, tp, gate, up, down)
            w13, w2 = (_online_fp8(pe, ref13), _online_fp8(pe, ref2)) if pe.online_fp8 else (ref13, ref2)
            prepared = pe.kernel.prepare_expert(w13, w2, spec, target)
            _check_expert_tensors(pe, spec, target, prepared)
            for part, check in zip((W13, W2), _verify_expert(pe, spec, prepared, (ref13, ref2)), strict=True):
                if not check.ok:
                    raise VerificationError(
                        f"expert group {pe.name} (rank {rank}, expert {expert}, {part}, kernel "
                        f"{pe.kernel.name}): the artifact's weights do not reproduce the source: "
                        f"{check.metric} {check.value:.4g} > bound {check.bound:.4g}; this is a kernel "
                        "layout bug — disable the kernel with KILN_DISABLED_KERNELS and report it"
                    )
                worst = worst_of(worst, check)
            for suffix, value in prepared.items():
                writers[rank].write_slice(f"{pe.name}.{suffix}", local, value)
            del prepared, w13, w2, ref13, ref2
        del gate, up, down
    return ExpertGroupEntry(
        kernel=pe.kernel.name,
        layout_version=pe.kernel.layout_version,
        spec=pe.specs[0].to_json(),
        tensors=tensors,
        source_tensors=pe.source_tensors,
        rejected=[Rejection(kernel=k, reason=r) for k, r in pe.rejected],
        fallback=pe.fallback,
        verification=worst,
    )


def _verify_expert(
    pe: PlannedExperts,
    spec: MoESpec,
    prepared: dict[str, torch.Tensor],
    refs: tuple[SourceWeight, SourceWeight],
) -> list[LayerVerification]:
    """(w13, w2) checks of one prepared expert against its source weights: value for value on the
    stored integer weights where the layout keeps them, else on the dequantized weights."""
    one = {k: v[None] for k, v in prepared.items()}  # a group of this expert alone
    act = spec.w13.torch_act_dtype
    stored = pe.kernel.stored_int_weights(one, spec, 0) if isinstance(refs[0], IntWeight) else (None, None)
    checks = [compare_int_stored(s, ref, act) for s, ref in zip(stored, refs, strict=True)]
    if all(c is not None for c in checks):
        return [c for c in checks if c is not None]
    got = pe.kernel.dequantize_expert(one, spec, 0)
    return [
        c or compare(g, ref, act, online_fp8=pe.online_fp8)
        for c, g, ref in zip(checks, got, refs, strict=True)
    ]


def _check_expert_tensors(
    pe: PlannedExperts, spec: MoESpec, target: Target, prepared: dict[str, torch.Tensor]
) -> None:
    declared = {
        name: StoredTensor(t.shape[1:], t.dtype) for name, t in pe.kernel.stored_tensors(spec, target).items()
    }
    try:
        check_stored(pe.kernel.name, spec.w13, declared, prepared)
    except LayoutError as e:
        raise VerificationError(
            f"{e}: kernel {pe.kernel.name}'s prepare_expert does not write the tensors it declares "
            "(a kernel bug — disable the kernel with KILN_DISABLED_KERNELS and report it)"
        ) from e
