"""On GPU, Kiln's bytes run on vLLM's own kernels where vLLM 0.32 has one for the stored layout (a
kernel names it: `LinearKernel.vllm_kernel`); the other layers run Kiln's Triton kernel (its
`bind_apply`). Nothing here is imported on CPU.

    gptq_marlin (Kiln's marlin_wna16): vLLM's Marlin GEMM (`apply_gptq_marlin_linear`), uint4b8 /
        uint8b128 / uint4+zp. Act-order layers (perm, g_idx) stay on Kiln's kernel: vLLM 0.32 dropped
        GPTQ desc_act. Kiln keeps the bias in natural column order (vLLM permutes its own for
        Marlin), so it is added after the GEMM.
    fp8_marlin (Kiln's fp8_marlin): vLLM's FP8-Marlin GEMM (`apply_fp8_marlin_linear`), bias after.
    fp4_marlin (Kiln's marlin_fp4): vLLM's FP4-Marlin GEMM (`apply_fp4_marlin_linear`), NVFP4 / MXFP4,
        bias after.
    cutlass_scaled_mm (Kiln's fp8_w8a8): vLLM's per-token dynamic FP8 quantization +
        `cutlass_scaled_mm` on weight.t() (per-tensor or per-channel weight scales).

Never run on a GPU in this repository's CI (it has none): bench/gpu_check.sh exercises it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import LinearKernel, LinearSpec

Apply = Callable[[torch.Tensor], torch.Tensor]


def _with_bias(run: Apply, bias: torch.Tensor | None) -> Apply:
    if bias is None:
        return run
    return lambda x: run(x).add_(bias)


def _marlin_wna16(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Apply | None:
    if "perm" in tensors or "g_idx" in tensors:
        return None
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        apply_gptq_marlin_linear,
        marlin_make_empty,
    )
    from vllm.scalar_type import scalar_types

    if spec.symmetric:
        wtype = {4: scalar_types.uint4b8, 8: scalar_types.uint8b128}.get(spec.bits)
    else:
        wtype = scalar_types.uint4 if spec.bits == 4 else None
    if wtype is None:
        return None
    qweight, scales = tensors["qweight"], tensors["scales"]
    zeros = tensors.get("zeros")
    zp = zeros if zeros is not None else marlin_make_empty(qweight.device)

    def run(x: torch.Tensor) -> torch.Tensor:
        return apply_gptq_marlin_linear(
            input=x,
            weight=qweight,
            weight_scale=scales,
            weight_zp=zp,
            workspace=None,
            wtype=wtype,
            output_size_per_partition=spec.n,
            input_size_per_partition=spec.k,
        )

    return _with_bias(run, tensors.get("bias"))


def _fp8_marlin(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Apply | None:
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import apply_fp8_marlin_linear

    qweight, scales = tensors["qweight"], tensors["scales"]

    def run(x: torch.Tensor) -> torch.Tensor:
        return apply_fp8_marlin_linear(
            input=x,
            weight=qweight,
            weight_scale=scales,
            workspace=None,
            size_n=spec.n,
            size_k=spec.k,
            bias=None,
        )

    return _with_bias(run, tensors.get("bias"))


def _fp4_marlin(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Apply | None:
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

    qweight, scales = tensors["qweight"], tensors["scales"]
    global_scale = tensors.get("global_scale")
    if global_scale is None:  # MXFP4: Kiln stores the E8M0 bytes as uint8
        scales = scales.view(torch.float8_e8m0fnu)
    else:
        global_scale = global_scale.reshape(())  # vLLM's layer holds it 0-d

    def run(x: torch.Tensor) -> torch.Tensor:
        return apply_fp4_marlin_linear(
            input=x,
            weight=qweight,
            weight_scale=scales,
            weight_global_scale=global_scale,
            workspace=None,
            size_n=spec.n,
            size_k=spec.k,
            bias=None,
        )

    return _with_bias(run, tensors.get("bias"))


def _fp8_w8a8(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Apply | None:
    from vllm import _custom_ops as ops

    weight_t = tensors["weight"].t()  # (K, N) column-major, as cutlass_scaled_mm takes it
    scale_b = tensors["weight_scale"].reshape(1, -1)  # (1, 1) per-tensor or (1, N) per-channel
    bias = tensors.get("bias")

    def run(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        q, scale_a = ops.scaled_fp8_quant(x2, use_per_token_if_dynamic=True)
        y = ops.cutlass_scaled_mm(q, weight_t, scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], spec.n)

    return run


# vLLM kernel (`LinearKernel.vllm_kernel`) -> its call on a layer's stored tensors
VLLM_KERNELS: dict[str, Callable[[dict[str, torch.Tensor], LinearSpec], Apply | None]] = {
    "gptq_marlin": _marlin_wna16,
    "fp8_marlin": _fp8_marlin,
    "fp4_marlin": _fp4_marlin,
    "cutlass_scaled_mm": _fp8_w8a8,
}


def vllm_apply(kernel: LinearKernel, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Apply | None:
    """vLLM's kernel for this layer's stored bytes, or None (run Kiln's)."""
    make = VLLM_KERNELS.get(kernel.vllm_kernel)
    return make(tensors, spec) if make is not None else None
