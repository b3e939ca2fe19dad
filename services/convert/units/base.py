"""The unit protocol: a conversion plan is a list of units, each a piece of the model that one kernel
stores as a whole — a linear layer, an MoE layer's expert group. A unit kind plans its units from the
checkpoint and the model config; a unit gives its plan row and byte counts, and converts itself into
the rank files, returning its manifest entry. The plan, the pipeline and the artifact writer see only
this protocol, so a new kind of block is one module implementing it plus one line in
`services.convert.units.UNIT_KINDS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kernels.base import DenseWeight, SourceWeight, StoredTensor, Target, weight_shape
from kernels.codecs.fp8 import QuantError, quantize_fp8, quantize_fp8_measured
from kernels.codecs.int8 import quantize_channelwise_int8
from kernels.cpu_int8 import CpuInt8Kernel
from kernels.errors import LayoutError
from runtime.artifact.manifest import DerivedEntry, ExpertGroupEntry, LayerEntry, LayerVerification
from runtime.model_layout import ModelConfig
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, VerificationError
from services.convert.formats.base import CheckpointFormat, LayerQuant
from services.convert.safetensors_io import StreamingSafetensorsWriter

ONLINE_FP8_BLOCK = (128, 128)
HEADER_ENTRY_BYTES = 160  # {"dtype":"BF16","shape":[...],"data_offsets":[...]} plus quoting
MAX_TENSORS_PER_LAYER = 8  # qweight, scales, zeros, g_idx, perm, bias, ... (the header estimate)
KERNEL_BUG = "this is a kernel layout bug — disable the kernel with KILN_DISABLED_KERNELS and report it"

UnitEntry = LayerEntry | ExpertGroupEntry | DerivedEntry


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


@dataclass(frozen=True)
class PlanContext:
    """What every unit kind plans from: one checkpoint, one target, one conversion's options."""

    ckpt: Checkpoint
    fmt: CheckpointFormat
    target: Target
    model: ModelConfig
    tp: int
    method: str
    fp8_scheme: str
    act_dtype: str
    disabled: tuple[str, ...]
    expert_parallel: bool
    has_lm_head: bool
    quantize_head: str | None = None  # what lm_head is quantized to (--quantize-head or the cpu default)
    int8_activation_bits: tuple[int, ...] = ()  # layers of these weight bits take int8 activations
    kiln_layouts: bool = False  # GPU target, --gpu-layout kiln: Kiln-only layouts may be chosen

    @property
    def tied_head(self) -> bool:
        """lm_head is planned as a layer of its own from the tied embedding (a quantized head)."""
        return self.quantize_head is not None and not self.has_lm_head

    @property
    def online_fp8(self) -> LayerQuant | None:
        """What --method fp8 turns a dense layer into (vLLM's online FP8); None under --method auto."""
        return online_fp8_quant(self.fp8_scheme) if self.method == "fp8" else None


@dataclass(frozen=True)
class RankFiles:
    """Where a unit converts to: the checkpoint it reads and the rank files it writes."""

    ckpt: Checkpoint
    fmt: CheckpointFormat
    target: Target
    model: ModelConfig
    writers: list[StreamingSafetensorsWriter]  # one per rank

    @property
    def tp(self) -> int:
        return len(self.writers)


class UnitKernel(Protocol):
    name: str
    layout_version: int


class PlanUnit(Protocol):
    """One planned unit. `section` names the manifest mapping its entry is recorded in."""

    section: ClassVar[str]
    kernel: Any  # a LinearKernel or an MoEKernel: whatever kernel kind the unit's section holds
    rejected: list[tuple[str, str]]
    fallback: bool
    source_tensors: list[str]

    @property
    def name(self) -> str: ...

    def row(self) -> PlanRow: ...

    def stored_bytes(self, rank: int, target: Target) -> int:
        """Bytes of this unit's tensors in rank `rank`'s file, from the kernel's declared layout."""
        ...

    def header_bytes(self) -> int:
        """A generous estimate of its entries in a rank file's safetensors header."""
        ...

    def convert(self, files: RankFiles) -> UnitEntry:
        """Read, decode, prepare, verify and write this unit; its manifest entry."""
        ...


class UnitKind(Protocol):
    def module_count(self, ctx: PlanContext) -> int:
        """Checkpoint modules this kind plans (bounds the quantization config's pattern matching)."""
        ...

    def plan(self, ctx: PlanContext) -> Sequence[PlanUnit]: ...

    def notes(self, ctx: PlanContext) -> list[str]:
        """What the plan should say about this kind's units as a whole (none for most kinds)."""
        ...


# --quantize-head NAME -> what lm_head becomes. int8: symmetric channelwise 8-bit, cpu_int8's layout,
# with the scales it stores
HEAD_QUANT_LAYERS: dict[str, LayerQuant] = {"int8": LayerQuant("int", bits=8, group_size=-1, symmetric=True)}
HEAD_INT8_SCALE_DTYPE = CpuInt8Kernel.scale_dtype


def online_fp8_quant(fp8_scheme: str) -> LayerQuant:
    return LayerQuant(
        "fp8",
        bits=8,
        fp8_strategy=fp8_scheme,  # type: ignore[arg-type]
        block_size=ONLINE_FP8_BLOCK if fp8_scheme == "block" else None,
    )


def quantize_online_measured(
    w: SourceWeight, target_quant: LayerQuant
) -> tuple[SourceWeight, QuantError | None]:
    """`quantize_online`, with the quantization's error measured in the same pass where the
    quantizer can (FP8 per-tensor / per-channel: `quantize_fp8_measured`), else None."""
    assert isinstance(w, DenseWeight)
    strategy = target_quant.fp8_strategy or "tensor"
    if target_quant.scheme != "fp8" or strategy not in ("tensor", "channel"):
        return quantize_online(w, target_quant), None
    q, error = quantize_fp8_measured(w.weight, strategy)
    q.bias = w.bias
    return q, error


def quantize_online(w: SourceWeight, target_quant: LayerQuant) -> SourceWeight:
    """A dense source weight quantized to the plan's online scheme: FP8 (--method fp8), or
    channelwise int8 (--quantize-head int8); its bias kept."""
    assert isinstance(w, DenseWeight)
    if target_quant.scheme == "int":
        q8 = quantize_channelwise_int8(w.weight, HEAD_INT8_SCALE_DTYPE)
        q8.bias = w.bias
        return q8
    strategy = target_quant.fp8_strategy or "tensor"
    q = quantize_fp8(w.weight, strategy, block_size=target_quant.block_size or ONLINE_FP8_BLOCK)
    q.bias = w.bias
    return q


def stored_bytes(tensors: dict[str, StoredTensor]) -> int:
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values())


def check_source_shape(module: str, w: SourceWeight, want: tuple[int, int], what: str = "") -> None:
    """A decoded checkpoint weight against the (N, K) the model config gives it."""
    shape = weight_shape(w)
    if shape != want:
        raise ConversionError(
            f"{what + ' (' + module + ')' if what else module} is {shape[0]}×{shape[1]}; the model config "
            f"gives it {want[0]}×{want[1]} (config.json dimensions and the tensors disagree)"
        )


def undeclared_tensors(kernel: str, step: str, error: LayoutError) -> VerificationError:
    return VerificationError(
        f"{error}: kernel {kernel}'s {step} does not write the tensors it declares (a kernel bug — "
        "disable the kernel with KILN_DISABLED_KERNELS and report it)"
    )


def require_reproduced(check: LayerVerification, where: str) -> None:
    """`where` (unit, rank, kernel) failed its check against the source: the conversion stops."""
    if not check.ok:
        raise VerificationError(
            f"{where}: the artifact's weights do not reproduce the source: {check.metric} "
            f"{check.value:.4g} > bound {check.bound:.4g}; {KERNEL_BUG}"
        )
