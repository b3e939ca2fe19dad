"""marlin_wna16: int4/int8 weight-only GEMM on vLLM's Marlin layout, read directly by a Triton kernel.

Targets sm80/sm86/sm89/sm90 (sm75 takes gptq_wna16). Stored tensors (per rank, bytes identical to
vLLM's gptq_marlin_repack / marlin_permute_scales / marlin_zero_points, docs/formats.md §4):
    qweight  (K // 16, N * bits // 2) int32   Marlin tiles; with act-order rows are in `perm` order
    scales   (G, N) act dtype                 Marlin-permuted (grouped perm iff group_size < K)
    zeros    (G, N * bits // 32) int32        4-bit asymmetric only (uint4): permuted + interleaved
    g_idx    (K,) int32                       act-order only: group of each SORTED row
    perm     (K,) int32                       act-order only: sorted row k is input channel perm[k]
    bias     (N,) act dtype                   optional, natural column order (the kernel reads it as is)
Symmetric codes are uint4b8 / uint8b128 (real = code - 2 ** (bits - 1)). With act-order the scales
hold every group of the full K on every rank (vLLM's marlin_repeat_scales_on_all_ranks).

Reading the layout in place: for element (k, n) of the (sorted) weight, with kt = k // 16,
nt = n // 64, w = (n % 64) // 16, th = 4 (n % 8) + (k % 8) // 2,
v = 4 ((n % 16) // 8) + k % 2 + 2 ((k % 16) // 8):
    4-bit: word (kt, 128 nt + 4 th + w), field t = v // 2 + 4 (v % 2)  (inverse of [0,2,4,6,1,3,5,7])
    8-bit: word (kt, 256 nt + 8 th + 2 w + v // 4), field t = (v % 4) // 2 + 2 (v % 2)  (inverse of [0,2,1,3])
Both split into a k-only and an n-only term, so the kernel adds two broadcast vectors per tile.
Scale of column n sits at 64 (n // 64) + 8 (n % 8) + (n % 64) // 8 (grouped) or
32 (n // 32) + 8 ((n % 8) // 2) + 2 ((n % 32) // 8) + n % 2 (single); the 4-bit zero point of
column n is field (j // 2 + 4 (j % 2)), j = (n % 64) // 8, of word 8 (n // 64) + n % 8.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import (
    DecodedLayoutKernel,
    IntWeight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)
from kernels.codecs.bitpack import pack_rows, unpack_rows
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, operand_tiles
from kernels.jit import act_dtype_reason, jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, default_config, fit_to_groups
from kernels.marlin_layout import (
    check_marlin_shape,
    marlin_permute_scales,
    marlin_repack,
    marlin_unpack_zero_points,
    marlin_unpermute_scales,
    marlin_unrepack,
    marlin_zero_points,
    sort_g_idx,
)
from kernels.marlin_tiles import marlin_tiles
from kernels.targets import gpu_targets


class MarlinWNA16Kernel(DecodedLayoutKernel):
    name: ClassVar[str] = "marlin_wna16"
    vllm_kernel: ClassVar[str] = "gptq_marlin"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"int"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(80)
    elsewhere: ClassVar[str] = "sm75 uses gptq_wna16, cpu uses cpu_int4 / cpu_int8"
    description: ClassVar[str] = (
        "int4/int8 weight-only on the Marlin layout (vLLM bytes), Triton dequant-GEMM"
    )

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if not spec.symmetric and spec.bits != 4:
            return False, (
                f"Marlin takes zero points only for 4-bit weights (uint4); this layer is {spec.bits}-bit "
                "asymmetric: gptq_wna16 runs it"
            )
        if reason := act_dtype_reason(spec.act_dtype, self.name, target):
            return False, reason
        return check_marlin_shape(spec.n, spec.k, spec.k_full, spec.group_size, bits=spec.bits)

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k, act = spec.n, spec.k, spec.torch_act_dtype
        out = {
            "qweight": StoredTensor((k // 16, n * spec.bits // 2), torch.int32),
            "scales": StoredTensor((spec.scale_groups, n), act),
        }
        if not spec.symmetric:
            out["zeros"] = StoredTensor((spec.scale_groups, n * spec.bits // 32), torch.int32)
        if spec.act_order:
            out["g_idx"] = StoredTensor((k,), torch.int32)
            out["perm"] = StoredTensor((k,), torch.int32)
        return with_bias(out, spec, act)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, IntWeight, spec, group_map=True)
        act = spec.torch_act_dtype
        q_std = pack_rows(weight.codes.T, spec.bits)  # (K // pf, N) int32, GPTQ standard packing
        out: dict[str, torch.Tensor] = {}
        if spec.act_order:
            g_sorted, perm = sort_g_idx(weight.group_index().to(torch.int32))
            out["qweight"] = marlin_repack(q_std, spec.bits, perm)  # (K // 16, N * bits // 2) int32
        else:
            out["qweight"] = marlin_repack(q_std, spec.bits)
        out["scales"] = marlin_permute_scales(weight.scales.to(act), spec.k, spec.n, spec.group_size)
        if weight.zeros is not None:
            out["zeros"] = marlin_zero_points(weight.zeros, spec.bits)  # (G, N * bits // 32) int32
        if spec.act_order:
            out["g_idx"] = g_sorted.contiguous()
            out["perm"] = perm.contiguous()
        if weight.bias is not None:
            out["bias"] = weight.bias.to(act).contiguous()
        return {name: t.contiguous() for name, t in out.items()}

    def stored_int_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight:
        k, n, bits = spec.k, spec.n, spec.bits
        q_std = marlin_unrepack(tensors["qweight"].cpu(), bits, k, n)  # (K // pf, N), rows in sorted order
        codes = unpack_rows(q_std, bits, k).to(torch.uint8)  # (K, N)
        scales = marlin_unpermute_scales(tensors["scales"].cpu(), k, n, spec.group_size)  # (G, N)
        zeros = None
        if "zeros" in tensors:
            zeros = marlin_unpack_zero_points(tensors["zeros"].cpu(), bits, n).to(torch.uint8)  # (G, N)
        g_idx = tensors["g_idx"].cpu() if "g_idx" in tensors else None
        if "perm" in tensors:  # sorted row i is source row perm[i]
            perm = tensors["perm"].cpu().long()
            unsorted = torch.empty_like(codes)
            unsorted[perm] = codes
            codes = unsorted
            if g_idx is not None:
                g_unsorted = torch.empty_like(g_idx)
                g_unsorted[perm] = g_idx
                g_idx = g_unsorted
        return IntWeight(codes.T, scales, bits, spec.group_size, zeros, g_idx)  # codes: an (N, K) view

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return marlin_wna16_gemm(x, tensors, spec)


def grouped_scales(spec: LinearSpec) -> bool:
    """marlin_permute_scales used the 64-column perm (else the 32-column single perm)."""
    return spec.group_size not in (-1, 0) and spec.group_size < spec.k


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]
    marlin_n_terms, _, marlin_dot = marlin_tiles()

    def marlin_wna16_kernel(
        X, QW, S, ZP, GIDX, BIAS, Y,
        M, N, K, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr, GROUPED_SCALES: tl.constexpr,
        PER_BLOCK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        # n-only parts of the Marlin word column and field shift (module docstring), once per tile
        col_n, shift_n, s_col, zp_col, zp_shift = marlin_n_terms(offs_n, BITS, GROUPED_SCALES)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)
            acc = marlin_dot(
                acc, x, QW, S, ZP, GIDX, it, offs_k, mask_k, mask_n, col_n, shift_n, s_col, zp_col, zp_shift,
                N, group_size, BITS, HAS_ZP, ACT_ORDER, PER_BLOCK_SCALE, BLOCK_K, BF16_INTERP,
            )  # fmt: skip

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(marlin_wna16_kernel)


def marlin_wna16_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias), reading the Marlin layout in place; x (..., K) bf16/fp16."""
    x2 = gemm_rows(x, spec.k, "marlin_wna16")
    act_order = "perm" in tensors
    if act_order:
        x2 = x2.index_select(1, tensors["perm"].long())  # activations in sorted-row order, once per call
    x2 = x2.contiguous()
    m, n, k = x2.shape[0], spec.n, spec.k
    group = k if spec.group_size in (-1, 0) else spec.group_size
    cfg, per_block_scale = fit_to_groups(
        config or default_config(m, n, k, x.device), group, act_order=act_order
    )
    scales = tensors["scales"]
    run = GemmLaunch.plan(x, m, n, cfg, tensors)
    return run.launch(
        _kernel(),
        x2, tensors["qweight"], scales, tensors.get("zeros", scales), tensors.get("g_idx", scales),
        run.bias_or(scales), run.y,
        m, n, k, group,
        BITS=spec.bits, HAS_ZP="zeros" in tensors, ACT_ORDER=act_order,
        GROUPED_SCALES=grouped_scales(spec), PER_BLOCK_SCALE=per_block_scale,
    )  # fmt: skip
