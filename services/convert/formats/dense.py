"""Unquantized bf16 / fp16 / fp32 checkpoints (no quantization config)."""

from __future__ import annotations

from typing import Any

from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.formats.base import DENSE, CheckpointFormat, LayerQuant


class DenseFormat(CheckpointFormat):
    name = "dense"

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str) -> DenseFormat | None:
        return cls(ckpt, None) if quantization is None else None

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        return DENSE
