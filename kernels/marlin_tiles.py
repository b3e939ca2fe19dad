"""`@triton.jit` pieces of the dequant-GEMMs that read vLLM's Marlin layout in place (marlin_wna16,
fp8_marlin, marlin_moe_wna16); kernels/marlin_wna16.py documents the index map (docs/formats.md §4).

`marlin_n_terms`: the column-only terms of a BLOCK_N tile (word column and field shift of the
weight, column of its scale, word and shift of its 4-bit zero point);
`marlin_codes`: the (BLOCK_K, BLOCK_N) codes of one K tile of QW (4- or 8-bit fields);
`marlin_dot`: acc + x @ dequant(tile) for one BLOCK_K step (kernels/gemm.py `grouped_dot`).
QW / S / ZP / GIDX point at one layer's (one expert's) tensors.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kernels.gemm import grouped_dot_tile
from kernels.jit import jit, triton_builder


@triton_builder
def marlin_tiles(tl: ModuleType) -> tuple[Any, Any, Any]:
    """(marlin_n_terms, marlin_codes, marlin_dot), see the module docstring."""
    grouped_dot = grouped_dot_tile()

    def marlin_n_terms(offs_n, BITS: tl.constexpr, GROUPED_SCALES: tl.constexpr):
        if BITS == 4:
            col_n = 128 * (offs_n // 64) + 16 * (offs_n % 8) + (offs_n % 64) // 16
            shift_n = 8 * ((offs_n % 16) // 8)
        else:
            col_n = 256 * (offs_n // 64) + 32 * (offs_n % 8) + 2 * ((offs_n % 64) // 16) + (offs_n % 16) // 8
            shift_n = 0 * offs_n
        if GROUPED_SCALES:
            s_col = 64 * (offs_n // 64) + 8 * (offs_n % 8) + (offs_n % 64) // 8
        else:
            s_col = 32 * (offs_n // 32) + 8 * ((offs_n % 8) // 2) + 2 * ((offs_n % 32) // 8) + offs_n % 2
        zj = (offs_n % 64) // 8
        zp_col = 8 * (offs_n // 64) + offs_n % 8
        zp_shift = 4 * (zj // 2 + 4 * (zj % 2))
        return col_n, shift_n, s_col, zp_col, zp_shift

    def marlin_codes(QW, offs_k, mask_kn, col_n, shift_n, N, BITS: tl.constexpr):
        MASK: tl.constexpr = (1 << BITS) - 1
        ROW_WORDS = N * BITS // 2  # int32 words per 16-row k-tile
        if BITS == 4:
            col_k = 4 * ((offs_k % 8) // 2)
            shift_k = 4 * ((offs_k % 16) // 8 + 4 * (offs_k % 2))
        else:
            col_k = 8 * ((offs_k % 8) // 2)
            shift_k = 8 * ((offs_k % 16) // 8 + 2 * (offs_k % 2))
        addr = (offs_k // 16 * ROW_WORDS + col_k)[:, None] + col_n[None, :]
        words = tl.load(QW + addr, mask=mask_kn, other=0)
        return (words >> (shift_k[:, None] + shift_n[None, :])) & MASK

    marlin_codes = jit(marlin_codes)  # marlin_dot calls the compiled one

    def marlin_dot(
        acc, x, QW, S, ZP, GIDX, it, offs_k, mask_k, mask_n, col_n, shift_n, s_col, zp_col, zp_shift,
        N, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr,
        BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        q = marlin_codes(QW, offs_k, mask_k[:, None] & mask_n[None, :], col_n, shift_n, N, BITS)
        return grouped_dot(
            acc, x, q, S, ZP, GIDX, it, offs_k, mask_k, mask_n, s_col, zp_col, zp_shift, N // 8, N,
            group_size, BITS, HAS_ZP, ACT_ORDER, PER_BLOCK_SCALE, BLOCK_K, BF16_INTERP,
        )  # fmt: skip

    return jit(marlin_n_terms), marlin_codes, jit(marlin_dot)
