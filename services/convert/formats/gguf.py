"""GGUF files (llama.cpp): each linear layer's GGML block type maps onto Kiln's canonical weights.

Decoded exactly (`kernels.codecs.gguf.decode_gguf_int`): Q4_0 (symmetric int4, group 32, fp16
scale) and Q8_0 (int8, group 32, fp16 scale), which every integer kernel takes; Q4_1 and Q4_K
(int4, group 32, a float minimum per group: x = s * q + m), which only kernels that take a float
zero hold (`LinearKernel.takes_float_zeros`: on CPU `cpu_int4`, whose fp32 zero offsets keep m
exact, the scale rounded to bf16 as for every checkpoint, recorded as `max_step_err`); Q5_0 / Q5_1
/ Q5_K (5-bit) and Q6_K (6-bit, a scale per 16): on a GPU the Triton integer kernels store their
codes one per byte (exact), on CPU no packed kernel takes them and they run dense (fp32, lossless,
as 3-bit GPTQ does). Fused layers / expert groups mixing types (Q4_K_M) re-encode into one joint
quantization (services/convert/formats/joint.py).
F32 / F16 / BF16 tensors are dense. Other block types (Q2_K, Q3_K, IQ*, …) are refused with the
list of what is supported. With `--method fp8` every layer is dequantized exactly (fp32,
`dequantize_gguf`) and re-quantized to FP8 online (the way onto GPUs for what no GPU kernel takes),
and the plan says so. Plan rows show each layer's GGML type.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from kernels.base import SourceWeight
from kernels.codecs.gguf import decode_gguf_int, dequantize_gguf
from kernels.errors import UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.formats.base import DENSE, CheckpointFormat, LayerQuant
from services.convert.gguf.checkpoint import FLOAT_TYPES, GgufCheckpoint


# GGML type id -> the canonical integer weight it decodes to, exactly.
def _int(bits: int, group: int = 32, *, float_min: bool = False) -> LayerQuant:
    return LayerQuant("int", bits=bits, group_size=group, symmetric=not float_min, float_zeros=float_min)


# GGML type -> the canonical integer weight `decode_gguf_int` gives, exactly.
NATIVE: dict[str, LayerQuant] = {
    "Q4_0": _int(4),  # x = d * (q - 8)
    "Q8_0": _int(8),  # x = d * q
    "Q4_1": _int(4, float_min=True),  # x = d * q + m
    "Q4_K": _int(4, float_min=True),  # per 32: x = (d * sc) * q - dmin * m
    "Q5_0": _int(5),  # x = d * (q - 16)
    "Q5_1": _int(5, float_min=True),
    "Q5_K": _int(5, float_min=True),
    "Q6_K": _int(6, 16),  # per 16: x = (d * sc) * (q - 32)
}
FLOAT_NAMES = ("F32", "F16", "BF16")


class GgufFormat(CheckpointFormat):
    name = "gguf"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any] | None) -> None:
        super().__init__(ckpt, quantization)
        assert isinstance(ckpt, GgufCheckpoint)
        self.gguf = ckpt
        self.requantize = False  # --method fp8: every layer dequantized, re-quantized online

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str) -> GgufFormat | None:
        if not isinstance(ckpt, GgufCheckpoint):
            return None
        types = Counter(ckpt.type_name(name) for name in ckpt.ggml_types)
        fmt = cls(ckpt, {"quant_method": "gguf", "tensor_types": dict(sorted(types.items()))})
        plain = [n for n, kind in ckpt.ggml_types.items() if kind not in FLOAT_TYPES and not ckpt.is_raw(n)]
        for name in plain:
            fmt.notes.append(
                f"GGUF: {name} ({ckpt.type_name(name)}) is dequantized to {str(ckpt.plain_dtype)[6:]} "
                "(the runtime reads embeddings and norms as float tensors)"
            )
        return fmt

    def check_method(self, method: str) -> None:
        self.requantize = method == "fp8"
        note = "GGUF: every layer is dequantized exactly (fp32) and re-quantized to FP8 online (--method fp8)"
        if self.requantize and note not in self.notes:
            self.notes.append(note)

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        kind = self.gguf.type_name(f"{module}.weight")
        if kind in FLOAT_NAMES:
            return DENSE
        if kind not in NATIVE:
            supported = ", ".join([*NATIVE, *FLOAT_NAMES])
            raise UnsupportedError(
                f"layer {module} is GGUF {kind}, a block type Kiln does not decode; it converts GGUF "
                f"{supported} layers (re-quantize the model to one of them, e.g. llama.cpp's Q4_K_M)"
            )
        return DENSE if self.requantize else NATIVE[kind]

    def source_label(self, module: str) -> str:
        return f"GGUF {self.gguf.type_name(f'{module}.weight')}"

    def decode(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        name = f"{module}.weight"
        kind = self.gguf.ggml_types[name]
        # --method fp8: the exact fp32 values; a plain tensor (the embedding, as a tied head for
        # --quantize-head) comes from the checkpoint already dequantized
        if lq.scheme == "dense" and kind not in FLOAT_TYPES and tensors[name].dtype == torch.uint8:
            tensors = {
                **tensors,
                name: dequantize_gguf(tensors[name], kind, self.gguf.shapes[name][-1], name),
            }
        return super().decode(module, lq, tensors)

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        name = f"{module}.weight"
        return decode_gguf_int(tensors[name], self.gguf.ggml_types[name], self.gguf.shapes[name][-1], name)

    def describe(self) -> str:
        types = (self.quantization or {}).get("tensor_types", {})
        return "gguf (" + ", ".join(f"{n} {t}" for t, n in types.items()) + ")"
