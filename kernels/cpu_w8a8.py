"""cpu_w8a8: int8 weights x dynamically per-token-quantized int8 activations on CPU (`torch._int_mm`).

For layers whose checkpoint declares dynamic per-token symmetric int8 activations (SmoothQuant-style
W8A8): every token row is quantized to int8 (kernels/codecs/int8.py), the int8 x int8 product is
accumulated exactly in int32 by `torch._int_mm` (oneDNN; VNNI / AMX-INT8 where the CPU has them,
chosen by oneDNN at run time), and y = acc * scale_t * scale_n (+ bias) in fp32.

Measured on a 2-core AMD EPYC (avx512_vnni), 1536x576 / 576x1536, 2 threads, ms: M=1 0.04 vs 0.08
for cpu_int8's bf16 weight-only op; M=32 0.24-0.32 vs 1.0-1.3; M=128 0.75-1.1 vs 4.4-4.7 — plus the
activation quantization (5 small ops, ≈0.04-0.07 ms at M=1).

Without int8 dot products (no VNNI / AMX: `kernels.cpu_features`, read when a layer is bound) oneDNN
emulates the int8 GEMM: on an AVX2-only EPYC, 1536x576, 2 threads, `_int_mm` took 0.48 / 2.6 / 18.5 /
153 ms at M = 1 / 8 / 64 / 512 where an fp32 GEMM on the same integers took 1.2 / 1.7 / 2.3 / 6.8 ms.
There, from `FP32_MIN_M` rows on, the integers are multiplied in fp32 in K chunks of at most
`EXACT_FP32_K`, each chunk's sum exact (|sum| <= 1024 * 128 * 128 = 2^24), the chunks added in fp32
(rounded only beyond 2^24, as `_int_mm`'s int32 result is when converted to fp32).

Same weight layout as cpu_int8 (it is its W8A16 fallback, e.g. under KILN_DISABLED_KERNELS), with
fp32 scales (the epilogue is fp32, so nothing rounds them).

Stored tensors:
    qweight  (N, K) int8       code - 128 (`qweight.t()` is the (K, N) operand of _int_mm)
    scales   (N,) float32      per output channel
    bias     (N,) float32      optional
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import LinearSpec, Target, token_quantized_reference
from kernels.codecs.int8 import quantize_per_token_int8
from kernels.cpu_features import has_int8_dot_products
from kernels.cpu_int8 import CpuInt8Kernel

FP32_MIN_M = 8  # rows from which the fp32 GEMM beats the emulated int8 one (see above)
EXACT_FP32_K = 1024  # inputs per chunk whose int8 x int8 sum fp32 holds exactly


def int8_gemm_in_fp32(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, K) int8 x (N, K) int8 -> (M, N) fp32 integer products, summed exactly per K chunk."""
    out: torch.Tensor | None = None
    for s in range(0, xq.shape[1], EXACT_FP32_K):
        chunk = slice(s, s + EXACT_FP32_K)
        part = torch.nn.functional.linear(xq[:, chunk].float(), w[:, chunk].float())
        out = part if out is None else out.add_(part)
    assert out is not None
    return out


class CpuW8A8Kernel(CpuInt8Kernel):
    name = "cpu_w8a8"
    layout_version = 1
    scale_dtype = torch.float32
    description = "int8 W8A8: channelwise int8 weights x dynamic per-token int8 activations, torch._int_mm"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if not spec.int8_activations:
            return False, "cpu_w8a8 takes layers calibrated for int8 activations only (cpu_int8 runs W8A16)"
        return super().supports(spec, target)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.bind_apply(tensors, spec)(x)

    def bf16_op_rows(self) -> int:
        return 0  # it quantizes the activations as they come

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        qweight = tensors["qweight"]
        w_t = qweight.t()  # (K, N) view of the (N, K) int8 weight
        scales = tensors["scales"].float()
        bias = tensors.get("bias")
        k, n = spec.k, spec.n
        fp32_from = FP32_MIN_M if not has_int8_dot_products() else None

        def run(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_per_token_int8(x.reshape(-1, k))
            if fp32_from is not None and xq.shape[0] >= fp32_from:
                acc = int8_gemm_in_fp32(xq, qweight)
            else:
                acc = torch._int_mm(xq, w_t).float()  # int32 accumulation is exact
            y = acc.mul_(xs[:, None]).mul_(scales)
            if bias is not None:
                y.add_(bias)
            return y.to(x.dtype).reshape(*x.shape[:-1], n)

        return run

    def reference(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Torch twin: the same per-token activation quantization, dequantized weight, fp32 matmul."""
        return token_quantized_reference(self, quantize_per_token_int8, x, tensors, spec)
