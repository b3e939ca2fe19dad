"""cpu_fp8: FP8 (e4m3) checkpoints on CPU, in the fastest form that keeps the checkpoint's values.

Every e4m3 value is exactly representable in bf16 (3 mantissa bits, exponents 2^-9..2^8), so the
weight is stored widened to bf16 and the per-output-channel scale is applied to the fp32 result of
the GEMM: the matmul sees exactly the checkpoint's e4m3 values and `dequantize` equals
`Fp8Weight.dequantize()` bit for bit (the same fp32 products `value * scale`). Per-tensor scales
(one per fused shard) are expanded to one scale per output row. Block scales vary along K, so they
cannot be applied after the GEMM: those layers store the fp32 dequantized weight (the checkpoint's
dequantized values by definition) and run an fp32 GEMM. With fp32 activations
(`spec.act_dtype == "float32"`) the widened weight is stored in fp32 instead, so x is not rounded.

Measured with `python bench/cpu_kernels.py --threads 1` on this machine (AMD EPYC with
avx512_bf16; ms per call, fastest of 30; bf16 / fp32 = plain F.linear peers in the same run):

    N x K        M   (a) e4m3, widen   (b) bf16 values   (c) fp32 values   (d) fp32      bf16    fp32
                     per call          + post-scale      + post-scale      dequantized   peer    peer
    2048x2048    1   32.9              0.25              0.22              0.35          0.24    0.20
    2048x2048    8   30.8              0.33              1.42              1.40          0.32    1.10
    2048x2048    32  38.4              0.84              3.47              3.44          0.75    3.52
    1536x576     1   2.97              0.063             0.051             0.052         0.059   0.048
    1536x576     8   2.90              0.083             0.197             0.200         0.077   0.200
    1536x576     32  3.07              0.174             0.573             0.569         0.165   0.565

(a) is ruled out by torch's slow e4m3 conversion on CPU. (b) costs ≈10-20 % more than (c)/(d) at
M=1 but is 2.5-4x faster from M=8 on, at half their memory, so it is the choice; the full grid
(576x576, 1536->576) is in bench/results/cpu_kernels.json. On a CPU without native bf16 dot
products oneDNN emulates bf16 and (c) would win: fp32 activations select the fp32 storage. An
artifact stored in bf16 (the default) running on such a CPU (`kernels.cpu_features`, read when a
layer is bound) widens the bf16 weight to fp32 per call from `WIDEN_FP32_MIN_M` rows: AVX2-only EPYC,
1536x576, 2 threads, ms, bf16 GEMM / widen + fp32 GEMM: M=1 0.14 / 1.08, M=8 1.05 / 1.18, M=16 1.50 /
1.05, M=64 5.96 / 1.19, M=512 47.2 / 6.7.

Stored tensors:
    weight  (N, K) bfloat16 | float32   e4m3 values widened (tensor / channel scales), or
                                        the fp32 dequantized weight (block scales)
    scale   (N,) float32                per output row (absent for block scales)
    bias    (N,) float32                optional
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import CpuKernel, Fp8Weight, LinearSpec, SourceWeight, StoredTensor, Target, with_bias
from kernels.cpu_features import has_native_bf16

WIDEN_FP32_MIN_M = 16  # rows from which a CPU without native bf16 runs the bf16 weight widened to fp32


def widened_dtype(spec: LinearSpec) -> torch.dtype:
    """Storage dtype for the e4m3 values: fp32 with fp32 activations, bf16 otherwise."""
    return torch.float32 if spec.act_dtype == "float32" else torch.bfloat16


class CpuFp8Kernel(CpuKernel):
    name = "cpu_fp8"
    layout_version = 1
    schemes = frozenset({"fp8"})
    description = "FP8 e4m3 widened to bf16 (exact) with fp32 per-channel post-scale; block scales: fp32"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.fp8_strategy not in ("tensor", "channel", "block"):
            return False, f"unknown fp8 scale strategy {spec.fp8_strategy!r} (expected tensor/channel/block)"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k = spec.n, spec.k
        if spec.fp8_strategy == "block":
            out = {"weight": StoredTensor((n, k), torch.float32)}
        else:
            out = {
                "weight": StoredTensor((n, k), widened_dtype(spec)),
                "scale": StoredTensor((n,), torch.float32),
            }
        return with_bias(out, spec, torch.float32)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, Fp8Weight, spec)
        if weight.strategy == "block":
            tensors = {"weight": weight.dequantize().contiguous()}  # (N, K) fp32
        else:
            tensors = {
                "weight": weight.weight.to(widened_dtype(spec)).contiguous(),  # (N, K), exact
                "scale": weight.expanded_scale()[:, 0].contiguous(),  # (N,) fp32
            }
        if weight.bias is not None:
            tensors["bias"] = weight.bias.float()
        return tensors

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        w = tensors["weight"].float()
        return w * tensors["scale"][:, None] if "scale" in tensors else w

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """`apply` with the tensors resolved once (the runtime's hot path). With bf16 activations the
        per-channel scale multiplies the bf16 GEMM output in place: the product is computed in fp32
        and rounded to bf16 once, the same value `apply` returns."""
        w = tensors["weight"]
        scale = tensors.get("scale")
        bias = tensors.get("bias")
        linear = torch.nn.functional.linear
        widen_from = WIDEN_FP32_MIN_M if w.dtype == torch.bfloat16 and not has_native_bf16() else None

        def run(x: torch.Tensor) -> torch.Tensor:
            if widen_from is not None and x.numel() >= widen_from * x.shape[-1]:
                y = linear(x.float(), w.float())  # bf16 -> fp32 is exact
                y = y * scale if scale is not None else y
                return (y + bias if bias is not None else y).to(x.dtype)
            y = linear(x if x.dtype == w.dtype else x.to(w.dtype), w)
            if bias is None and y.dtype == x.dtype:
                return y.mul_(scale) if scale is not None else y
            if scale is not None:
                y = y.float() * scale
            if bias is not None:
                y = y.float() + bias
            return y.to(x.dtype)

        return run

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        w = tensors["weight"]
        y = torch.nn.functional.linear(x.to(w.dtype), w)
        scale = tensors.get("scale")
        bias = tensors.get("bias")
        if scale is not None:
            y = y.float() * scale
        if bias is not None:
            y = y.float() + bias
        return y.to(x.dtype)
