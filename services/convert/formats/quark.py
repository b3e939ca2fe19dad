"""AMD Quark FP8 checkpoints (quant_method "quark"), the layout vLLM's QuarkConfig reads as
QuarkW8A8Fp8 and Quark's `export_safetensors` writes.

Config: `global_quant_config.weight` {dtype "fp8_e4m3", qscheme "per_tensor" | "per_channel"
(ch_axis 0), symmetric}; `input_tensors` fp8_e4m3 per_tensor (static or dynamic) or null — Kiln's
kernels quantize activations per token themselves, so a static `input_scale` is dropped (the plan
says so); `exclude` (exact module names, `*` wildcards or vLLM's `re:` regexes) keeps modules
16-bit. Tensors of a quantized module: `weight` (N, K) float8_e4m3fn, `weight_scale` () / (1,)
per tensor or (N,) / (N, 1) per channel, a multiplier. Per-layer overrides
(`layer_quant_config`, `layer_type_quant_config`) and Quark's other schemes (int4 / int8, MXFP4,
FP8 per group) are refused with the supported list.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import torch

from kernels.base import Fp8Weight, SourceWeight
from kernels.errors import UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, QuantConfigError
from services.convert.formats.base import (
    DENSE,
    SUPPORTED_FORMATS_MESSAGE,
    CheckpointFormat,
    LayerQuant,
    cfg_dict,
    cfg_list,
)

QSCHEMES = {"per_tensor": "tensor", "per_channel": "channel"}


def _refuse(what: str) -> UnsupportedError:
    return UnsupportedError(
        f"AMD Quark {what} is not supported; Kiln reads Quark FP8 (e4m3 weights per tensor or per "
        f"channel). {SUPPORTED_FORMATS_MESSAGE}"
    )


class QuarkFormat(CheckpointFormat):
    name = "quark"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        for key in ("layer_quant_config", "layer_type_quant_config"):
            if cfg_dict(q, key, "Quark"):
                raise _refuse(f"{key} (per-layer schemes)")
        glob = cfg_dict(q, "global_quant_config", "Quark")
        weight = glob.get("weight")
        if not isinstance(weight, dict):
            raise QuantConfigError("Quark global_quant_config.weight must be an object; fix the config")
        dtype, qscheme = str(weight.get("dtype")), str(weight.get("qscheme"))
        if dtype != "fp8_e4m3" or qscheme not in QSCHEMES:
            raise _refuse(f"weight dtype {dtype!r} with qscheme {qscheme!r}")
        if qscheme == "per_channel" and weight.get("ch_axis", 0) != 0:
            raise _refuse(f"per-channel weights along ch_axis {weight.get('ch_axis')}")
        self.strategy = QSCHEMES[qscheme]
        inputs = glob.get("input_tensors")
        if isinstance(inputs, dict) and str(inputs.get("dtype")) != "fp8_e4m3":
            raise _refuse(f"input_tensors dtype {inputs.get('dtype')!r}")
        self.exclude = [str(e) for e in cfg_list(q, "exclude", "Quark")]

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str) -> QuarkFormat | None:
        if quantization is None or str(quantization.get("quant_method", "")).lower() != "quark":
            return None
        return cls(ckpt, quantization)

    def _excluded(self, module: str) -> bool:
        for pattern in self.exclude:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif fnmatch.fnmatchcase(module, pattern):
                return True
        return False

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        weight = f"{module}.weight"
        is_fp8 = self.ckpt.has(weight) and self.ckpt.info(weight).dtype == "F8_E4M3"
        if self._excluded(module) or not is_fp8:
            if is_fp8:
                raise ConversionError(f"{module} is stored as FP8 but the Quark config excludes it")
            if not self._excluded(module) and module != "lm_head" and self.ckpt.has(weight):
                raise ConversionError(
                    f"{weight} is {self.ckpt.info(weight).dtype}, not F8_E4M3, but the Quark config "
                    "quantizes it; list it in exclude or re-export the checkpoint"
                )
            return DENSE
        return LayerQuant("fp8", bits=8, fp8_strategy=self.strategy)  # type: ignore[arg-type]

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return ("weight",) if lq.scheme == "dense" else ("weight", "weight_scale")

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        weight = tensors[f"{module}.weight"]
        scale = tensors[f"{module}.weight_scale"].float().reshape(-1)
        want = 1 if lq.fp8_strategy == "tensor" else weight.shape[0]
        if scale.numel() != want:
            raise ConversionError(
                f"{module}.weight_scale holds {scale.numel()} values; a Quark {lq.fp8_strategy} FP8 layer "
                f"of {weight.shape[0]} rows needs {want}"
            )
        return Fp8Weight(weight, scale, lq.fp8_strategy)  # type: ignore[arg-type]
