"""safetensors reading by byte ranges and a streaming writer with bounded memory.

Reading: the header (8-byte little-endian length + JSON) is parsed from the first bytes of a file,
so an S3 source is read with ranged GETs; local files are memory-mapped with `safe_open` per layer.

Writing: `StreamingSafetensorsWriter` appends each tensor's bytes to a scratch file as it is
produced and assembles the final file in `finish()` (header, then tensors sorted by decreasing
element size so every tensor starts aligned to its element size, copied in chunks).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.convert.errors import ConversionError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
MAX_HEADER_BYTES = 100 << 20
COPY_CHUNK = 8 << 20


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
    file: str, first_bytes: bytes, read_more: Callable[[int, int], bytes]
) -> dict[str, TensorInfo]:
    """Tensor index of one safetensors file. `read_more(start, end)` fetches more bytes if needed."""
    if len(first_bytes) < 8:
        raise ConversionError(f"{file}: too short to be a safetensors file")
    (hlen,) = struct.unpack("<Q", first_bytes[:8])
    if hlen > MAX_HEADER_BYTES:
        raise ConversionError(f"{file}: safetensors header of {hlen} bytes is implausible (corrupt file?)")
    raw = first_bytes[8 : 8 + hlen]
    if len(raw) < hlen:
        raw = raw + read_more(8 + len(raw), 8 + hlen)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{file}: unreadable safetensors header ({e})") from e
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise ConversionError(f"{file}: tensor {name} has unsupported dtype {meta['dtype']}")
        s, e = meta["data_offsets"]
        out[name] = TensorInfo(name, file, meta["dtype"], tuple(meta["shape"]), base + s, base + e)
    return out


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
    """Write a safetensors file tensor by tensor without holding them all in memory."""

    def __init__(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.scratch = path.with_name(path.name + ".data")
        self._f = self.scratch.open("wb")
        self._entries: dict[str, tuple[str, list[int], int, int]] = {}  # name -> dtype, shape, off, len
        self._offset = 0
        self.metadata = metadata or {"format": "pt"}
        self.sha256 = ""  # of the finished file
        self.size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ConversionError(f"tensor {name} written twice to {self.path.name}")
        t = tensor.detach().contiguous().cpu()
        if t.dtype not in DTYPE_NAMES:
            raise ConversionError(f"tensor {name}: dtype {t.dtype} cannot be stored in safetensors")
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self._f.write(data)
        self._entries[name] = (DTYPE_NAMES[t.dtype], list(t.shape), self._offset, len(data))
        self._offset += len(data)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def finish(self) -> Path:
        self._f.close()

        def sort_key(item: tuple[str, tuple[str, list[int], int, int]]) -> tuple[int, str]:
            return (-DTYPES[item[1][0]].itemsize, item[0])

        ordered = sorted(self._entries.items(), key=sort_key)
        header: dict[str, object] = {"__metadata__": self.metadata}
        pos = 0
        for name, (dtype, shape, _off, length) in ordered:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + length]}
            pos += length
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        hbytes += b" " * (-len(hbytes) % 8)
        h = hashlib.sha256()
        with self.path.open("wb") as out, self.scratch.open("rb") as src:
            for block in (struct.pack("<Q", len(hbytes)), hbytes):
                out.write(block)
                h.update(block)
            for _name, (_dtype, _shape, off, length) in ordered:
                src.seek(off)
                left = length
                while left:
                    block = src.read(min(COPY_CHUNK, left))
                    if not block:
                        raise ConversionError(f"scratch file for {self.path.name} is truncated")
                    out.write(block)
                    h.update(block)
                    left -= len(block)
            self.size = out.tell()
        self.sha256 = h.hexdigest()
        self.scratch.unlink()
        return self.path

    def discard(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.scratch.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
