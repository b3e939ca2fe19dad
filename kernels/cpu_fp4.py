"""cpu_fp4: FP4 (NVFP4 / MXFP4) weight-only GEMM on CPU, lossless.

Every E2M1 value times 2 is an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}, so the codes are stored
as int8 `2 * E2M1(code)` and the block scale absorbs the ½: `scales = scale / 2`, exact in bf16 for
both encodings (an E4M3 value has 4 significant bits and a halved E8M0 power of two 2^-128..2^126
lies in bf16's range, subnormals included). The fp32 global multiplier of NVFP4 is kept per output
row (fused q/k/v or gate/up shards keep their own), applied to the fp32 result:

    w[n, k] = qweight[n, k] * scales[n, k // group] * global_scale[n]

This is the integer layout an integer-dot-product GEMV takes (8-bit weights, a scale per group);
until that kernel exists `apply` widens a block of weights to bf16 — `qweight * scales` is exact in
bf16 (at most 2 + 4 significant bits) — and runs one bf16 GEMM with fp32 accumulation.

Stored tensors:
    qweight       (N, K) int8           2 * E2M1 value
    scales        (N, K // group) bf16  block scale / 2 (group 16 nvfp4, 32 mxfp4)
    global_scale  (N,) float32          nvfp4 only: the global multiplier of each row's shard
    bias          (N,) float32          optional
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import (
    E2M1_VALUES,
    CpuKernel,
    Fp4Weight,
    LinearSpec,
    RowBlocks,
    SourceWeight,
    StoredTensor,
    Target,
    row_block_slices,
    with_bias,
)

# 2 * E2M1 value of every code: integers, exact in int8.
DOUBLED_E2M1 = tuple(int(2 * v) for v in E2M1_VALUES)


def doubled_codes(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 E2M1 codes -> (N, K) int8 2 * value."""
    return torch.tensor(DOUBLED_E2M1, dtype=torch.int8)[codes.long()]


class CpuFp4Kernel(CpuKernel):
    name = "cpu_fp4"
    layout_version = 1
    schemes = frozenset({"fp4"})
    description = "NVFP4 / MXFP4 weight-only as int8 2*E2M1 + bf16 half-scales (lossless), bf16 GEMM"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.fp4_format is None or spec.k % spec.group_size:
            return False, f"cpu_fp4 needs an FP4 format and K % {spec.group_size} == 0 (K={spec.k})"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        out = {
            "qweight": StoredTensor((spec.n, spec.k), torch.int8),
            "scales": StoredTensor((spec.n, spec.k // spec.group_size), torch.bfloat16),
        }
        if spec.fp4_format == "nvfp4":
            out["global_scale"] = StoredTensor((spec.n,), torch.float32)
        return with_bias(out, spec, torch.float32)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        w = self.prepare_input(weight, Fp4Weight, spec)
        qweight = torch.empty(w.codes.shape, dtype=torch.int8)
        for rows in row_block_slices(spec.n, spec.k):
            qweight[rows] = doubled_codes(w.codes[rows])  # (N, K) int8
        tensors = {"qweight": qweight, "scales": (w.scale_values() / 2).to(torch.bfloat16).contiguous()}
        row_global = w.row_global()
        if row_global is not None:
            tensors["global_scale"] = row_global.contiguous()
        if w.bias is not None:
            tensors["bias"] = w.bias.float().contiguous()
        return tensors

    def dequantized_rows(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> RowBlocks:
        g = tensors.get("global_scale")
        for rows in row_block_slices(spec.n, spec.k):
            block = _widened(tensors["qweight"][rows], tensors["scales"][rows], spec.group_size).float()
            yield rows, block if g is None else block * g[rows, None].float()

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        out = torch.empty((spec.n, spec.k), dtype=torch.float32)
        for rows, block in self.dequantized_rows(tensors, spec):
            out[rows] = block
        return out

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        qweight, scales = tensors["qweight"], tensors["scales"]
        g, bias, group = tensors.get("global_scale"), tensors.get("bias"), spec.group_size

        def run(x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            w = _widened(qweight, scales, group)  # (N, K) bf16, exact
            y = torch.nn.functional.linear(x.reshape(-1, spec.k).to(torch.bfloat16), w).float()
            if g is not None:
                y = y * g
            if bias is not None:
                y = y + bias
            return y.to(x.dtype).reshape(*lead, spec.n)

        return run

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.bind_apply(tensors, spec)(x)


def _widened(qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """(R, K) int8 * (R, K / group) bf16 half-scales -> (R, K) bf16, exact."""
    r, k = qweight.shape
    w = qweight.to(torch.bfloat16).view(r, k // group, group)
    return (w * scales[:, :, None]).view(r, k)
