"""The checkpoint-format contract: detect a format from its config, say how each layer is quantized,
and decode a layer's tensors into a canonical weight (kernels.base IntWeight / Fp8Weight / DenseWeight).

Built-ins: gptq, awq, fp8 (Fp8Config), compressed-tensors, dense. Third-party formats register a
`CheckpointFormat` subclass under the entry-point group `kiln.formats`; they are tried first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from kernels.base import DenseWeight, SourceWeight
from services.convert.errors import ConversionError

if TYPE_CHECKING:
    from services.convert.checkpoint import Checkpoint
    from services.convert.model_layout import LinearLayout

Scheme = Literal["int", "fp8", "dense"]

SUPPORTED_FORMATS_MESSAGE = (
    "Kiln supports: GPTQ (2/4/8-bit, checkpoint_format gptq or gptq_v2, sym/asym, act-order), "
    "AWQ-GEMM 4-bit with zero points, compressed-tensors pack-quantized W4A16/W8A16 (sym/asym, "
    "act-order), float-quantized FP8 (tensor/channel/block) and int-quantized int8, Fp8Config FP8 "
    "(per-tensor or block), and unquantized bf16/fp16/fp32 checkpoints (optionally quantized to FP8 "
    "online with --method fp8)"
)


@dataclass(frozen=True)
class LayerQuant:
    """How one checkpoint module is quantized (shards of a fused layer must have equal values)."""

    scheme: Scheme
    bits: int = 16
    group_size: int = -1
    symmetric: bool = True
    act_order: bool = False
    fp8_strategy: Literal["tensor", "channel", "block"] | None = None
    block_size: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.scheme == "dense":
            return "dense"
        if self.scheme == "fp8":
            extra = f" {self.block_size[0]}x{self.block_size[1]}" if self.block_size else ""
            return f"fp8 {self.fp8_strategy}{extra}"
        g = "channel" if self.group_size in (-1, 0) else f"g{self.group_size}"
        parts = [f"int{self.bits}", g, "sym" if self.symmetric else "asym"]
        if self.act_order:
            parts.append("act-order")
        return " ".join(parts)


DENSE = LayerQuant("dense")


class CheckpointFormat(ABC):
    """One checkpoint format. Instances are configured for one checkpoint by `detect`."""

    name: ClassVar[str]

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any] | None) -> None:
        self.ckpt = ckpt
        self.quantization = quantization
        self.notes: list[str] = []

    @classmethod
    @abstractmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> CheckpointFormat | None:
        """A configured instance if this checkpoint is in this format, else None.

        `quantization` is the quantization config found (config.json quantization_config /
        compression_config, or quantize_config.json / quant_config.json), `where` names its file.
        Raise UnsupportedError for a recognised but unsupported variant.
        """

    @abstractmethod
    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        """Quantization of checkpoint module `module` (a shard of runtime layer `layout`)."""

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        """Tensor suffixes this format stores for a layer with quantization `lq`."""
        return ("weight",)

    def source_tensors(self, module: str, lq: LayerQuant) -> list[str]:
        names = [f"{module}.{s}" for s in self.weight_suffixes(lq) if self.ckpt.has(f"{module}.{s}")]
        missing = [s for s in self.required_suffixes(lq) if not self.ckpt.has(f"{module}.{s}")]
        if missing:
            raise ConversionError(
                f"{module}: the checkpoint lacks {', '.join(f'{module}.{s}' for s in missing)} "
                f"required for a {self.name} {lq.describe()} layer"
            )
        if self.ckpt.has(f"{module}.bias"):
            names.append(f"{module}.bias")
        return names

    def required_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return self.weight_suffixes(lq)

    def decode(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        """Canonical weight of one module (bias attached), from the tensors `source_tensors` named."""
        w = (
            DenseWeight(tensors[f"{module}.weight"])
            if lq.scheme == "dense"
            else self.decode_quantized(module, lq, tensors)
        )
        w.bias = tensors.get(f"{module}.bias")
        return w

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        raise ConversionError(f"{self.name} cannot decode quantized layer {module}")

    def describe(self) -> str:
        return self.name
