"""dense: unquantized layers on every target, and the lossless CPU fallback for quantized layers.

GPU targets store the weight as-is in the activation dtype (bf16 / fp16; fp16 on sm75, which has
no bf16 tensor cores) and refuse quantized layers: a dense copy of a 4-bit layer is 4-8x its
memory, so those must find a quantized kernel or fail with the reasons.

On the cpu target the weight is stored in fp32: bf16 / fp16 -> fp32 is exact, fp32 GEMM runs
at full speed on every x86 CPU, and it is the fastest form at M=1 (decode). bf16 GEMM is only fast
with native bf16 dot products: on this machine (avx512_bf16; `bench/cpu_kernels.py --threads 1`,
2048x2048) fp32 / bf16 took 0.20 / 0.24 ms at M=1, 1.1 / 0.32 ms at M=8 and 3.5 / 0.75 ms at M=32.

The cpu target also takes "int", "fp8" and "fp4" layers that no CPU quantized kernel takes (2/3-bit,
grouped or asymmetric 8-bit, shapes the int4 pack refuses) by storing their dequantized fp32
weight, which equals `weight.dequantize()` bit for bit.

Stored tensors:
    weight  (N, K) float32 (cpu) | act dtype (GPU)
    bias    (N,) same dtype as weight, optional
"""

from __future__ import annotations

import torch

from kernels.base import (
    DenseWeight,
    Fp4Weight,
    Fp8Weight,
    IntWeight,
    LinearKernel,
    LinearSpec,
    RowBlocks,
    SourceWeight,
    StoredTensor,
    Target,
    row_block_slices,
    with_bias,
)
from kernels.errors import LayoutError

GPU_QUANTIZED_REASON = "quantized layers on GPU use a quantized kernel; dense fallback would multiply memory"


def storage_dtype(spec: LinearSpec, target: Target) -> torch.dtype:
    """fp32 on cpu and for dequantized layers (cpu only); on GPU the layer's activation dtype, fp16
    where the target has no bf16."""
    if target is Target.CPU or spec.scheme != "dense":
        return torch.float32
    return spec.torch_act_dtype if target.has_bf16 else torch.float16


class DenseKernel(LinearKernel):
    name = "dense"
    layout_version = 1
    schemes = frozenset({"dense", "int", "fp8", "fp4"})
    targets = frozenset(Target)
    stores_plain_weight = True
    description = "torch linear on the (dequantized) weight: act dtype on GPU, fp32 on cpu"
    takes_float_zeros = True
    takes_codebook = True

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.scheme == "dense" or target is Target.CPU:
            return True, ""
        return False, GPU_QUANTIZED_REASON

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        dtype = storage_dtype(spec, target)
        return with_bias({"weight": StoredTensor((spec.n, spec.k), dtype)}, spec, dtype)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        if spec.scheme != "dense" and target.is_gpu:
            raise LayoutError(f"{self.name}: layer {spec.name}: {GPU_QUANTIZED_REASON}")
        expected = {"dense": DenseWeight, "int": IntWeight, "fp8": Fp8Weight, "fp4": Fp4Weight}[spec.scheme]
        if not isinstance(weight, expected):
            raise LayoutError(
                f"{self.name}: layer {spec.name} has scheme {spec.scheme} but got {type(weight).__name__}"
            )
        dtype = storage_dtype(spec, target)
        if isinstance(weight, DenseWeight):
            w = weight.weight
        elif isinstance(weight, IntWeight):
            w = weight.dequantize_to(dtype)  # row blocks: no full-size fp32 temporary
        else:
            w = weight.dequantize()
        if tuple(w.shape) != (spec.n, spec.k):
            raise LayoutError(
                f"{self.name}: layer {spec.name} weight has shape {tuple(w.shape)}, spec says "
                f"(N, K) = ({spec.n}, {spec.k})"
            )
        tensors = {"weight": w.to(dtype).contiguous()}  # (N, K)
        if weight.bias is not None:
            tensors["bias"] = weight.bias.to(dtype).contiguous()
        return tensors

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return tensors["weight"].float()

    def dequantized_rows(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> RowBlocks:
        w = tensors["weight"]
        for rows in row_block_slices(spec.n, spec.k):
            yield rows, w[rows].float()

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        w = tensors["weight"]
        return torch.nn.functional.linear(x.to(w.dtype), w, tensors.get("bias")).to(x.dtype)
