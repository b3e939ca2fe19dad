"""safetensors reading by byte ranges and a streaming writer with bounded memory.

Reading: the header (8-byte little-endian length + JSON) is parsed from the first bytes of a file,
so an S3 source is read with ranged GETs; local files are memory-mapped with `safe_open` per layer.

Writing: `StreamingSafetensorsWriter` writes each tensor's bytes once, straight into the final
file behind a reserved header region, and fills the header in at `finish()` (see the class).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from runtime.artifact.safetensors_header import DTYPES, header_length, validate_header
from services.convert.errors import ConversionError, SourceSafetensorsError

log = logging.getLogger(__name__)

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
COPY_CHUNK = 8 << 20
DEFAULT_HEADER_RESERVE = 64 << 10
MAX_PENDING_BYTES = 64 << 20  # queued for the writer thread, per file (held in memory until written)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # source file name
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def parse_header(
    file: str,
    first_bytes: bytes,
    read_more: Callable[[int, int], bytes],
    file_size: int | None = None,
) -> dict[str, TensorInfo]:
    """Tensor index of one safetensors file, strictly validated (SourceSafetensorsError on any defect).

    `read_more(start, end)` fetches more bytes if the header is longer than `first_bytes`;
    `file_size` (when known) lets the offsets be checked against the end of the file.
    """
    hlen = header_length(file, first_bytes[:8], file_size, error=SourceSafetensorsError)
    raw = first_bytes[: 8 + hlen]
    if len(raw) < 8 + hlen:
        raw = raw + read_more(len(raw), 8 + hlen)
    parsed = validate_header(file, raw, file_size, error=SourceSafetensorsError)
    base = parsed.data_start
    return {
        e.name: TensorInfo(e.name, file, e.dtype, e.shape, base + e.begin, base + e.end)
        for e in parsed.tensors.values()
    }


def tensor_from_bytes(info: TensorInfo, data: bytes) -> torch.Tensor:
    if len(data) != info.nbytes:
        raise ConversionError(
            f"{info.file}: tensor {info.name}: got {len(data)} bytes, expected {info.nbytes}"
        )
    dtype = DTYPES[info.dtype]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(info.shape)


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, each byte once, without holding them all in memory.

    The data is written straight into the final file after a reserved header region
    (`reserve_header_bytes`); `finish()` writes the real header into it, padded with spaces (valid
    JSON whitespace, as safetensors itself pads to 8 bytes). Tensors whose byte size is a multiple of
    8 are written in arrival order, so every one starts 8-byte aligned; the rare others go to a
    small side file appended at the end, sorted by decreasing element size (so each is aligned to
    its element size). Writes run on one background thread (file writes release the GIL) with at
    most `max_pending_bytes` queued. If the header outgrows the reservation, `finish()` falls back
    to rewriting the file once with a larger header.
    """

    def __init__(
        self,
        path: Path,
        metadata: dict[str, str] | None = None,
        *,
        reserve_header_bytes: int = DEFAULT_HEADER_RESERVE,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        self.path = path
        self.scratch = path.with_name(path.name + ".tail")
        self.metadata = metadata or {"format": "pt"}
        self.sha256 = ""  # of the finished file
        self.size = 0
        self._reserve = 8 + reserve_header_bytes + (-reserve_header_bytes % 8)
        self._f = path.open("wb")
        self._f.seek(self._reserve)
        self._tail: BinaryIO | None = None
        # name -> (dtype, shape, offset, length, in_tail)
        self._entries: dict[str, tuple[str, list[int], int, int, bool]] = {}
        self._offset = 0
        self._tail_offset = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-st-writer")
        self._pending: deque[tuple[Future[None], int]] = deque()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        # reserved tensors written in slices: name -> (slice shape, slice bytes, slices not yet written)
        self._reserved: dict[str, tuple[tuple[int, ...], int, set[int]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ConversionError(f"tensor {name} written twice to {self.path.name}")
        t = tensor.detach().contiguous().cpu()
        if t.dtype not in DTYPE_NAMES:
            raise ConversionError(f"tensor {name}: dtype {t.dtype} cannot be stored in safetensors")
        length = t.numel() * t.element_size()
        off, in_tail = self._place(length)
        self._entries[name] = (DTYPE_NAMES[t.dtype], list(t.shape), off, length, in_tail)
        if not length:
            return
        data = t.reshape(-1).view(torch.uint8).numpy()  # a view: no copy of the tensor's bytes
        out = self._tail if in_tail else self._f
        assert out is not None
        self._pending.append((self._pool.submit(out.write, data), length))
        self._pending_bytes += length
        while self._pending_bytes > self._max_pending:
            self._wait_one()

    def reserve(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Make room for a tensor that arrives in slices along its first dimension (`write_slice`),
        e.g. an expert group stacked expert by expert: no slice needs to be held until the rest exist."""
        if name in self._entries:
            raise ConversionError(f"tensor {name} written twice to {self.path.name}")
        if dtype not in DTYPE_NAMES or not shape or shape[0] < 1:
            raise ConversionError(f"tensor {name}: cannot reserve {dtype} {shape}")
        slice_bytes = math.prod(shape[1:]) * dtype.itemsize
        length = shape[0] * slice_bytes
        off, in_tail = self._place(length)
        self._entries[name] = (DTYPE_NAMES[dtype], list(shape), off, length, in_tail)
        self._reserved[name] = (tuple(shape[1:]), slice_bytes, set(range(shape[0])))
        out = self._tail if in_tail else self._f
        assert out is not None
        self._pending.append((self._pool.submit(out.seek, length, os.SEEK_CUR), 0))  # later writes skip it

    def _place(self, length: int) -> tuple[int, bool]:
        """Room for `length` bytes: (offset, in the scratch tail). A length not a multiple of 8 goes to
        the tail, moved after every aligned tensor at `finish`, so the aligned ones stay aligned."""
        if length % 8:
            if self._tail is None:
                self._tail = self.scratch.open("w+b")
            off, self._tail_offset = self._tail_offset, self._tail_offset + length
            return off, True
        off, self._offset = self._offset, self._offset + length
        return off, False

    def write_slice(self, name: str, index: int, tensor: torch.Tensor) -> None:
        """Write slice `index` of a tensor made room for with `reserve`."""
        self.write_slices(name, index, tensor[None])

    def write_slices(self, name: str, first: int, tensor: torch.Tensor) -> None:
        """Write slices first, first + 1, ... (`tensor`'s first dimension) of a tensor made room for
        with `reserve`, in one write."""
        shape, slice_bytes, missing = self._reserved[name]
        dtype, _, off, _, in_tail = self._entries[name]
        t = tensor.detach().contiguous().cpu()
        indices = range(first, first + (t.shape[0] if t.dim() else 0))
        unwritten = all(i in missing for i in indices)
        if tuple(t.shape[1:]) != shape or DTYPE_NAMES.get(t.dtype) != dtype or not unwritten:
            raise ConversionError(
                f"tensor {name}: slices from {first} are {tuple(t.shape)} {t.dtype}, expected (n, *{shape}) "
                f"{dtype}" + ("" if unwritten else " (written twice or out of range)")
            )
        missing.difference_update(indices)
        out = self._tail if in_tail else self._f
        assert out is not None
        pos = (0 if in_tail else self._reserve) + off + first * slice_bytes
        data = t.reshape(-1).view(torch.uint8).numpy()
        self._pending.append((self._pool.submit(os.pwrite, out.fileno(), data, pos), data.nbytes))
        self._pending_bytes += data.nbytes
        while self._pending_bytes > self._max_pending:
            self._wait_one()

    def _wait_one(self) -> None:
        fut, length = self._pending.popleft()
        self._pending_bytes -= length
        fut.result()

    def _drain(self) -> None:
        while self._pending:
            self._wait_one()

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def _header(self) -> tuple[bytes, list[tuple[int, int]]]:
        """Header JSON (unpadded) and the tail tensors' (scratch offset, length) in file order."""
        main = [(n, e) for n, e in self._entries.items() if not e[4]]
        tail = sorted(
            ((n, e) for n, e in self._entries.items() if e[4]),
            key=lambda item: (-DTYPES[item[1][0]].itemsize, item[0]),
        )
        header: dict[str, object] = {"__metadata__": self.metadata}
        for name, (dtype, shape, off, length, _) in main:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + length]}
        pos = self._offset
        for name, (dtype, shape, _off, length, _) in tail:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + length]}
            pos += length
        return json.dumps(header, separators=(",", ":")).encode(), [(e[2], e[3]) for _, e in tail]

    def finish(self) -> Path:
        try:
            self._drain()
        finally:
            self._pool.shutdown(wait=True)
        unwritten = {name: sorted(left)[:5] for name, (_, _, left) in self._reserved.items() if left}
        if unwritten:
            raise ConversionError(f"{self.path.name}: reserved tensors never fully written: {unwritten}")
        hbytes, tail = self._header()
        if self._tail is not None:
            self._tail.flush()
            self._f.seek(self._reserve + self._offset)
            for off, length in tail:
                _copy_range(self._tail, self._f, off, length, self.path.name)
            self._tail.close()
            self.scratch.unlink()
        self._f.close()
        if 8 + len(hbytes) > self._reserve:
            log.info(
                "%s: header (%d bytes) outgrew its reservation; rewriting once", self.path.name, len(hbytes)
            )
            self._grow_header(8 + len(hbytes) + (-len(hbytes) % 8))
        hbytes += b" " * (self._reserve - 8 - len(hbytes))
        with self.path.open("r+b") as f:
            f.write(struct.pack("<Q", len(hbytes)))
            f.write(hbytes)
        self.size, self.sha256 = hash_file(self.path)
        return self.path

    def _grow_header(self, reserve: int) -> None:
        moved = self.path.with_name(self.path.name + ".old")
        self.path.replace(moved)
        with moved.open("rb") as src, self.path.open("wb") as out:
            out.seek(reserve)
            size = moved.stat().st_size - self._reserve
            _copy_range(src, out, self._reserve, size, self.path.name)
        moved.unlink()
        self._reserve = reserve

    def moved_to(self, directory: Path) -> None:
        """The directory holding the (open) files was renamed to `directory`."""
        self.path = directory / self.path.name
        self.scratch = directory / self.scratch.name

    def discard(self) -> None:
        for fut, _ in self._pending:
            fut.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
        for f in (self._f, self._tail):
            if f is not None and not f.closed:
                f.close()
        self.scratch.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


def _copy_range(src: BinaryIO, out: BinaryIO, start: int, length: int, what: str) -> None:
    src.seek(start)
    left = length
    while left:
        block = src.read(min(COPY_CHUNK, left))
        if not block:
            raise ConversionError(f"scratch data for {what} is truncated")
        out.write(block)
        left -= len(block)


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read in large blocks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(COPY_CHUNK)
    view = memoryview(buf)
    size = 0
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):  # type: ignore[attr-defined]
            h.update(view[:n])
            size += n
    return size, h.hexdigest()
