"""cpu_w8a8: int8 weights x dynamically per-token-quantized int8 activations on CPU (`torch._int_mm`).

For layers whose checkpoint declares dynamic per-token symmetric int8 activations (SmoothQuant-style
W8A8): every token row is quantized to int8 (kernels/codecs/int8.py), the int8 x int8 product is
accumulated exactly in int32 by `torch._int_mm` (oneDNN; VNNI / AMX-INT8 where the CPU has them,
chosen by oneDNN at run time), and y = acc * scale_t * scale_n (+ bias) in fp32.

Measured on a 2-core AMD EPYC (avx512_vnni), 1536x576 / 576x1536, 2 threads, ms: M=1 0.04 vs 0.08
for cpu_int8's bf16 weight-only op; M=32 0.24-0.32 vs 1.0-1.3; M=128 0.75-1.1 vs 4.4-4.7 — plus the
activation quantization (5 small ops, ≈0.04-0.07 ms at M=1).

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
from kernels.cpu_int8 import CpuInt8Kernel


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

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        w_t = tensors["qweight"].t()  # (K, N) view of the (N, K) int8 weight
        scales = tensors["scales"].float()
        bias = tensors.get("bias")
        k, n = spec.k, spec.n

        def run(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_per_token_int8(x.reshape(-1, k))
            y = torch._int_mm(xq, w_t).float().mul_(xs[:, None]).mul_(scales)  # int32 acc is exact
            if bias is not None:
                y.add_(bias)
            return y.to(x.dtype).reshape(*x.shape[:-1], n)

        return run

    def reference(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Torch twin: the same per-token activation quantization, dequantized weight, fp32 matmul."""
        return token_quantized_reference(self, quantize_per_token_int8, x, tensors, spec)
