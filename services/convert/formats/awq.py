"""AutoAWQ GEMM checkpoints (docs/formats.md §2): 4-bit, zero points, contiguous groups.

Config keys: bits|w_bit, group_size|q_group_size, zero_point, version (must be "gemm"),
modules_to_not_convert (substring match, vLLM's AWQ rule). Modules without a `qweight` are dense.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.base import SourceWeight
from kernels.codecs.awq import decode_awq
from kernels.errors import UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, QuantConfigError
from services.convert.formats.base import (
    DENSE,
    SUPPORTED_FORMATS_MESSAGE,
    CheckpointFormat,
    LayerQuant,
    cfg_int,
    cfg_list,
)


class AwqFormat(CheckpointFormat):
    name = "awq"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        fields = {
            "bits|w_bit": q.get("bits", q.get("w_bit")),
            "group_size|q_group_size": q.get("group_size", q.get("q_group_size")),
        }
        self.bits = cfg_int(fields, "bits|w_bit", "AWQ")
        self.group_size = cfg_int(fields, "group_size|q_group_size", "AWQ")
        if self.group_size == 0 or self.group_size < -1:
            raise QuantConfigError(f"AWQ group_size must be -1 or positive, got {self.group_size}")
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedError(
                f"AWQ version {version!r} (GEMV layout, qweight (N, K/8)) is not supported; only AWQ "
                f"'gemm' checkpoints are. {SUPPORTED_FORMATS_MESSAGE}"
            )
        if self.bits != 4:
            raise UnsupportedError(
                f"AWQ with {self.bits} bits is not supported (AWQ is 4-bit only). {SUPPORTED_FORMATS_MESSAGE}"
            )
        if not q.get("zero_point", True):
            raise UnsupportedError(f"AWQ with zero_point=false is not supported. {SUPPORTED_FORMATS_MESSAGE}")
        self.not_convert = [str(m) for m in cfg_list(q, "modules_to_not_convert", "AWQ")]

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str) -> AwqFormat | None:
        if quantization is None:
            return None
        method = str(quantization.get("quant_method", "")).lower()
        legacy = not method and "w_bit" in quantization
        return cls(ckpt, quantization) if method == "awq" or legacy else None

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        has_q = self.ckpt.has(f"{module}.qweight")
        if any(m in module for m in self.not_convert) or not has_q:
            if has_q:
                raise ConversionError(f"{module} has AWQ tensors but is listed in modules_to_not_convert")
            return DENSE
        return LayerQuant("int", bits=self.bits, group_size=self.group_size, symmetric=False)

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return ("weight",) if lq.scheme == "dense" else ("qweight", "qzeros", "scales")

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        return decode_awq(
            tensors[f"{module}.qweight"],
            tensors[f"{module}.qzeros"],
            tensors[f"{module}.scales"],
            group_size=lq.group_size,
            bits=lq.bits,
        )
