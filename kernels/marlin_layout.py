"""The Marlin in-kernel layout, byte-identical to vLLM's `gptq_marlin_repack` and helpers
(docs/formats.md §4).

Weights (`marlin_repack`): input standard GPTQ layout (K / pf, N) int32, output (K / 16, N * 16 / pf)
int32. Each 16 x 64 tile (k-tile kt, n-tile nt) becomes 1024 / pf consecutive words of row kt. With
warp w in 0..3, lane th in 0..31, off = [0, 1, 8, 9],
    row(th, v) = 16 kt + 2 (th % 4) + off[v % 4],   col(th, v) = 64 nt + 16 w + th // 4 + 8 (v // 4)
    4-bit: out[kt, 128 nt + 4 th + w]          field t = q[row(th, v), col(th, v)], v = [0,2,4,6,1,3,5,7][t]
    8-bit: out[kt, 256 nt + 8 th + 2 w + h]    field t = q[row(th, u), col(th, u)], u = 4 h + [0,2,1,3][t]
Implementation (`marlin_repack4_words` / `marlin_repack8_words` below, built on
kernels/codecs/word_ops.py): int32 word permutes plus bitwise nibble/byte swaps on contiguous
cache-sized row blocks; for 4-bit every output word is made of the same byte (th % 4) of four
source words. The inverse (`marlin_unrepack`, tests and round trips) uses uint8 strided views
and, for 8-bit, one cached 1024-entry gather per tile.
Act-order: output row k reads source row perm[k] (perm = `sort_g_idx(g_idx)[1]`).

Scales: grouped (group_size < K and != -1) permute every 64 columns by scale_perm, otherwise every 32
columns by scale_perm_single. Zero points: scale_perm on 64-column chunks, then the bit-width
interleave, then standard packing along N.
"""

from __future__ import annotations

from functools import cache

import torch

from kernels.codecs.bitpack import pack_cols, pack_rows, unpack_cols, unpack_rows
from kernels.codecs.word_ops import (
    HI_NIBBLES,
    LO_NIBBLES,
    delta_swap,
    for_each_block,
    hugepage_empty,
    serial_ops,
)
from kernels.errors import LayoutError

MARLIN_TILE = 16
MARLIN_MIN_THREAD_N = 64
MARLIN_MIN_THREAD_K = 128
MARLIN_SUPPORTED_BITS = (4, 8)
MARLIN_SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
MARLIN_INTERLEAVE: dict[int, tuple[int, ...]] = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def marlin_repack(qweight_std: torch.Tensor, bits: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """(K / pf, N) int32 standard-packed -> (K / 16, N * 16 / pf) int32 Marlin layout.

    8-bit input may be any int32 pattern (e.g. raw e4m3 bytes viewed as int32 for FP8 Marlin).
    """
    k, n = _check_weight(qweight_std, bits)
    with serial_ops():
        src = qweight_std.contiguous()
        if perm is not None and perm.numel():
            src = _permute_packed_rows(src, bits, k, perm)
        if bits == 4:
            return marlin_repack4_words(src, k, n)
        return marlin_repack8_words(src, k, n)


def marlin_unrepack(qweight_marlin: torch.Tensor, bits: int, k: int, n: int) -> torch.Tensor:
    """Exact inverse of `marlin_repack`: (K / 16, N * 16 / pf) -> (K / pf, N) int32, rows in perm order."""
    pf = 32 // bits
    if bits not in MARLIN_SUPPORTED_BITS or qweight_marlin.dtype != torch.int32:
        raise LayoutError(
            f"Marlin weights are int32 with 4 or 8 bits, got {qweight_marlin.dtype}, {bits}-bit"
        )
    if tuple(qweight_marlin.shape) != (k // MARLIN_TILE, n * MARLIN_TILE // pf):
        raise LayoutError(
            f"Marlin qweight for K={k}, N={n}, {bits}-bit must be {(k // 16, n * 16 // pf)}, "
            f"got {tuple(qweight_marlin.shape)}"
        )
    _check_tile_shape(k, n)
    src = qweight_marlin.contiguous()
    return _unrepack4(src, k, n) if bits == 4 else _unrepack8(src, k, n)


def _unrepack4(src: torch.Tensor, k: int, n: int) -> torch.Tensor:
    o = src.view(torch.uint8).view(k // 16, n // 64, 8, 4, 4, 4)  # [kt, nt, cq, b, w, byte]
    o0, o1, o2, o3 = o[..., 0], o[..., 1], o[..., 2], o[..., 3]
    out = torch.empty(k // 16, 2, n // 64, 4, 2, 8, 4, dtype=torch.uint8)
    lo, hi = 0x0F, 0xF0

    def dest(rp: int, h: int) -> torch.Tensor:  # [kt, nt, w, cq, b] -> [kt, nt, cq, b, w]
        return out[:, rp, :, :, h].permute(0, 1, 3, 4, 2)

    dest(0, 0).copy_((o0 & lo) | (o2 << 4))
    dest(1, 0).copy_((o0 >> 4) | (o2 & hi))
    dest(0, 1).copy_((o1 & lo) | (o3 << 4))
    dest(1, 1).copy_((o1 >> 4) | (o3 & hi))
    return out.view(torch.int32).view(k // 8, n)


def _unrepack8(src: torch.Tensor, k: int, n: int) -> torch.Tensor:
    tiles = src.view(torch.uint8).view(k // 16, n // 64, 1024)[..., _tile_index8_inverse()]
    return tiles.view(k // 16, n // 64, 4, 256).permute(0, 2, 1, 3).reshape(k // 4, n * 4).view(torch.int32)


@cache
def _tile_index8() -> torch.Tensor:
    """(1024,) source byte [r4, col, byte] of each Marlin byte 4 m + t of one 8-bit tile (closed form)."""
    off = (0, 1, 8, 9)
    idx = torch.empty(1024, dtype=torch.long)
    for th in range(32):
        for w in range(4):
            for h in range(2):
                for t, sub in enumerate((0, 2, 1, 3)):
                    u = 4 * h + sub
                    row = 2 * (th % 4) + off[u % 4]
                    col = 16 * w + th // 4 + 8 * (u // 4)
                    idx[4 * (8 * th + 2 * w + h) + t] = (row // 4) * 256 + col * 4 + row % 4
    return idx


@cache
def _tile_index8_inverse() -> torch.Tensor:
    return torch.argsort(_tile_index8())


def _permute_packed_rows(src: torch.Tensor, bits: int, k: int, perm: torch.Tensor) -> torch.Tensor:
    if perm.shape != (k,):
        raise LayoutError(f"Marlin act-order perm must have shape (K={k},), got {tuple(perm.shape)}")
    p = perm.long()
    if not torch.equal(torch.sort(p).values, torch.arange(k)):
        raise LayoutError("Marlin act-order perm is not a permutation of 0..K-1")
    if bits == 8:  # rows are bytes: permute them without unpacking
        rows = src.view(torch.uint8).view(k // 4, -1, 4).permute(0, 2, 1).reshape(k, -1)
        return rows[p].view(k // 4, 4, -1).permute(0, 2, 1).contiguous().view(torch.int32).view(k // 4, -1)
    return pack_rows(unpack_rows(src, bits, k)[p], bits)


def _check_weight(qweight: torch.Tensor, bits: int) -> tuple[int, int]:
    if bits not in MARLIN_SUPPORTED_BITS:
        raise LayoutError(f"Marlin packs 4- or 8-bit weights, not {bits}-bit")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise LayoutError(
            f"Marlin repack takes a 2-D int32 (K/pf, N) tensor, got {qweight.dtype} {tuple(qweight.shape)}"
        )
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    _check_tile_shape(k, n)
    return k, n


def _check_tile_shape(k: int, n: int) -> None:
    if k % MARLIN_TILE or n % MARLIN_MIN_THREAD_N:
        raise LayoutError(
            f"Marlin repack needs K % 16 == 0 and N % 64 == 0, got K={k}, N={n}; "
            "check_marlin_shape() says which kernel rule failed"
        )


# ---------------------------------------------------------------------------------------------
# Scales and zero points
# ---------------------------------------------------------------------------------------------


def marlin_permute_scales(s: torch.Tensor, k: int, n: int, group_size: int) -> torch.Tensor:
    """(G, N) -> (G, N), same dtype: grouped 64-column perm, or the single 32-column perm when
    group_size is -1 or >= K (group_size == K uses the single perm, like vLLM)."""
    _check_scales(s, n)
    g = s.shape[0]
    with serial_ops():  # a few hundred KB: an OpenMP team costs more than it saves
        if _grouped(k, group_size):  # s_m[g, 64c + 8i + j] = s[g, 64c + i + 8j]
            return s.reshape(g, n // 64, 8, 8).transpose(2, 3).reshape(g, n)
        # s_m[g, 32c + 8i + 2a + b] = s[g, 32c + 2i + 8a + b]
        return s.reshape(g, n // 32, 4, 4, 2).transpose(2, 3).reshape(g, n)


def marlin_unpermute_scales(s: torch.Tensor, k: int, n: int, group_size: int) -> torch.Tensor:
    """Inverse of `marlin_permute_scales`."""
    _check_scales(s, n)
    g = s.shape[0]
    if _grouped(k, group_size):  # an 8x8 transpose is its own inverse
        return s.reshape(g, n // 64, 8, 8).transpose(2, 3).reshape(g, n)
    return s.reshape(g, n // 32, 4, 4, 2).transpose(2, 3).reshape(g, n)


def marlin_zero_points(zp: torch.Tensor, bits: int) -> torch.Tensor:
    """(G, N) unsigned zero points -> (G, N * bits / 32) int32 (64-chunk scale_perm, interleave, pack)."""
    if bits not in MARLIN_SUPPORTED_BITS or zp.dim() != 2 or zp.shape[1] % 64:
        raise LayoutError(
            f"Marlin zero points need (G, N % 64 == 0) and 4/8 bits, got {tuple(zp.shape)}, {bits}-bit"
        )
    g, n = zp.shape
    idx = _zero_point_index(bits)
    with serial_ops():  # small tensors: an OpenMP team costs more than it saves
        return pack_cols(zp.reshape(g, n // 64, 64)[..., idx].reshape(g, n), bits)


def marlin_unpack_zero_points(zp_marlin: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `marlin_zero_points`: (G, N * bits / 32) int32 -> (G, N) uint8."""
    if bits not in MARLIN_SUPPORTED_BITS or n % 64:
        raise LayoutError(f"Marlin zero points need N % 64 == 0 and 4/8 bits, got N={n}, {bits}")
    g = zp_marlin.shape[0]
    inv = torch.argsort(_zero_point_index(bits))
    return unpack_cols(zp_marlin, bits, n).reshape(g, n // 64, 64)[..., inv].reshape(g, n)


def sort_g_idx(g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_idx_sorted (K,) int32, perm (K,) int32) with a STABLE argsort.

    vLLM's `marlin_sort_g_idx` uses torch.argsort, which is not stable, so its order of channels
    within one group is unspecified. Ours keeps the original channel order inside each group; the
    Marlin bytes are then defined by this perm, which the artifact stores (and the kernel reads).
    """
    perm = torch.sort(g_idx.long(), stable=True).indices
    return g_idx[perm].to(torch.int32), perm.to(torch.int32)


def check_marlin_shape(n: int, k: int, k_full: int, group_size: int, *, bits: int = 4) -> tuple[bool, str]:
    """vLLM's check_marlin_supports_shape plus the bit-width / group-size rules: (ok, actionable reason)."""
    if bits not in MARLIN_SUPPORTED_BITS:
        return False, (
            f"Marlin supports 4- and 8-bit weights only, this layer is {bits}-bit; "
            "target a kernel without this rule (e.g. gptq_wna16)"
        )
    if group_size not in MARLIN_SUPPORTED_GROUP_SIZES:
        return False, (
            f"group_size={group_size} is not one of Marlin's {list(MARLIN_SUPPORTED_GROUP_SIZES)}; "
            "target a kernel without this rule (e.g. gptq_wna16)"
        )
    if n % MARLIN_MIN_THREAD_N:
        return False, (
            f"N={n} on this rank is not a multiple of {MARLIN_MIN_THREAD_N} (Marlin tile); "
            f"use a TP size that keeps N/tp a multiple of {MARLIN_MIN_THREAD_N} "
            "or target a kernel without this rule"
        )
    if k % MARLIN_MIN_THREAD_K:
        return False, (
            f"K={k} on this rank is not a multiple of {MARLIN_MIN_THREAD_K} (Marlin min thread K); use a TP "
            f"size that keeps K/tp a multiple of {MARLIN_MIN_THREAD_K} or target a kernel without this rule"
        )
    if group_size != -1 and group_size < k_full and k % group_size:
        return False, (
            f"K={k} on this rank is not a multiple of group_size={group_size}, so a quantization group "
            "would straddle two ranks; use a TP size that keeps K/tp a multiple of the group size"
        )
    return True, ""


def _grouped(k: int, group_size: int) -> bool:
    return group_size != -1 and group_size < k


def _check_scales(s: torch.Tensor, n: int) -> None:
    if s.dim() != 2 or s.shape[1] != n or n % 64:
        raise LayoutError(f"Marlin scales must be (G, N={n}) with N % 64 == 0, got {tuple(s.shape)}")


@cache
def _zero_point_index(bits: int) -> torch.Tensor:
    """(64,) source column (within a 64-chunk) of each packed field position: scale_perm then interleave."""
    scale_perm = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
    il = torch.tensor(MARLIN_INTERLEAVE[bits])
    pos = torch.arange(64)
    return scale_perm[(pos // len(il)) * len(il) + il[pos % len(il)]]


def marlin_repack4_words(src: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """(K / 8, N) int32 standard-packed -> (K / 16, N * 2) int32 Marlin 4-bit layout.

    Per 16 x 64 tile, with A/B = rows 0-7 / 8-15 at column c and C/D the same at c + 8
    (c = 16 w + cq), output word (cq, b, w) holds nibbles [A, B, C, D] of byte b low, then high:
    four planes of one byte each (A.lo | B.lo << 4, C.lo | D.lo << 4, A.hi | B.hi << 4, ...) and a
    4 x 4 byte transpose across the planes.
    """
    kt, nt = k // 16, n // 64
    out = hugepage_empty((kt, nt, 8, 4, 4), torch.int32)  # [kt, nt, cq, b, w]
    view = src.view(kt, 2, nt, 4, 2, 8)  # [kt, rp, nt, w, h, cq]

    def block(blk: slice) -> None:
        r = blk.stop - blk.start
        q = torch.empty(2, 2, r, nt, 4, 8, dtype=torch.int32)  # [rp, h, kt, nt, w, cq]
        q.copy_(view[blk].permute(1, 4, 0, 2, 3, 5))
        p = torch.empty(4, r, nt, 4, 8, dtype=torch.int32)  # [byte j, kt, nt, w, cq]
        t = torch.empty(r, nt, 4, 8, dtype=torch.int32)
        for j, (lo, hi) in enumerate((((0, 0), (1, 0)), ((0, 1), (1, 1)))):
            a, b = q[lo], q[hi]
            torch.bitwise_and(a, LO_NIBBLES, out=p[j])  # low nibbles: a.lo | b.lo << 4
            torch.bitwise_and(b, LO_NIBBLES, out=t)
            p[j].bitwise_or_(t.bitwise_left_shift_(4))
            torch.bitwise_right_shift(a, 4, out=p[j + 2])  # high nibbles: a.hi | b.hi << 4
            p[j + 2].bitwise_and_(LO_NIBBLES).bitwise_or_(torch.bitwise_and(b, HI_NIBBLES, out=t))
        pv = p.view(2, 2, r, nt, 4, 8)
        s = q[0]  # quads are consumed: reuse as scratch
        delta_swap(pv[0], pv[1], 16, 0x0000FFFF, s)
        delta_swap(pv[:, 0], pv[:, 1], 8, 0x00FF00FF, s)
        out[blk].copy_(p.permute(1, 2, 4, 0, 3))

    for_each_block(kt, 8 * n, block)
    return out.view(kt, n * 2)  # (K / 16, N * 16 / 8) int32


def marlin_repack8_words(src: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """(K / 4, N) int32 (4 bytes along K) -> (K / 16, N * 4) int32 Marlin 8-bit layout.

    Source word (kt, t0, trh, nt, w, h, tq) byte (trl, t1) lands in output word
    (kt, nt, tq, trh, trl, w, h) byte (t1, t0): a 2 x 2 byte interleave of word pairs t0 = 0, 1
    (one 16-bit delta swap between them, one byte swap inside each word) plus a word permute.
    """
    kt, nt = k // 16, n // 64
    out = hugepage_empty((kt, nt, 8, 2, 2, 4, 2), torch.int32)  # [kt, nt, tq, trh, trl, w, h]
    view = src.view(kt, 2, 2, nt, 4, 2, 8)  # [kt, t0, trh, nt, w, h, tq]

    def block(blk: slice) -> None:
        p = torch.empty(2, blk.stop - blk.start, 2, nt, 4, 2, 8, dtype=torch.int32)
        p.copy_(view[blk].transpose(0, 1))  # [t0 -> trl after the swap, kt, trh, nt, w, h, tq]; a copy
        s = torch.empty_like(p)
        delta_swap(p[0], p[1], 16, 0x0000FFFF, s[0])  # p[trl] = [x(trl,0), x(trl,1), y(trl,0), y(trl,1)]
        torch.bitwise_right_shift(p, 8, out=s)  # swap bytes 1 and 2 of every word
        s.bitwise_xor_(p).bitwise_and_(0x0000FF00)
        p.bitwise_xor_(s)
        p.bitwise_xor_(s.bitwise_left_shift_(8))
        out[blk].copy_(p.permute(1, 3, 6, 2, 0, 4, 5))

    for_each_block(kt, 16 * n, block)
    return out.view(kt, n * 4)  # (K / 16, N * 16 / 4) int32
