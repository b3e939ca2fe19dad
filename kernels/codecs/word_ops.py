"""Word operations for fast layout preps: SIMD-within-a-register on int32 words, in cache-sized row
blocks on threads.

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
The format-specific shuffles built from these (GPTQ unpack in codecs/gptq.py, AWQ reorder in
codecs/awq.py, Marlin repack in kernels/marlin_layout.py) are exact bit permutations, tested by the
layouts' bit-exact tests; codecs/fp8.py uses the same block driver.
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

    shares = [blocks[i::threads] for i in range(threads)]
    caller = torch.get_num_threads()
    # Threads per call, not a kept pool: kept threads keep their malloc arenas, and an MoE
    # conversion's peak RSS then wandered between 0.26x and 0.77x of the checkpoint.
    with ThreadPoolExecutor(threads - 1) as pool:
        futures = [pool.submit(run, share) for share in shares[1:]]
        try:
            run(shares[0])  # the caller takes a share itself
        finally:
            try:
                for fut in futures:  # every block is written before returning, even when one failed
                    fut.result()
            finally:
                torch.set_num_threads(caller)  # re-publish the caller's count (workers changed the default)


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


LO_NIBBLES, HI_NIBBLES = 0x0F0F0F0F, 0xF0F0F0F0 - (1 << 32)  # int32 literals of the nibble masks
