"""bitsandbytes checkpoints as transformers saves them (quant_method "bitsandbytes").

4-bit (`load_in_4bit`, `bnb_4bit_quant_type` nf4 or fp4, with or without double quantization): a
quantized module stores `weight` (packed codes), `weight.absmax`, `weight.quant_map`, the
quant_state JSON and, double-quantized, `weight.nested_absmax` / `weight.nested_quant_map`. Its codes
index the 16-entry quant_map: a value-table layer (`tile_lut4` on GPUs, `cpu_lut4` on CPU, codes,
fp32 absmax and table kept as they are; kernels/codecs/bnb.py decodes the absmax bit for bit).
8-bit (`load_in_8bit`, LLM.int8): `weight` int8 and `SCB` per row, symmetric int8 channelwise onto
the int8 kernels (the outlier threshold is an activation-time rule of bitsandbytes' matmul; Kiln
runs the whole weight in 16-bit activations or, where the plan says, per-token int8). A module
without these tensors (`llm_int8_skip_modules`, lm_head) is dense.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.base import SourceWeight
from kernels.codecs.bnb import decode_bnb_4bit, decode_bnb_int8, quant_state
from kernels.errors import UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import QuantConfigError
from services.convert.formats.base import DENSE, SUPPORTED_FORMATS_MESSAGE, CheckpointFormat, LayerQuant

QUANT_TYPES = ("nf4", "fp4")
NESTED = ("weight.nested_absmax", "weight.nested_quant_map")


class BitsAndBytesFormat(CheckpointFormat):
    name = "bitsandbytes"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        self.four_bit = bool(q.get("load_in_4bit") or q.get("_load_in_4bit"))
        eight_bit = bool(q.get("load_in_8bit") or q.get("_load_in_8bit"))
        if self.four_bit == eight_bit:
            raise QuantConfigError(
                "bitsandbytes quantization config must set exactly one of load_in_4bit / load_in_8bit, got "
                f"{self.four_bit} / {eight_bit}"
            )
        self.quant_type = str(q.get("bnb_4bit_quant_type", "fp4")).lower()
        if self.four_bit and self.quant_type not in QUANT_TYPES:
            raise UnsupportedError(
                f"bitsandbytes 4-bit quant type {self.quant_type!r} is not supported (nf4 or fp4). "
                f"{SUPPORTED_FORMATS_MESSAGE}"
            )
        if not self.four_bit and q.get("llm_int8_has_fp16_weight"):
            raise UnsupportedError(
                "bitsandbytes 8-bit with llm_int8_has_fp16_weight keeps 16-bit weights (a training "
                f"setting): save the model unquantized and convert that. {SUPPORTED_FORMATS_MESSAGE}"
            )
        self.state_suffix = f"weight.quant_state.bitsandbytes__{self.quant_type}"

    @classmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> BitsAndBytesFormat | None:
        if quantization is None or str(quantization.get("quant_method", "")).lower() != "bitsandbytes":
            return None
        return cls(ckpt, quantization)

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        if self.four_bit and self.ckpt.has(f"{module}.weight.absmax"):
            absmax = self.ckpt.tensors[f"{module}.weight.absmax"].shape
            blocks = int(torch.tensor(absmax).prod()) if absmax else 1
            elements = layout.k * next(s.size for s in layout.shards if s.module == module)
            if blocks <= 0 or elements % blocks:
                raise UnsupportedError(f"layer {module}: {blocks} absmax do not divide {elements} weights")
            blocksize = elements // blocks
            if layout.k % blocksize:
                raise UnsupportedError(
                    f"layer {module}: its bitsandbytes blocks of {blocksize} span rows (K={layout.k}); "
                    "Kiln needs K to be a multiple of the blocksize"
                )
            return LayerQuant("int", bits=4, group_size=blocksize, codebook=self.quant_type)
        if not self.four_bit and self.ckpt.has(f"{module}.SCB"):
            return LayerQuant("int", bits=8, group_size=-1)
        return DENSE

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        if lq.scheme == "dense":
            return ("weight",)
        if lq.codebook:
            return ("weight", "weight.absmax", "weight.quant_map", self.state_suffix, *NESTED)
        return ("weight", "SCB")

    def required_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return tuple(s for s in self.weight_suffixes(lq) if s not in NESTED)

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        if not lq.codebook:
            return decode_bnb_int8(tensors[f"{module}.weight"], tensors[f"{module}.SCB"])
        name = f"{module}.{self.state_suffix}"
        state = quant_state(tensors[name], name)
        if str(state.get("quant_type")) != self.quant_type or int(state.get("blocksize", 0)) != lq.group_size:
            raise UnsupportedError(
                f"layer {module}: its quant_state says {state.get('quant_type')} blocksize "
                f"{state.get('blocksize')}, the config and tensors {self.quant_type} blocksize "
                f"{lq.group_size}"
            )
        return decode_bnb_4bit(
            tensors[f"{module}.weight"],
            tensors[f"{module}.weight.absmax"],
            tensors[f"{module}.weight.quant_map"],
            state,
            nested_absmax=tensors.get(f"{module}.weight.nested_absmax"),
            nested_quant_map=tensors.get(f"{module}.weight.nested_quant_map"),
        )

    def describe(self) -> str:
        return f"bitsandbytes ({self.quant_type} 4-bit)" if self.four_bit else "bitsandbytes (LLM.int8 8-bit)"
