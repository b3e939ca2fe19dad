"""FP8 checkpoints written for vLLM's Fp8Config (docs/formats.md §5.1), quant_method "fp8".

    weight            (N, K) float8_e4m3fn
    weight_scale      () or (1,) float32     per-tensor, one per checkpoint module (q, k, v separately)
    weight_scale_inv  (ceil(N/bn), ceil(K/bk)) float32   block (a multiplier despite the name)
`ignored_layers` (fallback `modules_to_not_convert`) holds exact unfused module names. lm_head is
never quantized. Static `input_scale`s are not used: the kernels quantize activations dynamically.
"""

from __future__ import annotations

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
    cfg_list,
)


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


class Fp8Format(CheckpointFormat):
    name = "fp8"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        self.activation_scheme = str(q.get("activation_scheme", "dynamic"))
        block = q.get("weight_block_size")
        ok = isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)
        if block is not None and not ok:
            raise QuantConfigError(
                f"Fp8Config weight_block_size must be [bn, bk] positive integers, got {block!r}"
            )
        self.block_size: tuple[int, int] | None = (int(block[0]), int(block[1])) if block else None
        ignored = cfg_list(q, "ignored_layers", "Fp8Config") or cfg_list(
            q, "modules_to_not_convert", "Fp8Config"
        )
        self.ignored = {str(m) for m in ignored}
        if self.activation_scheme == "static":
            self.notes.append(
                "activation_scheme static: input_scale tensors are not used; "
                "activations are quantized dynamically by the kernels"
            )

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str) -> Fp8Format | None:
        if quantization is None:
            return None
        method = str(quantization.get("quant_method", "")).lower()
        if method == "fp8":
            return cls(ckpt, quantization)
        if "fp8" in method:
            raise UnsupportedError(f"quant_method {method!r} is not supported. {SUPPORTED_FORMATS_MESSAGE}")
        return None

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        weight = f"{module}.weight"
        is_fp8 = self.ckpt.has(weight) and self.ckpt.info(weight).dtype == "F8_E4M3"
        if module == "lm_head" or module in self.ignored:
            if is_fp8:
                raise ConversionError(f"{module} is stored as FP8 but is ignored / lm_head in the config")
            return DENSE
        if not is_fp8:
            if self.ckpt.has(weight):
                raise ConversionError(
                    f"{weight} is {self.ckpt.info(weight).dtype}, not F8_E4M3, but Fp8Config quantizes it; "
                    "list it in ignored_layers or use --method fp8 on an unquantized checkpoint"
                )
            raise ConversionError(f"{weight} is missing from the checkpoint")
        if self.block_size:
            return LayerQuant("fp8", bits=8, fp8_strategy="block", block_size=self.block_size)
        return LayerQuant("fp8", bits=8, fp8_strategy="tensor")

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        if lq.scheme == "dense":
            return ("weight",)
        return ("weight", "weight_scale_inv" if lq.fp8_strategy == "block" else "weight_scale")

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        weight = tensors[f"{module}.weight"]
        if lq.fp8_strategy == "block":
            scale = tensors[f"{module}.weight_scale_inv"].float()
            return Fp8Weight(weight, scale, "block", block_size=lq.block_size)
        scale = tensors[f"{module}.weight_scale"].float()
        if scale.numel() != 1:
            raise ConversionError(
                f"{module}.weight_scale must hold one per-tensor scale, got {tuple(scale.shape)}"
            )
        return Fp8Weight(weight, scale.reshape(1), "tensor")
