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

from functools import cache
from typing import Any, ClassVar

import torch

from kernels.base import IntWeight, LinearKernel, LinearSpec, SourceWeight, StoredTensor, Target, with_bias
from kernels.codecs.bitpack import pack_rows, unpack_rows
from kernels.errors import LayoutError
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
from kernels.targets import gpu_targets
from kernels.triton_utils import (
    GemmConfig,
    GemmLaunch,
    act_dtype_reason,
    default_config,
    empty_rows,
    fit_to_groups,
    gemm_rows,
    marlin_helpers,
    runs_triton,
    with_helpers,
)


class MarlinWNA16Kernel(LinearKernel):
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
        if reason := act_dtype_reason(spec.act_dtype, self.name):
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
        if not isinstance(weight, IntWeight):
            raise LayoutError(f"{spec.name}: marlin_wna16 prepares IntWeight, got {type(weight).__name__}")
        _check_weight(weight, spec)
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

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.stored_int_weight(tensors, spec).dequantize().to(tensors["qweight"].device)  # (N, K)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return marlin_wna16_gemm(x, tensors, spec)


def _check_weight(weight: IntWeight, spec: LinearSpec) -> None:
    if tuple(weight.codes.shape) != (spec.n, spec.k):
        raise LayoutError(f"{spec.name}: codes are {tuple(weight.codes.shape)}, spec says {(spec.n, spec.k)}")
    if weight.bits != spec.bits or weight.symmetric != spec.symmetric:
        raise LayoutError(
            f"{spec.name}: weight is {weight.bits}-bit symmetric={weight.symmetric}, "
            f"spec says {spec.bits}-bit symmetric={spec.symmetric}"
        )
    if weight.g_idx is not None and not spec.act_order:
        expected = (
            torch.zeros(spec.k, dtype=torch.long)
            if spec.group_size in (-1, 0)
            else torch.arange(spec.k) // spec.group_size
        )
        if not torch.equal(weight.group_index(), expected):
            raise LayoutError(f"{spec.name}: weight has an act-order g_idx but spec.act_order is False")


def grouped_scales(spec: LinearSpec) -> bool:
    """marlin_permute_scales used the 64-column perm (else the 32-column single perm)."""
    return spec.group_size not in (-1, 0) and spec.group_size < spec.k


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
    if m == 0:
        return empty_rows(x, n)
    group = k if spec.group_size in (-1, 0) else spec.group_size
    cfg, per_block_scale = fit_to_groups(
        config or default_config(m, n, k, x.device), group, act_order=act_order
    )
    scales = tensors["scales"]
    bias = tensors.get("bias")
    run = GemmLaunch.plan(x, m, n, cfg)
    _kernel()[run.grid](
        x2, tensors["qweight"], scales, tensors.get("zeros", scales), tensors.get("g_idx", scales),
        bias if bias is not None else scales, run.y,
        m, n, k, group,
        BITS=spec.bits, HAS_ZP="zeros" in tensors, ACT_ORDER=act_order,
        GROUPED_SCALES=grouped_scales(spec), PER_BLOCK_SCALE=per_block_scale,
        HAS_BIAS=bias is not None, **run.meta(),
    )  # fmt: skip
    return run.result()


# The shared @triton.jit helpers (kernels/triton_utils.py), bound by with_helpers() when a kernel is built.
tile_offsets: Any = None
k_range: Any = None
store_tile: Any = None
marlin_n_terms: Any = None
marlin_dot: Any = None


@cache
def _kernel() -> Any:
    triton, tl = with_helpers(globals(), marlin_helpers())

    @triton.jit
    def marlin_wna16_kernel(
        X, QW, S, ZP, GIDX, BIAS, Y,
        M, N, K, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr, GROUPED_SCALES: tl.constexpr,
        PER_BLOCK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        pid_k = tl.program_id(1)
        offs_m, offs_n, mask_m, mask_n = tile_offsets(M, N, BLOCK_M, BLOCK_N)
        # n-only parts of the Marlin word column and field shift (module docstring), once per tile
        col_n, shift_n, s_col, zp_col, zp_shift = marlin_n_terms(offs_n, BITS, GROUPED_SCALES)
        k_begin, k_end = k_range(K, BLOCK_K, SPLIT_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                X + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            if BF16_INTERP:
                x = x.to(tl.float32)
            acc = marlin_dot(
                acc, x, QW, S, ZP, GIDX, it, offs_k, mask_k, mask_n, col_n, shift_n, s_col, zp_col, zp_shift,
                N, group_size, BITS, HAS_ZP, ACT_ORDER, PER_BLOCK_SCALE, BLOCK_K, BF16_INTERP,
            )  # fmt: skip

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return marlin_wna16_kernel
