"""cpu_lut4: bitsandbytes NF4 / FP4 weight-only GEMM on CPU, lossless.

The codes index a 16-entry value table (the checkpoint's `quant_map`) and each group (bitsandbytes'
block of 64) has an fp32 absmax: w = codebook[q] * absmax. The layer keeps its codes two per byte,
its absmax and its table; `apply` widens the weight to fp32 (codebook[q] * absmax, the exact values
bitsandbytes' dequantization computes before rounding them to its compute dtype) and runs one fp32
GEMM: the model runs fp32 activations (`cpu_act_dtype`), which torch's CPU GEMM takes at full speed
on every ISA. The dequantization reads each byte's two values from a 256-entry table (`pair_table`,
one `embedding` lookup per byte: 6x faster than unpacking the codes and gathering each). No
value-table GEMV kernel exists yet: a call still costs a dequantization of the layer (2048 x 2048 at
M = 1: ≈ 6.5 ms against 0.5 ms for the dense fp32 GEMV, AMD EPYC AVX2).

Stored tensors:
    qweight   (N, K // 2) uint8       codes, two per byte (code k of a row in the low nibble when k is even)
    scales    (N, K // group) float32 absmax of each group (double-quantized ones decoded in fp32)
    codebook  (16,) float32           value of every code
    bias      (N,) float32            optional
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import (
    CpuKernel,
    DecodedLayoutKernel,
    IntWeight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)

CODE_BITS = 4


class CpuLut4Kernel(DecodedLayoutKernel, CpuKernel):
    """Dequantizes through the stored weight (`stored_int_weight`, the value table kept)."""

    name = "cpu_lut4"
    layout_version = 1
    schemes = frozenset({"int"})
    takes_codebook = True
    cpu_act_dtype = torch.float32
    description = (
        "NF4 / FP4 value-table weight-only (bitsandbytes), codes + fp32 absmax (lossless), fp32 GEMM"
    )

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if not spec.codebook:
            return False, "cpu_lut4 takes value-table (bitsandbytes NF4 / FP4) layers only"
        if spec.bits != CODE_BITS or spec.group_size <= 0 or spec.k % spec.group_size or spec.k % 2:
            return False, (
                f"cpu_lut4 takes 4-bit codes in groups dividing K (got {spec.bits}-bit, group "
                f"{spec.group_size}, K={spec.k})"
            )
        if spec.act_order:
            return False, "cpu_lut4 takes no act-order layers"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        out = {
            "qweight": StoredTensor((spec.n, spec.k // 2), torch.uint8),
            "scales": StoredTensor((spec.n, spec.k // spec.group_size), torch.float32),
            "codebook": StoredTensor((1 << CODE_BITS,), torch.float32),
        }
        return with_bias(out, spec, torch.float32)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        w = self.prepare_input(weight, IntWeight, spec, group_map=True)
        assert w.codebook is not None, spec.name  # can_implement takes value-table layers only
        codes = w.codes
        tensors = {
            "qweight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),  # (N, K // 2) uint8
            "scales": w.scales.float().T.contiguous(),  # (N, K // group)
            "codebook": w.codebook.float().contiguous(),  # (16,)
        }
        if w.bias is not None:
            tensors["bias"] = w.bias.float().contiguous()
        return tensors

    def stored_int_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight:
        return IntWeight(
            _codes(tensors["qweight"]), tensors["scales"].T, CODE_BITS, spec.group_size,
            codebook=tensors["codebook"],
        )  # fmt: skip

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        bias, group = tensors.get("bias"), spec.group_size
        qweight, scales, pairs = tensors["qweight"], tensors["scales"], pair_table(tensors["codebook"])

        def run(x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            w = _values(qweight, scales, pairs, group)  # (N, K) fp32
            y = torch.nn.functional.linear(x.reshape(-1, spec.k).float(), w)
            if bias is not None:
                y = y + bias
            return y.to(x.dtype).reshape(*lead, spec.n)

        return run

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.bind_apply(tensors, spec)(x)


def _codes(qweight: torch.Tensor) -> torch.Tensor:
    """(R, K // 2) uint8 -> (R, K) uint8 codes."""
    return torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


def pair_table(codebook: torch.Tensor) -> torch.Tensor:
    """(256, 2) float32: the values of the two codes of every byte (low nibble first)."""
    byte = torch.arange(256)
    return torch.stack((codebook.float()[byte & 15], codebook.float()[byte >> 4]), dim=-1)


def _values(qweight: torch.Tensor, scales: torch.Tensor, pairs: torch.Tensor, group: int) -> torch.Tensor:
    """(R, K) float32 weight of (R, K // 2) packed rows: codebook[q] * absmax."""
    r, k = qweight.shape[0], qweight.shape[1] * 2
    values = torch.nn.functional.embedding(qweight.int(), pairs).view(r, k // group, group)
    return values.mul_(scales[:, :, None]).view(r, k)
