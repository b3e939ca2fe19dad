"""Linear layers as plan units: every q/k/v/o, gate/up/down projection (q/k/v and gate/up fused), the
MoE routers and lm_head, one kernel each.

Planning: the shards of a fused layer are quantized alike, or re-encode exactly into one joint
integer quantization (services/convert/formats/joint.py: GGUF Q4_K_M's Q4_K q/k beside a Q6_K v);
the per-rank `LinearSpec`s follow `runtime.model_layout.rank_shape`; the registry picks the kernel
(and says whether the layer fell back because of its shape), which must take every rank's shape.

Conversion: read the layer's source tensors (positioned reads into one buffer / ranged GETs), decode
every shard into a canonical weight, then per TP rank slice + fuse (a view when the shards lie back
to back), quantize online (--method fp8), `kernel.prepare`, verify against the source (a dense
kernel's stored weight directly, else the stored integers or `kernel.dequantized_rows`, a row block at
a time), and append the tensors to the rank's streaming writer. Only one layer's tensors are in memory
at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kernels.base import (
    DenseWeight,
    IntWeight,
    LinearKernel,
    LinearSpec,
    ShardSpec,
    SourceWeight,
    Target,
    check_stored,
)
from kernels.errors import LayoutError, UnsupportedError
from kernels.registry import choose_kernel
from runtime.artifact.manifest import LayerEntry, LayerVerification, Rejection
from runtime.model_layout import LinearLayout, ModelConfig, linear_layouts, rank_shape, shard_rows
from services.convert.cpu_defaults import head_not_16_bit
from services.convert.errors import VerificationError
from services.convert.formats.base import DENSE, CheckpointFormat, LayerQuant
from services.convert.formats.joint import joint_quant, re_encode
from services.convert.heap import release_freed_heap
from services.convert.tp import fuse, slice_cols, slice_rows
from services.convert.units.base import (
    HEAD_QUANT_LAYERS,
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
from services.convert.verify import (
    compare,
    compare_dense_stored,
    compare_fp8_measured,
    compare_int_stored,
    worst_of,
)


@dataclass
class LinearUnit:
    section: ClassVar[str] = "layers"

    layout: LinearLayout
    quant: LayerQuant  # as stored in the checkpoint (agreed by every shard, or their joint one)
    target_quant: LayerQuant  # what the artifact holds (online FP8 changes dense -> fp8)
    specs: list[LinearSpec]  # one per TP rank
    kernel: LinearKernel
    rejected: list[tuple[str, str]]
    fallback: bool
    source_tensors: list[str]
    source_label: str = ""  # the source encoding when the scheme does not say it (a GGUF block type)
    # each shard's own quantization when they differ (`quant` is then their joint one); else empty
    shard_quants: tuple[LayerQuant, ...] = ()

    @property
    def online(self) -> bool:
        """Quantized here from a dense source: --method fp8, or --quantize-head's int8 lm_head."""
        return self.quant.scheme == "dense" and self.target_quant.scheme != "dense"

    @property
    def name(self) -> str:
        return self.layout.name

    def row(self) -> PlanRow:
        return PlanRow(
            layer=self.name,
            shards=[s.module for s in self.layout.shards],
            scheme=(f"{self.source_label} → " if self.source_label else "")
            + self.target_quant.describe()
            + (" (online)" if self.online else ""),
            kernel=self.kernel.name,
            fallback=self.fallback,
            rejections=list(self.rejected),
            n=self.specs[0].n,
            k=self.specs[0].k,
        )

    def stored_bytes(self, rank: int, target: Target) -> int:
        return stored_bytes(self.kernel.stored_tensors(self.specs[rank], target))

    def header_bytes(self) -> int:
        return MAX_TENSORS_PER_LAYER * (len(self.name) + 24 + HEADER_ENTRY_BYTES)

    def convert(self, files: RankFiles) -> LayerEntry:
        tensors = files.ckpt.read(self.source_tensors)
        own = self.shard_quants or (self.quant,) * len(self.layout.shards)
        shards = [
            files.fmt.decode(s.module, q, tensors) for s, q in zip(self.layout.shards, own, strict=True)
        ]
        if self.shard_quants:
            shards = [
                re_encode(w, self.quant, s.module) for s, w in zip(self.layout.shards, shards, strict=True)
            ]
        del tensors
        release_freed_heap()  # the read buffers and the decoders' temporaries, before the layout work
        for shard, w in zip(self.layout.shards, shards, strict=True):
            check_source_shape(shard.module, w, (shard.size, self.layout.k))
        worst: LayerVerification | None = None
        suffixes: list[str] | None = None
        for rank, spec in enumerate(self.specs):
            reference = self._rank_weight(files, shards, rank)
            if rank == len(self.specs) - 1:
                del shards  # what the last rank does not use (the unfused shards) goes now
            prepared, check = self._prepare_rank(files, spec, reference)
            require_reproduced(check, f"layer {self.name} (rank {rank}, kernel {self.kernel.name})")
            worst = worst_of(worst, check)
            if suffixes is not None and sorted(prepared) != suffixes:
                raise VerificationError(
                    f"layer {self.name}: ranks store different tensors ({suffixes} vs {sorted(prepared)})"
                )
            suffixes = sorted(prepared)
            for suffix in suffixes:
                files.writers[rank].add(f"{self.name}.{suffix}", prepared[suffix])
            del prepared
        return LayerEntry(
            kernel=self.kernel.name,
            layout_version=self.kernel.layout_version,
            spec=self.specs[0].to_json(),
            tensors=suffixes or [],
            source_tensors=list(self.source_tensors),
            rejected=[Rejection(kernel=k, reason=r) for k, r in self.rejected],
            fallback=self.fallback,
            verification=worst,
        )

    def _rank_weight(self, files: RankFiles, shards: list[SourceWeight], rank: int) -> SourceWeight:
        layout, tp = self.layout, files.tp
        parts = []
        for shard, w in zip(layout.shards, shards, strict=True):
            if layout.row_parallel:
                parts.append(slice_cols(w, rank, tp, shard.module))
            else:
                parts.append(slice_rows(w, shard_rows(shard, layout, files.model, rank, tp), shard.module))
        return fuse(parts, [s.module for s in layout.shards])

    def _prepare_rank(
        self, files: RankFiles, spec: LinearSpec, reference: SourceWeight
    ) -> tuple[dict, LayerVerification]:
        """One rank's prepared tensors and their check against the source."""
        kernel, target = self.kernel, files.target
        weight, error = (reference, None)
        if self.online:
            weight, error = quantize_online_measured(reference, self.target_quant)
        prepared = kernel.prepare(weight, spec, target)
        release_freed_heap()  # the layout prep's temporaries, before verification's
        try:
            check_stored(kernel.name, spec, kernel.stored_tensors(spec, target), prepared)
        except LayoutError as e:
            raise undeclared_tensors(kernel.name, "prepare", e) from e
        if kernel.stores_plain_weight and isinstance(reference, DenseWeight) and not self.online:
            return prepared, compare_dense_stored(prepared["weight"], reference)
        act = spec.torch_act_dtype
        if error is not None:
            measured = compare_fp8_measured(kernel.stored_fp8_weight(prepared, spec), weight, error)
            if measured is not None:
                return prepared, measured
        stored = kernel.stored_int_weight(prepared, spec) if isinstance(reference, IntWeight) else None
        check = compare_int_stored(stored, reference, act) or compare(
            kernel.dequantized_rows(prepared, spec),
            reference,
            act,
            online=self.target_quant.scheme if self.online else None,
        )
        return prepared, check


class LinearKind:
    """Plans every linear layer the model config has (lm_head when the checkpoint stores one)."""

    def module_count(self, ctx: PlanContext) -> int:
        layouts = linear_layouts(ctx.model, ctx.has_lm_head, ctx.tied_head)
        return sum(len(layout.shards) for layout in layouts)

    def plan(self, ctx: PlanContext) -> list[LinearUnit]:
        layouts = linear_layouts(ctx.model, ctx.has_lm_head, ctx.tied_head)
        return [plan_linear(ctx, layout) for layout in layouts]

    def notes(self, ctx: PlanContext) -> list[str]:
        return []


def plan_linear(ctx: PlanContext, layout: LinearLayout) -> LinearUnit:
    head = HEAD_QUANT_LAYERS.get(ctx.quantize_head or "") if layout.name == "lm_head" else None
    quant, shard_quants = (_head_source_quant(ctx, layout), ()) if head else _agree(ctx.fmt, layout)
    online = head or ctx.online_fp8
    # lm_head and MoE routers stay in the checkpoint's precision, as vLLM leaves them (unless
    # --quantize-head asks for the head)
    keep = online is None or (layout.full_precision and not head) or quant.scheme != "dense"
    target_quant = quant if keep else online
    assert target_quant is not None
    if head is None and takes_int8_activations(target_quant, ctx.int8_activation_bits):
        target_quant = dataclasses.replace(target_quant, int8_activations=True)
    own = shard_quants or (quant,) * len(layout.shards)
    sources = [
        t for s, q in zip(layout.shards, own, strict=True) for t in ctx.fmt.source_tensors(s.module, q)
    ]
    has_bias = all(ctx.ckpt.has(f"{s.module}.bias") for s in layout.shards)
    specs = rank_specs(layout, target_quant, ctx.model, ctx.tp, ctx.act_dtype, has_bias)
    _check_fp8_blocks(layout, specs[0], ctx.tp)
    choice = choose_kernel(specs[0], ctx.target, ctx.disabled, kiln_layouts=ctx.kiln_layouts)
    for spec in specs[1:]:
        ok, reason = choice.kernel.can_implement(spec, ctx.target)
        if not ok:
            raise UnsupportedError(
                f"{layout.name}: kernel {choice.kernel.name} rejects a TP rank's shape: {reason}"
            )
    labels = dict.fromkeys(ctx.fmt.source_label(s.module) for s in layout.shards)
    return LinearUnit(
        layout, quant, target_quant, specs, choice.kernel, choice.rejected, choice.shape_fallback, sources,
        " + ".join(label for label in labels if label), shard_quants,
    )  # fmt: skip


def takes_int8_activations(quant: LayerQuant, bits: tuple[int, ...]) -> bool:
    """Whether a checkpoint layer of `quant` moves onto int8 activations when layers of these weight
    bits take them (services/convert/cpu_defaults.py): 4-bit integer layers (cpu_w4a8; act-order
    ones stay on cpu_int4: no permuted cpu_w4a8 layout) and symmetric channelwise 8-bit ones
    (cpu_w8a8, per-token activations). The quantized head is not one: per-token int8 activations
    into SmolLM2's head cost +0.97 % perplexity (for a 19 % faster batch-1 step), against +0.12 %
    for the int8 head on 16-bit activations."""
    if quant.scheme != "int" or quant.act_order or quant.bits not in bits:
        return False
    return quant.bits == 4 or (quant.symmetric and quant.group_size in (-1, 0))


def _head_source_quant(ctx: PlanContext, layout: LinearLayout) -> LayerQuant:
    """The source quantization of the head --quantize-head quantizes: it must be 16- or 32-bit."""
    (shard,) = layout.shards
    name = f"{shard.module}.weight"
    what = head_not_16_bit(ctx.ckpt, ctx.fmt, layout, ctx.has_lm_head)
    if what is not None:
        raise UnsupportedError(
            f"--quantize-head needs lm_head (or the tied embedding {name}) stored 16- or 32-bit; this "
            f"checkpoint's is {what}: convert without --quantize-head"
        )
    return DENSE


def _agree(fmt: CheckpointFormat, layout: LinearLayout) -> tuple[LayerQuant, tuple[LayerQuant, ...]]:
    """The layer's quantization and, when its shards differ, each shard's own (re-encoded into the
    joint one at conversion)."""
    quants = [(s.module, fmt.layer_quant(s.module, layout)) for s in layout.shards]
    first = quants[0][1]
    if all(q == first for _, q in quants[1:]):
        return first, ()
    joint = joint_quant([q for _, q in quants])
    if joint is None:
        detail = ", ".join(f"{m}: {q.describe()}" for m, q in quants)
        raise UnsupportedError(
            f"the shards of fused layer {layout.name} are quantized differently ({detail}); all shards of "
            "qkv_proj / gate_up_proj must share scheme, bits, group size and ignore status, or all be "
            "grouped integer weights without zero points or act-order (re-encoded into one exactly)"
        )
    return joint, tuple(q for _, q in quants)


def rank_specs(
    layout: LinearLayout, q: LayerQuant, model: ModelConfig, tp: int, act_dtype: str, has_bias: bool
) -> list[LinearSpec]:
    specs = []
    for rank in range(tp):
        shape = rank_shape(layout, model, rank, tp)
        shard_sizes = shape.shard_sizes
        shards = (
            tuple(ShardSpec(s.module, size) for s, size in zip(layout.shards, shard_sizes, strict=True))
            if layout.fused
            else ()
        )
        specs.append(
            LinearSpec(
                name=layout.name,
                n=sum(shard_sizes),
                k=shape.k,
                k_full=layout.k,
                row_parallel=layout.row_parallel and tp > 1,
                has_bias=has_bias,
                act_dtype=act_dtype,
                shards=shards,
                **q.spec_fields(),
            )
        )
    return specs


def _check_fp8_blocks(layout: LinearLayout, spec: LinearSpec, tp: int) -> None:
    """vLLM's validate_fp8_block_shape: per-rank slices must hold whole FP8 blocks."""
    if spec.fp8_strategy != "block" or spec.block_size is None or tp == 1 or layout.replicated:
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
