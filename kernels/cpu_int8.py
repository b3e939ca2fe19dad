"""cpu_int8: 8-bit symmetric channelwise weight-only GEMM on CPU (`aten._weight_int8pack_mm`).

`torch.ops.aten._weight_int8pack_mm(x (M, K), w (N, K) int8, scales (N,))` computes
`(x @ w.T) * scales` with x, scales and output in one dtype (torch 2.13 refuses mixed dtypes).
Measured on this CPU (2048x2048, M=1): bf16 ≈0.07-0.10 ms, fp32 ≈1.5 ms, fp16 ≈1.6 ms, so
activations run in bf16. The op is a GEMV loop whose cost grows linearly with M; widening the int8
weight to bf16 (exact) for one bf16 GEMM and scaling the fp32 result per output channel costs a
fixed ≈0.1-0.7 ms more but scales far better (1 thread, ms, op / widened):

    N x K        M=8          M=16         M=32         M=64         M=128
    2048x2048    0.38 / 0.79  0.75 / 0.95  1.53 / 1.22  3.07 / 1.91  10.1 / 3.01
    1536x576     0.09 / 0.18  0.19 / 0.21  0.37 / 0.27  0.73 / 0.39  1.47 / 0.63

so apply switches to the widened GEMM from `DEQUANT_MIN_M` rows on. Without native bf16 dot products
(`kernels.cpu_features`: oneDNN then emulates bf16) the widened bf16 GEMM is the slow one — AVX2-only
EPYC, 1536x576, 2 threads, ms, op / bf16 widened / fp32 widened: M=32 0.71 / 3.5 / 2.1, M=128
4.1 / - / 2.8, M=512 13.3 / 49 / 7.8 — so there the weight is widened to fp32 (also exact) and
multiplies the activations as they come (fp32 there: no bf16 rounding), from `DEQUANT_MIN_M_FP32`
rows on.

Checkpoint codes are unsigned with bias 128 (uint8b128), so the stored int8 is `code - 128`.
Only symmetric channelwise 8-bit fits this op; grouped or asymmetric 8-bit layers are refused
(the dense kernel takes them on cpu).

Exactness: the op path rounds the scales to bf16 (≤ 2^-8 relative; none for bf16 checkpoints);
`dequantize` returns exactly what that path multiplies by.

Stored tensors:
    qweight  (N, K) int8       code - 128
    scales   (N,) bfloat16     per output channel
    bias     (N,) float32      optional
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import (
    ALL_ROWS,
    CpuKernel,
    IntWeight,
    LinearSpec,
    RowBlocks,
    SourceWeight,
    StoredTensor,
    Target,
    row_block_slices,
    with_bias,
)
from kernels.codecs.int8 import symmetric_channelwise_int8
from kernels.cpu_features import has_native_bf16

DEQUANT_MIN_M = 32  # from this many rows on, one bf16 GEMM on the widened weight beats the op
DEQUANT_MIN_M_FP32 = 128  # the same for an fp32 GEMM, on CPUs without native bf16
# torch 2.13's op segfaults from 4 rows on when the weight does not start 16-byte aligned, which a
# tensor memory-mapped from a safetensors file (8-byte aligned) may not: such a weight is copied once.
OP_WEIGHT_ALIGNMENT = 16


def op_aligned(qweight: torch.Tensor) -> torch.Tensor:
    """`qweight`, or a copy of it in a fresh (64-byte aligned) allocation when the op cannot take it."""
    return qweight.clone() if qweight.data_ptr() % OP_WEIGHT_ALIGNMENT else qweight


class CpuInt8Kernel(CpuKernel):
    name = "cpu_int8"
    layout_version = 1
    schemes = frozenset({"int"})
    scale_dtype: torch.dtype = torch.bfloat16  # what the op multiplies by (it takes x's dtype)
    description = "8-bit symmetric channelwise weight-only, aten._weight_int8pack_mm (bf16 activations)"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.bits != 8:
            return False, f"cpu_int8 takes 8-bit weights only (layer has {spec.bits} bits)"
        if not spec.symmetric:
            return False, "cpu_int8 takes symmetric 8-bit only (asymmetric zero points: dense fallback)"
        if spec.group_size not in (-1, 0, spec.k):
            return False, (
                f"cpu_int8 takes channelwise 8-bit only (group size {spec.group_size}: dense fallback)"
            )
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        out = {
            "qweight": StoredTensor((spec.n, spec.k), torch.int8),
            "scales": StoredTensor((spec.n,), self.scale_dtype),
        }
        return with_bias(out, spec, torch.float32)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        qweight, scales = symmetric_channelwise_int8(weight, spec, self.name)
        tensors = {"qweight": qweight, "scales": scales.to(self.scale_dtype).contiguous()}  # (N, K), (N,)
        if isinstance(weight, IntWeight) and weight.bias is not None:
            tensors["bias"] = weight.bias.float()
        return tensors

    def bf16_op_rows(self) -> int:
        """The op below the widened GEMM's threshold; the widened GEMM too where it runs in bf16
        (which rounds its sum before the channel scale: the step rounds after it, one rounding
        apart)."""
        return ALL_ROWS if has_native_bf16() else DEQUANT_MIN_M_FP32

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        qweight = op_aligned(tensors["qweight"])  # once, not per call
        gemm = self._gemm
        return lambda x: gemm(x, qweight, tensors, spec)

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return tensors["qweight"].float() * tensors["scales"].float()[:, None]

    def dequantized_rows(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> RowBlocks:
        for rows in row_block_slices(spec.n, spec.k):
            yield rows, tensors["qweight"][rows].float() * tensors["scales"][rows].float()[:, None]

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self._gemm(x, op_aligned(tensors["qweight"]), tensors, spec)

    def _gemm(
        self, x: torch.Tensor, qweight: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> torch.Tensor:
        """y = x @ W.T (+ bias) with `qweight` already as the op can take it (16-byte aligned)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, spec.k)
        bias = tensors.get("bias")
        widen = torch.bfloat16 if has_native_bf16() else torch.float32
        if x2.shape[0] >= (DEQUANT_MIN_M if widen == torch.bfloat16 else DEQUANT_MIN_M_FP32):
            w = qweight.to(widen)  # exact: |q| <= 128
            y = torch.nn.functional.linear(x2.to(widen), w).float() * tensors["scales"].float()
        else:
            xb = x2.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(xb, qweight, tensors["scales"])
        if bias is not None:
            y = y.float() + bias
        return y.to(x.dtype).reshape(*lead, spec.n)
