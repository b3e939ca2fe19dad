"""gpt-oss's own MXFP4 checkpoints (quant_method "mxfp4", model_type "gpt_oss"): OpenAI's release.

Only the MoE experts are quantized; every other linear layer (attention, router, lm_head) is stored
bf16, and vLLM loads them unquantized whatever `modules_to_not_convert` lists, as Kiln does. The
experts are stacked per layer; services/convert/stacked_experts.py presents expert e's projections
as per-expert modules with

    blocks  (N, K/32, 16) uint8    E2M1 codes, two per byte: byte j holds element 2j (low nibble) and
                                   2j + 1 (high), as in every safetensors FP4 format
    scales  (N, K/32) uint8        E8M0 (2^(byte - 127)) per 32 elements
    bias    (N,)                   bf16

which decode to an `Fp4Weight` "mxfp4", exactly compressed-tensors' MXFP4 (groups of 32, E8M0).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.base import Fp4Weight, SourceWeight
from kernels.codecs.fp4 import unpack_fp4
from runtime.model_layout import CLASS_EXPERT, LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError
from services.convert.formats.base import DENSE, CheckpointFormat, LayerQuant, fp4_quant

GPT_OSS_MODEL_TYPE = "gpt_oss"
QUANT_METHODS = ("mxfp4", "gpt_oss_mxfp4")  # vLLM's override takes either for model_type gpt_oss
MXFP4 = fp4_quant("mxfp4")


class GptOssMxfp4Format(CheckpointFormat):
    name = "gpt-oss-mxfp4"

    @classmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> GptOssMxfp4Format | None:
        if quantization is None or str(quantization.get("quant_method", "")).lower() not in QUANT_METHODS:
            return None
        if ckpt.config.get("model_type") != GPT_OSS_MODEL_TYPE:
            return None
        return cls(ckpt, quantization)

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        if layout.layer_class != CLASS_EXPERT:
            return DENSE
        if not self.ckpt.has(f"{module}.blocks"):
            raise ConversionError(
                f"{module}: gpt-oss MXFP4 experts are stored as gate_up_proj_blocks / down_proj_blocks "
                f"(+ _scales) per layer, and this layer's are missing ({self.ckpt.uri})"
            )
        return MXFP4

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return ("weight",) if lq.scheme == "dense" else ("blocks", "scales")

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        blocks = tensors[f"{module}.blocks"]  # (N, K/32, 16) uint8
        if blocks.dim() != 3 or blocks.shape[-1] != 16:
            raise ConversionError(f"{module}.blocks is {tuple(blocks.shape)}, expected (N, K/32, 16)")
        codes = unpack_fp4(blocks.reshape(blocks.shape[0], -1))  # (N, K)
        return Fp4Weight(codes, tensors[f"{module}.scales"], "mxfp4")

    def describe(self) -> str:
        return "gpt-oss MXFP4 experts (E2M1 + E8M0/32), bf16 elsewhere"
