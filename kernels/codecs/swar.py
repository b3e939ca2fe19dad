"""Fast layout preps: SIMD-within-a-register on int32 words, in cache-sized row blocks on threads.

Byte-granular strided copies and int64/uint8 -> wider conversions run element by element in torch,
so the hot layout preps instead move whole int32 words with contiguous vectorized bitwise ops:
  * `delta_swap` exchanges one bit field between two word tensors (the classic bit-matrix
    transpose step), so an 8 x 8 nibble or 4 x 4 byte transpose is 2-3 rounds of six ops;
  * every prep works on blocks of rows small enough (`BLOCK_BYTES`) for their scratch to stay in
    cache, writing straight into its slice of the output;
  * blocks are spread over `torch.get_num_threads()` Python threads, each running torch ops with
    ONE intra-op thread: no OpenMP barrier per op, so a busy machine (where a spin-waiting OpenMP
    team burns CPU waiting for a descheduled peer) costs only the lost share of the cores;
  * outputs bigger than glibc's mmap threshold come from `hugepage_empty` (numpy asks the kernel
    for transparent huge pages), which cuts their first-touch page-fault cost about six-fold.
The shuffles here are exact bit permutations, tested through the layouts' bit-exact tests
(tests/kernels/test_codecs.py, test_marlin_layout.py); fp8.py uses the same block driver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

BLOCK_BYTES = 1 << 20  # source bytes per row block: scratch (~3x this) stays in L2/L3

_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}
_HUGE_MIN_BYTES = 1 << 21


def hugepage_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, backed by numpy's allocator when large (it madvises transparent huge pages)."""
    numel = int(np.prod(shape))
    if numel * dtype.itemsize < _HUGE_MIN_BYTES or dtype not in _NUMPY_DTYPES:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))


def block_rows(rows: int, row_bytes: int) -> int:
    """Rows per block: about `BLOCK_BYTES` of source, at least one, at most `rows`."""
    return max(1, min(rows, BLOCK_BYTES // max(row_bytes, 1)))


def row_blocks(rows: int, row_bytes: int) -> Iterator[slice]:
    """Consecutive slices of `rows` rows, each `block_rows(rows, row_bytes)` long (the last shorter)."""
    step = block_rows(rows, row_bytes)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


_planned = threading.local()  # .threads: block threads chosen by `serial_ops` in this thread


@contextmanager
def serial_ops() -> Iterator[int]:
    """Run torch ops of the calling thread with one intra-op thread; restore the count on exit.

    Yields the caller's thread count, which `for_each_block` inside the context uses for its block
    threads: small side ops (zero points, checks) then never start an OpenMP team, whose
    spin-waiting peers burn CPU for nothing on a busy machine.
    """
    threads = torch.get_num_threads()
    outer = getattr(_planned, "threads", None)
    _planned.threads = outer or threads
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield _planned.threads
    finally:
        _planned.threads = outer
        if threads > 1:
            torch.set_num_threads(threads)


def for_each_block(rows: int, row_bytes: int, fn: Callable[[slice], None]) -> None:
    """Call fn(block) for every row block, spread over Python threads (the thread count of the
    enclosing `serial_ops`, else torch.get_num_threads()), each with one intra-op thread.

    fn must write only its own rows of the output.
    """
    blocks = list(row_blocks(rows, row_bytes))
    threads = min(getattr(_planned, "threads", None) or torch.get_num_threads(), len(blocks))
    if threads <= 1:
        for blk in blocks:
            fn(blk)
        return

    def run(share: list[slice]) -> None:
        torch.set_num_threads(1)  # this thread's OpenMP team only
        for blk in share:
            fn(blk)

    caller = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(threads) as pool:
            for fut in [pool.submit(run, blocks[i::threads]) for i in range(threads)]:
                fut.result()
    finally:
        torch.set_num_threads(caller)  # re-publish the caller's count (workers changed the global default)


def delta_swap(x: torch.Tensor, y: torch.Tensor, shift: int, mask: int, scratch: torch.Tensor) -> None:
    """In place: swap the bits `(x >> shift) & mask` with `y & mask` (int32, same shapes)."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    scratch.bitwise_xor_(y).bitwise_and_(mask)
    y.bitwise_xor_(scratch)
    scratch.bitwise_left_shift_(shift)
    x.bitwise_xor_(scratch)


def nibbles_to_bytes(words: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """(R, W) int32 -> out (R, 4 W) int16 whose bytes are the 8 W nibbles in standard order.

    Byte b of a word becomes the int16 (b & 0xF) | (b >> 4) << 8: low nibble first, little-endian.
    `scratch` is an int16 tensor shaped like `out`.
    """
    out.copy_(words.view(torch.uint8).view(out.shape))
    torch.bitwise_left_shift(out, 4, out=scratch)
    scratch.bitwise_and_(0x0F00)
    out.bitwise_and_(0x0F).bitwise_or_(scratch)


def nibble_transpose8(v: torch.Tensor, scratch: torch.Tensor) -> None:
    """In place on v (..., 8, W) int32: transpose each 8 words x 8 nibbles matrix (word r nibble j
    <-> word j nibble r). `scratch` is int32 shaped like v[..., :4, :]."""
    lead = v.shape[:-2]
    w = v.shape[-1]
    s = scratch.view(*lead, 2, 2, w)
    r = v.view(*lead, 2, 2, 2, w)  # word index r = 4a + 2b + c
    delta_swap(r[..., 0, :, :, :], r[..., 1, :, :, :], 16, 0x0000FFFF, s)
    delta_swap(r[..., :, 0, :, :], r[..., :, 1, :, :], 8, 0x00FF00FF, s)
    delta_swap(r[..., :, :, 0, :], r[..., :, :, 1, :], 4, 0x0F0F0F0F, s)


def unpack4_transposed(packed: torch.Tensor) -> torch.Tensor:
    """(K / 8, N) int32 packed along K (standard nibble order) -> (N, K) uint8 codes."""
    kw, n = packed.shape
    out = hugepage_empty((n, kw * 4), torch.int16)  # (N, K / 2) int16 = (N, K) uint8

    words = hugepage_empty((n, kw), torch.int32)
    words.copy_(packed.T)  # one whole 2-D int32 transpose: torch's blocked fast path

    def block(blk: slice) -> None:
        scratch = torch.empty(blk.stop - blk.start, kw * 4, dtype=torch.int16)
        nibbles_to_bytes(words[blk], out[blk], scratch)

    for_each_block(n, 4 * kw, block)
    return out.view(torch.uint8).view(n, kw * 8)


_AWQ4_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) of AWQ nibble position i
_LO_NIBBLES, _HI_NIBBLES = 0x0F0F0F0F, 0xF0F0F0F0 - (1 << 32)  # int32 literals


def awq4_to_standard_rows(qweight: torch.Tensor) -> torch.Tensor:
    """(K, N / 8) int32 in AWQ nibble order (K % 8 == 0) -> (K / 8, N) int32 packed along K.

    Each block of 8 rows x 1 word is an 8 x 8 nibble matrix; transposing it leaves word i holding
    the 8 rows of AWQ nibble position i, i.e. of output column 8 c + _AWQ4_COLUMN[i].
    """
    k, w = qweight.shape
    kw = k // 8
    out = hugepage_empty((kw, w, 8), torch.int32)
    src = qweight.view(kw, 8, w)

    def block(blk: slice) -> None:
        v = src[blk].clone()
        nibble_transpose8(v, torch.empty(v.shape[0], 4, w, dtype=torch.int32))
        for i, col in enumerate(_AWQ4_COLUMN):
            out[blk, :, col].copy_(v[:, i])

    for_each_block(kw, 32 * w, block)
    return out.view(kw, 8 * w)  # (K / 8, N) int32


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
            torch.bitwise_and(a, _LO_NIBBLES, out=p[j])  # low nibbles: a.lo | b.lo << 4
            torch.bitwise_and(b, _LO_NIBBLES, out=t)
            p[j].bitwise_or_(t.bitwise_left_shift_(4))
            torch.bitwise_right_shift(a, 4, out=p[j + 2])  # high nibbles: a.hi | b.hi << 4
            p[j + 2].bitwise_and_(_LO_NIBBLES).bitwise_or_(torch.bitwise_and(b, _HI_NIBBLES, out=t))
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
