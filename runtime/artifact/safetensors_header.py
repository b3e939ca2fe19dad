"""Strict validation of safetensors headers: the converter's source reader and the runtime loader
both parse untrusted headers through `validate_header`, so a hostile or corrupt file is refused with
a `SafetensorsFormatError` naming the file and tensor, never an IndexError / RuntimeError later.

Rules (those of the safetensors library, plus tensor-name hygiene): an 8-byte little-endian header
length that fits in the file and is at most 100 MB; a UTF-8 JSON object without duplicate keys;
`__metadata__`, if present, a str -> str map; per tensor a known dtype, a shape of non-negative
integers and `data_offsets` [begin, end] with end - begin == prod(shape) * itemsize; the tensors,
sorted by offset, cover the data region exactly (no overlap, no gap, nothing past the end).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from kernels.errors import LayoutError

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
# safetensors dtype name -> torch dtype (the one table every reader and writer uses)
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
DTYPE_SIZES: dict[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}
FIX_HINT = "re-export the checkpoint with safetensors.torch.save_file (or save_pretrained)"
_FORBIDDEN_NAME_CHARS = ("\0", "/", "\\")


class SafetensorsFormatError(LayoutError):
    """A safetensors file is malformed: its header or offsets break the format's rules."""


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset relative to the start of the data region
    end: int


@dataclass(frozen=True)
class ParsedHeader:
    header_len: int  # the JSON part, excluding the 8-byte length prefix
    metadata: dict[str, str]
    tensors: dict[str, HeaderEntry]  # in header order

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def header_length(
    file: str, first8: bytes, file_size: int | None, *, error: type[SafetensorsFormatError]
) -> int:
    """The JSON header's length from the first 8 bytes, checked against the cap and the file size."""
    if len(first8) < 8 or (file_size is not None and file_size < 8):
        raise error(f"{file}: too short to be a safetensors file (no 8-byte header length); {FIX_HINT}")
    (hlen,) = struct.unpack("<Q", first8[:8])
    if hlen > MAX_HEADER_BYTES:
        raise error(
            f"{file}: safetensors header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit "
            f"(corrupt or hostile file); {FIX_HINT}"
        )
    if file_size is not None and 8 + hlen > file_size:
        raise error(
            f"{file}: safetensors header length {hlen} runs past the end of the {file_size}-byte file "
            f"(truncated?); {FIX_HINT}"
        )
    return hlen


def _no_duplicates(file: str, error: type[SafetensorsFormatError]) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{file}: duplicate key {key!r} in the safetensors header; {FIX_HINT}")
            out[key] = value
        return out

    return hook


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_header(
    file: str,
    header_bytes: bytes,
    file_size: int | None,
    *,
    error: type[SafetensorsFormatError] = SafetensorsFormatError,
) -> ParsedHeader:
    """Validate a whole header: `header_bytes` is the file's first 8 + hlen bytes (or more).

    `file_size` None (unknown) skips the checks against the end of the file; `error` lets a caller
    raise a subclass that also belongs to its own error family.
    """
    hlen = header_length(file, header_bytes[:8], file_size, error=error)
    raw = header_bytes[8 : 8 + hlen]
    if len(raw) < hlen:
        raise error(f"{file}: safetensors header is cut short ({len(raw)} of {hlen} bytes); {FIX_HINT}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{file}: safetensors header is not UTF-8 ({e}); {FIX_HINT}") from e
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates(file, error))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integer literals, deep nesting
        if isinstance(e, SafetensorsFormatError):
            raise
        raise error(f"{file}: safetensors header is not valid JSON ({str(e)[:200]}); {FIX_HINT}") from e
    if not isinstance(header, dict):
        kind = type(header).__name__
        raise error(f"{file}: safetensors header must be a JSON object, got {kind}; {FIX_HINT}")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise error(f"{file}: __metadata__ must map strings to strings; {FIX_HINT}")
    tensors = {name: _entry(file, name, meta, error) for name, meta in header.items()}
    _check_coverage(file, tensors, None if file_size is None else file_size - 8 - hlen, error)
    return ParsedHeader(hlen, metadata, tensors)


def _entry(file: str, name: str, meta: object, error: type[SafetensorsFormatError]) -> HeaderEntry:
    where = f"{file}: tensor {name!r}"
    if not name or any(c in name for c in _FORBIDDEN_NAME_CHARS):
        raise error(f"{where}: tensor names must be non-empty without NUL, '/' or '\\'; {FIX_HINT}")
    if not isinstance(meta, dict):
        raise error(f"{where}: entry must be an object with dtype, shape, data_offsets; {FIX_HINT}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in meta]
    if missing:
        raise error(f"{where}: entry lacks {', '.join(missing)}; {FIX_HINT}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise error(
            f"{where}: unknown or unsupported dtype {dtype!r} "
            f"(supported: {', '.join(DTYPE_SIZES)}); {FIX_HINT}"
        )
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise error(f"{where}: shape must be a list of integers, got {shape!r}; {FIX_HINT}")
    if any(d < 0 for d in shape):
        raise error(f"{where}: shape {shape} has a negative dimension; {FIX_HINT}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise error(f"{where}: data_offsets must be [begin, end] integers, got {offsets!r}; {FIX_HINT}")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise error(
            f"{where}: data_offsets {offsets} are negative or unsorted (end before begin); {FIX_HINT}"
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise error(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes but shape {shape} x {dtype} "
            f"needs {expected}; {FIX_HINT}"
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


def _check_coverage(
    file: str, tensors: dict[str, HeaderEntry], data_len: int | None, error: type[SafetensorsFormatError]
) -> None:
    pos, prev = 0, None
    for e in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if data_len is not None and e.end > data_len:
            raise error(
                f"{file}: tensor {e.name!r} data_offsets end at {e.end}, past the {data_len}-byte data "
                f"region (truncated file?); {FIX_HINT}"
            )
        if e.begin < pos:
            raise error(
                f"{file}: tensor {e.name!r} (bytes {e.begin}..{e.end}) overlaps tensor {prev!r} "
                f"(ends at {pos}); {FIX_HINT}"
            )
        if e.begin > pos:
            raise error(
                f"{file}: gap of {e.begin - pos} bytes before tensor {e.name!r} (bytes {e.begin}..{e.end}); "
                f"{FIX_HINT}"
            )
        pos, prev = e.end, e.name
    if data_len is not None and pos != data_len:
        what = f"tensor {prev!r} ends at {pos}" if prev is not None else "no tensor data"
        raise error(
            f"{file}: {what} but the data region holds {data_len} bytes "
            f"({'truncated file' if pos > data_len else 'trailing bytes'}); {FIX_HINT}"
        )
