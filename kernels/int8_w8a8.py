"""int8_w8a8: int8 weights x dynamically per-token-quantized int8 activations on int8 tensor cores.

For layers whose checkpoint declares dynamic per-token symmetric int8 activations (SmoothQuant-style
W8A8, llm-compressor's W8A8 scheme). A Triton kernel quantizes every token row (one program per row,
the semantics of kernels/codecs/int8.py), then the 1-byte-operand GEMM shared with fp8_w8a8
(`token_scaled_gemm`) accumulates int8 x int8 exactly in int32 and applies
y = acc * scale_t * weight_scale (+ bias) in fp32. The kernel class is fp8_w8a8's `TokenScaledKernel`.

Targets sm80+: Triton lowers int8 `tl.dot` to int8 mma there. sm75 runs such layers weight-only
(W8A16) through the kernels behind this one.

Stored tensors (per rank):
    weight        (N, K) int8     code - 128, K-major (the (K, N) column-major operand of the dot)
    weight_scale  (N,) float32    per output channel, multiplier
    bias          (N,) act dtype  optional
`reference` quantizes activations in torch the same way, so apply and its twin differ only by the
fp32 epilogue's rounding (the int32 accumulator is exact).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import LinearSpec, SourceWeight, Target
from kernels.codecs.int8 import (
    INT8_MAX,
    MIN_AMAX,
    SCALE_DIVISOR,
    quantize_per_token_int8,
    symmetric_channelwise_int8,
)
from kernels.fp8_tiles import token_quant_tiles
from kernels.fp8_w8a8 import TokenScaledKernel, quantize_rows, row_amax_tile
from kernels.jit import jit, triton_builder
from kernels.targets import gpu_targets


class Int8W8A8Kernel(TokenScaledKernel):
    name: ClassVar[str] = "int8_w8a8"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"int"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(80)
    elsewhere: ClassVar[str] = "sm75 runs int8 layers weight-only (W8A16)"
    description: ClassVar[str] = (
        "int8 W8A8: channelwise int8 weights x dynamic per-token int8 activations, int32 accumulation"
    )
    weight_dtype: ClassVar[torch.dtype] = torch.int8

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if not spec.int8_activations:
            return False, "int8_w8a8 takes layers calibrated for int8 activations only (W8A16 kernels run it)"
        if spec.bits != 8 or not spec.symmetric or spec.group_size not in (-1, 0, spec.k):
            return False, "int8_w8a8 takes symmetric channelwise 8-bit weights only"
        return super().supports(spec, target)

    def quantized_weight(self, weight: SourceWeight, spec: LinearSpec) -> tuple[torch.Tensor, torch.Tensor]:
        qweight, scales = symmetric_channelwise_int8(weight, spec, self.name)
        return qweight, scales.float().contiguous()

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_token(x2)

    def quantize_reference(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_token_int8(x2)


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token int8 quantization (one program per row); same bytes as the torch reference."""
    return quantize_rows(x2, torch.int8, _quant_kernel(), MIN_AMAX, SCALE_DIVISOR, INT8_MAX)


@triton_builder
def _quant_kernel(tl: ModuleType) -> Any:
    row_amax = row_amax_tile()
    token_scale, token_quantize = token_quant_tiles()

    def int8_per_token_quant_kernel(X, Q, S, K, min_amax, divisor, qmax, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        scale = token_scale(row_amax(X, row, K, BLOCK), min_amax, divisor, True)
        tl.store(S + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(Q + row * K + offs, token_quantize(x, scale, qmax, True, False), mask=offs < K)

    return jit(int8_per_token_quant_kernel)
