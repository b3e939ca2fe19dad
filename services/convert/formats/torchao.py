"""TorchAO checkpoints saved by transformers with safetensors (quant_method "torchao", torchao 0.18).

A quantized weight is a tensor subclass flattened into `{module}._weight_<name>` tensors (and a JSON
description per weight in the file's metadata). Read here, from the config's `quant_type.default`:

* `IntxWeightOnlyConfig` (weight_dtype int2..int8, `PerGroup(g)` or `PerAxis(0)`, SYMMETRIC or
  ASYMMETRIC mapping, packing UNPACKED_TO_INT8) — torchao's int4 weight-only path on CPU:
  `IntxUnpackedToInt8Tensor`: `_weight_qdata (N, K) int8` signed codes in [-2^(b-1), 2^(b-1)),
  `_weight_scale (N, K/g)`, `_weight_zero_point (N, K/g) int8`; w = (q - zp) * s (dequantize_affine).
* `Int8WeightOnlyConfig` (`PerRow`): `Int8Tensor`, the same three tensors with one group per row.

Both become the canonical unsigned IntWeight: codes q + 2^(b-1), zero points zp + 2^(b-1) (none for
a symmetric mapping, whose zero points are 0). Other configs (the int4 `Int4WeightOnlyConfig`
packings, whose quantizer and kernels are mslk's / CUDA-only, float8 and the dynamic-activation
configs) are refused with the supported list.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.base import IntWeight, SourceWeight
from kernels.errors import UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, QuantConfigError
from services.convert.formats.base import DENSE, SUPPORTED_FORMATS_MESSAGE, CheckpointFormat, LayerQuant

SUFFIXES = ("_weight_qdata", "_weight_scale", "_weight_zero_point")
INTX_BITS = {f"int{b}": b for b in range(2, 9)}


def _data(obj: Any, *path: str) -> Any:
    """obj["_data"][path[0]]["_data"]... — torchao's serialized config objects nest so."""
    for key in path:
        obj = obj.get("_data", {}).get(key) if isinstance(obj, dict) else None
    return obj.get("_data") if isinstance(obj, dict) and "_data" in obj else obj


class TorchAoFormat(CheckpointFormat):
    name = "torchao"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        quant_type = quantization.get("quant_type")
        config = quant_type.get("default") if isinstance(quant_type, dict) else None
        if not isinstance(config, dict) or not isinstance(config.get("_type"), str):
            raise QuantConfigError(
                "TorchAO quantization config needs quant_type.default, a serialized torchao config "
                f"(a string quant_type is from transformers < 4.52); got {quant_type!r}"
            )
        kind = config["_type"]
        granularity = config.get("_data", {}).get("granularity") or {}
        grain = granularity.get("_type") if isinstance(granularity, dict) else None
        if kind == "IntxWeightOnlyConfig":
            self.bits = INTX_BITS.get(str(_data(config, "weight_dtype")), 0)
            packing = str(_data(config, "intx_packing_format"))
            mapping = str(_data(config, "mapping_type"))
            if not self.bits or packing != "UNPACKED_TO_INT8" or mapping not in ("SYMMETRIC", "ASYMMETRIC"):
                raise self._refuse(
                    f"IntxWeightOnlyConfig {_data(config, 'weight_dtype')} {packing} {mapping}"
                )
            self.symmetric = mapping == "SYMMETRIC"
        elif kind == "Int8WeightOnlyConfig":
            self.bits, self.symmetric = 8, True
        else:
            raise self._refuse(kind)
        if grain == "PerGroup":
            self.group_size = int(_data(granularity, "group_size"))
        elif grain in ("PerRow", "PerAxis"):
            self.group_size = -1
        else:
            raise self._refuse(f"{kind} with granularity {grain}")
        self.kind = kind
        self.modules_to_not_convert = [str(m) for m in quantization.get("modules_to_not_convert") or []]

    @staticmethod
    def _refuse(what: str) -> UnsupportedError:
        return UnsupportedError(
            f"TorchAO {what} is not supported; Kiln reads IntxWeightOnlyConfig (unpacked int2-int8, per "
            f"group or per channel) and Int8WeightOnlyConfig checkpoints. {SUPPORTED_FORMATS_MESSAGE}"
        )

    @classmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> TorchAoFormat | None:
        if quantization is None or str(quantization.get("quant_method", "")).lower() != "torchao":
            return None
        return cls(ckpt, quantization)

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        if not self.ckpt.has(f"{module}._weight_qdata"):
            if any(m in module for m in self.modules_to_not_convert) or self.ckpt.has(f"{module}.weight"):
                return DENSE
            raise ConversionError(f"{module} has neither TorchAO tensors nor a weight in the checkpoint")
        return LayerQuant("int", bits=self.bits, group_size=self.group_size, symmetric=self.symmetric)

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return ("weight",) if lq.scheme == "dense" else SUFFIXES

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        qdata, scale, zero = (tensors[f"{module}.{s}"] for s in SUFFIXES)
        if qdata.dtype != torch.int8 or qdata.dim() != 2:
            raise ConversionError(
                f"{module}._weight_qdata must be 2-D int8, got {qdata.dtype} {tuple(qdata.shape)}"
            )
        n, k = qdata.shape
        groups = 1 if lq.group_size in (-1, 0) else k // lq.group_size
        for name, t in (("_weight_scale", scale), ("_weight_zero_point", zero)):
            if tuple(t.shape) != (n, groups):
                raise ConversionError(
                    f"{module}.{name} is {tuple(t.shape)}, expected (N={n}, groups={groups})"
                )
        mid = 1 << (lq.bits - 1)
        lo, hi = int(qdata.min()), int(qdata.max())
        if lo < -mid or hi >= mid:
            raise ConversionError(f"{module}._weight_qdata spans [{lo}, {hi}], outside int{lq.bits}")
        codes = (qdata.to(torch.int16) + mid).to(torch.uint8)
        zeros = None
        if not lq.symmetric:
            zeros = (zero.to(torch.int16) + mid).clamp(0, 2 * mid - 1).to(torch.uint8).T.contiguous()
        elif bool((zero != 0).any()):
            raise ConversionError(f"{module}: a SYMMETRIC TorchAO layer with non-zero zero points")
        return IntWeight(codes, scale.T.contiguous(), lq.bits, lq.group_size, zeros)
