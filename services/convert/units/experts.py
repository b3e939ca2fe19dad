"""MoE layers' expert groups as plan units: one plan row and one expert-group kernel per layer.

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

from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.base import IntWeight, LinearSpec, ShardSpec, SourceWeight, StoredTensor, Target, check_stored
from kernels.codecs.fp8 import QuantError
from kernels.errors import LayoutError, UnsupportedError
from kernels.moe_base import SWIGLU_OAI, W2, W13, MoEKernel, MoESpec
from kernels.registry import choose_moe_kernel
from runtime.artifact.manifest import ExpertGroupEntry, LayerVerification, Rejection
from runtime.model_layout import ExpertGroupLayout, ModelConfig, RowRange, expert_groups, expert_placement
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError
from services.convert.formats.base import CheckpointFormat, LayerQuant
from services.convert.formats.joint import joint_quant, re_encode
from services.convert.tp import fuse, interleave_halves, pad_weight, slice_cols, slice_rows
from services.convert.units.base import (
    HEADER_ENTRY_BYTES,
    MAX_TENSORS_PER_LAYER,
    PlanContext,
    PlanRow,
    RankFiles,
    check_source_shape,
    quantize_online_measured,
    require_reproduced,
    stored_bytes,
    undeclared_tensors,
)
from services.convert.verify import compare, compare_fp8_measured, compare_int_stored, worst_of

PART_NAMES = ("gate", "up", "down")
Expert = tuple[SourceWeight, SourceWeight, SourceWeight]  # gate, up, down as the checkpoint holds them


@dataclass
class ExpertGroupUnit:
    section: ClassVar[str] = "expert_groups"

    layout: ExpertGroupLayout
    quant: LayerQuant  # as stored, agreed by every expert's three projections (or their joint one)
    target_quant: LayerQuant  # what the artifact holds (online FP8 changes dense -> fp8)
    specs: list[MoESpec]  # one per rank
    kernel: MoEKernel
    rejected: list[tuple[str, str]]
    fallback: bool
    source_tensors: list[str]
    expert_parallel: bool
    source_label: str = ""  # the source encoding when the scheme does not say it (a GGUF block type)
    # gate / up / down's own quantization when they differ (`quant` is their joint one); else empty
    part_quants: tuple[LayerQuant, ...] = ()

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

    def row(self) -> PlanRow:
        return PlanRow(
            layer=self.name,
            shards=[f"{self.layout.expert_prefix.format(e='*')}.{p}" for p in self.layout.parts],
            scheme=f"{self.describe()}, "
            + (f"{self.source_label} → " if self.source_label else "")
            + self.target_quant.describe()
            + (" (online)" if self.online_fp8 else ""),
            kernel=self.kernel.name,
            fallback=self.fallback,
            rejections=list(self.rejected),
            n=self.specs[0].w13.n,
            k=self.specs[0].w13.k,
        )

    def stored_bytes(self, rank: int, target: Target) -> int:
        return stored_bytes(self.kernel.stored_tensors(self.specs[rank], target))

    def header_bytes(self) -> int:
        return 2 * MAX_TENSORS_PER_LAYER * (len(self.name) + 28 + HEADER_ENTRY_BYTES)

    def convert(self, files: RankFiles) -> ExpertGroupEntry:
        if self.kernel.needs_group_statistics(self.specs[0]):
            self._share_group_statistics(files)
        tensors = self._reserve(files)
        worst: LayerVerification | None = None
        for expert in range(self.layout.num_experts):
            source = self._decode_expert(files, expert)
            for rank, spec in enumerate(self.specs):
                local = expert - spec.first_expert
                if 0 <= local < spec.num_experts:
                    worst = self._convert_expert(files, rank, expert, source, worst)
            del source
        return ExpertGroupEntry(
            kernel=self.kernel.name,
            layout_version=self.kernel.layout_version,
            spec=self.specs[0].to_json(),
            tensors=tensors,
            source_tensors=self.source_tensors,
            rejected=[Rejection(kernel=k, reason=r) for k, r in self.rejected],
            fallback=self.fallback,
            verification=worst,
        )

    def _share_group_statistics(self, files: RankFiles) -> None:
        """Values the kernel's layout takes from every local expert of a rank before it prepares any
        (vLLM's one NVFP4 scale factor per Marlin FP4 expert group): one more decode pass over the
        group, for such kernels only; the specs (and so the manifest) record the result."""
        found: list[tuple[float, float] | None] = [None] * len(self.specs)
        for expert in range(self.layout.num_experts):
            source = self._decode_expert(files, expert)
            for rank, spec in enumerate(self.specs):
                if not 0 <= expert - spec.first_expert < spec.num_experts:
                    continue
                w13, w2 = self._rank_expert(spec, rank, *source)
                a, b = self.kernel.group_statistics(w13, w2, spec)
                seen = found[rank]
                found[rank] = (a, b) if seen is None else (max(seen[0], a), max(seen[1], b))
            del source
        self.specs = [
            spec if values is None else self.kernel.with_group_statistics(spec, values)
            for spec, values in zip(self.specs, found, strict=True)
        ]

    def _reserve(self, files: RankFiles) -> list[str]:
        """Make room for the group's stacked tensors in every rank file; their names (sorted)."""
        names: list[str] = []
        for rank, spec in enumerate(self.specs):
            stored = self.kernel.stored_tensors(spec, files.target)
            for suffix, t in sorted(stored.items()):
                files.writers[rank].reserve(f"{self.name}.{suffix}", t.dtype, t.shape)
            names = sorted(stored)
        return names

    def _convert_expert(
        self, files: RankFiles, rank: int, expert: int, source: Expert, worst: LayerVerification | None
    ) -> LayerVerification | None:
        """Prepare, verify and write one expert's slice for one rank; the group's worst check so far."""
        spec = self.specs[rank]
        ref13, ref2 = self._rank_expert(spec, rank, *source)
        errors: tuple[QuantError | None, QuantError | None] = (None, None)
        w13, w2 = ref13, ref2
        if self.online_fp8:
            (w13, e13), (w2, e2) = (quantize_online_measured(ref, self.target_quant) for ref in (ref13, ref2))
            errors = e13, e2
        prepared = self.kernel.prepare_expert(w13, w2, spec, files.target)
        self._check_expert_tensors(spec, files.target, prepared)
        checks = self._verify_expert(spec, prepared, (ref13, ref2), (w13, w2), errors)
        for part, check in zip((W13, W2), checks, strict=True):
            where = (
                f"expert group {self.name} (rank {rank}, expert {expert}, {part}, kernel {self.kernel.name})"
            )
            require_reproduced(check, where)
            worst = worst_of(worst, check)
        for suffix, value in prepared.items():
            files.writers[rank].write_slice(f"{self.name}.{suffix}", expert - spec.first_expert, value)
        return worst

    def _decode_expert(self, files: RankFiles, expert: int) -> Expert:
        group = self.layout
        modules = [group.module(expert, part) for part in range(3)]
        own = self.part_quants or (self.quant,) * 3
        names = [n for m, q in zip(modules, own, strict=True) for n in files.fmt.source_tensors(m, q)]
        tensors = files.ckpt.read(names)
        weights = [files.fmt.decode(m, q, tensors) for m, q in zip(modules, own, strict=True)]
        if self.part_quants:
            weights = [re_encode(w, self.quant, m) for m, w in zip(modules, weights, strict=True)]
        expected = [(group.intermediate, group.hidden)] * 2 + [(group.hidden, group.intermediate)]
        for part, (w, want) in enumerate(zip(weights, expected, strict=True)):
            what = f"expert group {group.name}: expert {expert}'s {PART_NAMES[part]} projection"
            check_source_shape(modules[part], w, want, what)
        return weights[0], weights[1], weights[2]

    def _rank_expert(
        self, spec: MoESpec, rank: int, gate: SourceWeight, up: SourceWeight, down: SourceWeight
    ) -> tuple[SourceWeight, SourceWeight]:
        """This rank's (w13, w2) of one expert: whole under EP, the intermediate slice under TP; w13's
        gate and up rows interleaved for the activation that reads them so."""
        tp = len(self.specs)
        name = self.name
        if not (self.expert_parallel or tp == 1):
            i = spec.model_intermediate  # this rank's share of the checkpoint's rows (before any padding)
            rows = RowRange(rank * i, i)
            gate, up = slice_rows(gate, rows, f"{name} gate"), slice_rows(up, rows, f"{name} up")
            down = slice_cols(down, rank, tp, f"{name} down")
        w13 = fuse([gate, up], ["gate", "up"])
        if spec.activation == SWIGLU_OAI:
            w13 = interleave_halves(w13, f"{name} w13")
        if spec.hidden_pad or spec.intermediate_pad:  # the layout's zero rows / columns (vLLM's too)
            w13 = pad_weight(w13, spec.w13.n, spec.w13.k, f"{name} w13")
            down = pad_weight(down, spec.w2.n, spec.w2.k, f"{name} w2")
        return w13, down

    def _verify_expert(
        self,
        spec: MoESpec,
        prepared: dict[str, torch.Tensor],
        refs: tuple[SourceWeight, SourceWeight],
        quantized: tuple[SourceWeight, SourceWeight],
        errors: tuple[QuantError | None, QuantError | None],
    ) -> list[LayerVerification]:
        """(w13, w2) checks of one prepared expert against its source weights: value for value on the
        stored integer weights where the layout keeps them; for online FP8 kept as quantized, the
        stored bytes against the quantizer's and its measured error; else on the dequantized weights."""
        one = {k: v[None] for k, v in prepared.items()}  # a group of this expert alone
        act = spec.w13.torch_act_dtype
        kernel = self.kernel
        stored = kernel.stored_int_weights(one, spec, 0) if isinstance(refs[0], IntWeight) else (None, None)
        checks = [compare_int_stored(s, ref, act) for s, ref in zip(stored, refs, strict=True)]
        if errors != (None, None):
            fp8 = kernel.stored_fp8_weights(one, spec, 0)
            checks = [
                c or compare_fp8_measured(s, q, e)
                for c, s, q, e in zip(checks, fp8, quantized, errors, strict=True)
            ]
        if all(c is not None for c in checks):
            return [c for c in checks if c is not None]
        got = kernel.dequantize_expert(one, spec, 0)
        return [
            c or compare(g, ref, act, online="fp8" if self.online_fp8 else None)
            for c, g, ref in zip(checks, got, refs, strict=True)
        ]

    def _check_expert_tensors(self, spec: MoESpec, target: Target, prepared: dict[str, torch.Tensor]) -> None:
        stored = self.kernel.stored_tensors(spec, target)
        declared = {name: StoredTensor(t.shape[1:], t.dtype) for name, t in stored.items()}
        try:
            check_stored(self.kernel.name, spec.w13, declared, prepared)
        except LayoutError as e:
            raise undeclared_tensors(self.kernel.name, "prepare_expert", e) from e


class ExpertGroupKind:
    """Plans every MoE layer's expert group (none for a dense model; --ep needs some)."""

    def module_count(self, ctx: PlanContext) -> int:
        return sum(3 * g.num_experts for g in expert_groups(ctx.model))

    def notes(self, ctx: PlanContext) -> list[str]:
        return []

    def plan(self, ctx: PlanContext) -> list[ExpertGroupUnit]:
        groups = [plan_experts(ctx, group) for group in expert_groups(ctx.model)]
        if ctx.expert_parallel and not groups:
            raise UnsupportedError(
                f"--ep places whole experts per rank, but {ctx.model.architecture} has no experts"
            )
        return groups


def plan_experts(ctx: PlanContext, group: ExpertGroupLayout) -> ExpertGroupUnit:
    group = _as_named_in(ctx.ckpt, group)
    quant, part_quants = _expert_quant(ctx.fmt, group)
    online = ctx.online_fp8
    tq = online if online is not None and quant.scheme == "dense" else quant
    sources = _expert_sources(ctx.fmt, ctx.ckpt, group, part_quants or (quant,) * 3)
    biased = ctx.ckpt.has(f"{group.module(0, 0)}.bias")
    specs = [
        _moe_spec(ctx.model, group, tq, r, ctx.tp, ctx.expert_parallel, ctx.act_dtype, biased)
        for r in range(ctx.tp)
    ]
    choice = choose_moe_kernel(specs[0], ctx.target, ctx.disabled, kiln_layouts=ctx.kiln_layouts)
    specs = [choice.kernel.padded(spec) for spec in specs]
    for spec in specs[1:]:
        ok, reason = choice.kernel.can_implement(spec, ctx.target)
        if not ok:
            raise UnsupportedError(
                f"{group.name}: kernel {choice.kernel.name} rejects a rank's shape: {reason}"
            )
    labels = dict.fromkeys(ctx.fmt.source_label(group.module(0, part)) for part in range(3))
    return ExpertGroupUnit(
        group, quant, tq, specs, choice.kernel, choice.rejected, choice.shape_fallback, sources,
        ctx.expert_parallel, " + ".join(label for label in labels if label), part_quants,
    )  # fmt: skip


def _as_named_in(ckpt: Checkpoint, group: ExpertGroupLayout) -> ExpertGroupLayout:
    """The group with its projections named as this checkpoint names them (the architecture's
    alternatives: Mixtral's w1 / w3 / w2 become gate_proj / up_proj / down_proj in llm-compressor's
    output)."""
    for parts in (group.parts, *group.alternatives):
        named = group.named(parts)
        if any(name.startswith(named.module(0, 0) + ".") for name in ckpt.tensors):
            return named
    return group


def _expert_quant(
    fmt: CheckpointFormat, group: ExpertGroupLayout
) -> tuple[LayerQuant, tuple[LayerQuant, ...]]:
    """The one quantization every expert's gate / up / down shares and, when the three parts differ
    (GGUF Q4_K_M: Q6_K down beside Q4_K gate / up), each part's own (re-encoded into the joint one at
    conversion); a clear refusal when experts differ or the parts re-encode into no joint one."""
    firsts: list[tuple[str, LayerQuant]] = []
    for e in range(group.num_experts):
        w13, w2 = group.w13(e), group.w2(e)
        for part, layout in ((0, w13), (1, w13), (2, w2)):
            module = group.module(e, part)
            q = fmt.layer_quant(module, layout)
            if e == 0:
                firsts.append((module, q))
            elif q != firsts[part][1]:
                raise UnsupportedError(
                    f"expert group {group.name}: expert {e}'s {PART_NAMES[part]} projection ({module}) is "
                    f"{q.describe()} but {firsts[part][0]} is {firsts[part][1].describe()}; every expert "
                    "of a layer must be quantized alike (check the quantization config's ignore / targets / "
                    "dynamic rules)"
                )
    parts = tuple(q for _, q in firsts)
    if all(q == parts[0] for q in parts):
        return parts[0], ()
    joint = joint_quant(parts)
    if joint is None:
        detail = ", ".join(f"{PART_NAMES[i]} {q.describe()}" for i, q in enumerate(parts))
        raise UnsupportedError(
            f"expert group {group.name}: the experts' projections are quantized differently ({detail}); "
            "they must be quantized alike, or all be grouped integer weights without zero points or "
            "act-order (re-encoded into one exactly)"
        )
    return joint, parts


def _expert_sources(
    fmt: CheckpointFormat, ckpt: Checkpoint, group: ExpertGroupLayout, part_quants: tuple[LayerQuant, ...]
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
            names += fmt.source_tensors(module, part_quants[part])
    return names


def _moe_spec(
    model: ModelConfig, group: ExpertGroupLayout, q: LayerQuant, rank: int, tp: int, expert_parallel: bool,
    act_dtype: str, biased: bool,
) -> MoESpec:  # fmt: skip
    place = expert_placement(group, rank, tp, expert_parallel)
    i = place.intermediate
    assert model.moe is not None

    def linear(
        name: str, n: int, k: int, k_full: int, row_parallel: bool, shards: tuple[ShardSpec, ...]
    ) -> LinearSpec:
        return LinearSpec(
            name=name, n=n, k=k, k_full=k_full, row_parallel=row_parallel, act_dtype=act_dtype,
            shards=shards, has_bias=biased, **q.spec_fields(),
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
        activation=model.moe.activation,
        swiglu_limit=model.moe.swiglu_limit,
    )
