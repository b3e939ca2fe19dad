"""A strict, streaming reader of a GGUF file's header: its metadata and its tensor index.

GGUF (llama.cpp's single-file format) is little-endian:

    u32 magic "GGUF" | u32 version (2 or 3) | u64 tensor_count | u64 kv_count
    kv_count x     { string key | u32 value_type | value }        string: u64 byte length + UTF-8
    tensor_count x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
    padding to `general.alignment` (a u32, default 32): the data section starts there

A value is a scalar (u8 i8 u16 i16 u32 i32 f32 bool string u64 i64 f64: types 0-8 and 10-12) or an
array (type 9: u32 element type, u64 length, the elements). `ne[0]` is the innermost axis, so a
tensor's torch-order shape is reversed(ne); its prod(ne) / block_size * type_size bytes
(kernels/codecs/gguf.py GGML_TYPES) lie at data_start + offset.

The header is read like a safetensors header (services/convert/safetensors_io.py): from a probe of
the file's first bytes, then by ranged reads as parsing moves on (a tokenizer's vocabulary makes a
header several MB), so a file on S3 is never downloaded whole; tensor bytes are read later, by
offset. Every size the file controls is checked against the bytes present and against the caps
below before it costs work or memory, and every defect raises `GgufFormatError` naming the file,
the field, what was found and what to do.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernels.codecs.gguf import GGML_TYPES, ggml_type_name
from services.convert.errors import ConversionError
from services.storage.base import SourceReader

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
PREAMBLE_BYTES = 24  # magic, version, tensor count, key count

GGUF_PROBE_BYTES = 1 << 20  # what open_gguf reads first
MIN_READ_BYTES = 64 << 10
MAX_READ_BYTES = 16 << 20  # the ranged reads after the probe double in size up to this

# Caps on what a file may claim (SmolLM2-135M's whole header: 1.8 MB, 1.77 of them its vocabulary).
MAX_METADATA_BYTES = 64 << 20  # the key/value section
MAX_TENSOR_INFO_BYTES = 32 << 20  # the tensor index (~60 bytes a tensor)
MAX_STRING_BYTES = 16 << 20  # one string value (the longest real ones, chat templates: tens of KB)
MAX_NAME_BYTES = 1 << 10  # a key or a tensor name (llama.cpp refuses tensor names over 63 bytes)
# Array elements in the whole metadata: a 262k-token vocabulary with its scores and types holds 786k.
MAX_ARRAY_VALUES = 1 << 22
MAX_KV_COUNT = 1 << 16
MAX_TENSOR_COUNT = 1 << 18
MAX_DIMS = 4  # GGML_MAX_DIMS

UINT32, BOOL, STRING, ARRAY = 4, 7, 8, 9
# Fixed-size value types: struct code and byte size.
SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
    7: ("B", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}  # fmt: skip
VALUE_TYPE_NAMES = {
    0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string",
    9: "array", 10: "u64", 11: "i64", 12: "f64",
}  # fmt: skip
MIN_KV_BYTES = 8 + 1 + 4 + 1  # a one-byte key and a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # a one-byte name, one dimension

REEXPORT = "re-download the file, or re-export it with llama.cpp's convert_hf_to_gguf.py"
OVER_CAP = "a real model's GGUF stays far below it: re-download the file or re-export it"
# ggml type id -> (values per block, bytes per block): the types Kiln knows are the gguf package's.
QUANT_SIZES: dict[int, tuple[int, int]] = {t.id: (t.block_size, t.type_size) for t in GGML_TYPES.values()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

MetadataValue = int | float | bool | str | list[Any]


class GgufFormatError(ConversionError):
    """A GGUF file is malformed, truncated, or claims more than one of Kiln's caps allows."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    ggml_type: int  # an id of kernels.codecs.gguf.GGML_TYPES
    shape: tuple[int, ...]  # torch order: reversed(ne)
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


@dataclass(frozen=True)
class GgufFile:
    version: int
    metadata: dict[str, MetadataValue]  # file order; arrays as lists
    tensors: dict[str, GgufTensor]  # file order
    alignment: int
    data_start: int
    # key -> (value type,), or (ARRAY, element type) for an array
    value_types: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class _Header:
    """The header bytes read so far and the parse position, grown by ranged reads on demand."""

    def __init__(self, file: str, probe: bytes, more: Callable[[int, int], bytes], size: int) -> None:
        self.file = file
        self.size = size
        self.more = more
        self.data = bytearray(probe[:size])
        self.pos = 0
        self.limit = size  # the current section ends here (its cap, or the end of the file)
        self.section = ("header", size)
        self.values_left = MAX_ARRAY_VALUES

    def error(self, where: str, problem: str, advice: str = REEXPORT) -> GgufFormatError:
        return GgufFormatError(f"{self.file}: {where}: {problem}; {advice}")

    def enter(self, section: str, cap: int) -> None:
        """What follows is `section`, refused past `cap` bytes."""
        self.section = (section, cap)
        self.limit = min(self.size, self.pos + cap)

    def room(self, n: int, what: str) -> None:
        """Refuse `n` bytes at the parse position that pass the end of the file or the section's cap."""
        if self.pos + n <= self.limit:
            return
        if self.pos + n > self.size:
            raise self.error(
                what,
                f"needs {n} bytes from byte {self.pos}, but the file ends at byte {self.size}: "
                "it is truncated or corrupt",
            )
        section, cap = self.section
        raise self.error(what, f"takes the {section} past Kiln's {cap}-byte limit", OVER_CAP)

    def take(self, n: int, what: str) -> int:
        """Move past `n` bytes; returns where they start in `data`."""
        self.room(n, what)
        start = self.pos
        self.pos += n
        if self.pos > len(self.data):
            self._fetch(self.pos)
        return start

    def _fetch(self, end: int) -> None:
        have = len(self.data)
        ahead = min(max(have, MIN_READ_BYTES), MAX_READ_BYTES)
        want = min(self.size, max(end, have + ahead))
        got = self.more(have, want)
        if len(got) != want - have:
            raise self.error(
                f"bytes {have}-{want}", f"reading them returned {len(got)} bytes: the file is truncated"
            )
        self.data += got

    def unpack(self, fmt: str, n: int, what: str) -> tuple[Any, ...]:
        return struct.unpack_from(fmt, self.data, self.take(n, what))

    def u32(self, what: str) -> int:
        return int(_U32.unpack_from(self.data, self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack_from(self.data, self.take(8, what))[0])

    def string(self, what: str, cap: int) -> str:
        n = self.u64(what)
        if n > cap:
            raise self.error(what, f"claims a length of {n} bytes, over Kiln's {cap}-byte limit", OVER_CAP)
        start = self.take(n, what)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(what, f"is not valid UTF-8 (byte {start + e.start} of the file)") from None


def parse_gguf(file: str, probe: bytes, more: Callable[[int, int], bytes], size: int) -> GgufFile:
    """Metadata and tensor index of one GGUF file of `size` bytes, strictly validated.

    `probe` holds the file's first bytes; `more(start, end)` returns bytes [start, end) when the
    header is longer. Tensor data is not read. Any defect raises GgufFormatError.
    """
    h = _Header(file, probe, more, size)
    version, n_tensors, n_kv = _read_preamble(h)
    metadata, types = _read_metadata(h, n_kv)
    alignment = _alignment(h, metadata, types)
    infos = _read_tensor_infos(h, n_tensors, alignment)
    data_start = -(-h.pos // alignment) * alignment
    return GgufFile(version, metadata, _place(h, infos, data_start), alignment, data_start, types)


def open_gguf(source: SourceReader, name: str) -> GgufFile:
    """Parse the header of GGUF file `name` of a source with ranged reads (local or S3 alike)."""
    size = source.size(name)
    probe = source.read_range(name, 0, min(size, GGUF_PROBE_BYTES))

    def more(start: int, end: int) -> bytes:
        return source.read_range(name, start, end)

    return parse_gguf(name, probe, more, size)


def _read_preamble(h: _Header) -> tuple[int, int, int]:
    """(version, tensor count, key count), each checked."""
    h.take(4, "the GGUF magic number")
    if h.data[:4] != GGUF_MAGIC:
        raise h.error(
            "header",
            f"starts with {bytes(h.data[:4])!r}, not {GGUF_MAGIC!r}: this is not a GGUF file",
            "check that the file is a .gguf model, or re-download it",
        )
    version = h.u32("the GGUF version")
    if version & 0xFFFF == 0 and version:
        raise h.error(
            "header",
            f"version field 0x{version:08x} is a big-endian GGUF file; Kiln reads little-endian GGUF only",
            "use the little-endian release of the model, or re-export it without --bigendian",
        )
    if version not in SUPPORTED_VERSIONS:
        raise h.error(
            "header",
            f"GGUF version {version}; Kiln reads versions {' and '.join(map(str, SUPPORTED_VERSIONS))}",
            "re-export the model with a current llama.cpp convert_hf_to_gguf.py",
        )
    n_tensors = h.u64("the tensor count")
    n_kv = h.u64("the metadata key count")
    for what, count, cap in (("tensors", n_tensors, MAX_TENSOR_COUNT), ("metadata keys", n_kv, MAX_KV_COUNT)):
        if count > cap:
            raise h.error("header", f"claims {count} {what}, over Kiln's limit of {cap}", OVER_CAP)
    if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > h.size - PREAMBLE_BYTES:
        raise h.error(
            "header",
            f"claims {n_kv} metadata keys and {n_tensors} tensors, more than the file's {h.size} bytes "
            "can hold: it is truncated or corrupt",
        )
    return version, n_tensors, n_kv


def _read_metadata(h: _Header, count: int) -> tuple[dict[str, MetadataValue], dict[str, tuple[int, ...]]]:
    h.enter("metadata", MAX_METADATA_BYTES)
    metadata: dict[str, MetadataValue] = {}
    types: dict[str, tuple[int, ...]] = {}
    for i in range(count):
        key = h.string(f"metadata key #{i}", MAX_NAME_BYTES)
        where = f"metadata key {key!r}"
        if not key:
            raise h.error(f"metadata key #{i}", "is empty")
        if key in metadata:
            raise h.error(where, "appears twice")
        vtype = h.u32(f"{where} (its value type)")
        if vtype == ARRAY:
            elem = h.u32(f"{where} (its array element type)")
            length = h.u64(f"{where} (its array length)")
            metadata[key], types[key] = _read_array(h, where, elem, length), (ARRAY, elem)
        else:
            metadata[key], types[key] = _read_scalar(h, where, vtype), (vtype,)
    return metadata, types


def _read_scalar(h: _Header, where: str, vtype: int) -> MetadataValue:
    if vtype == STRING:
        return h.string(where, MAX_STRING_BYTES)
    if vtype not in SCALARS:
        raise h.error(where, f"value type {vtype} is not a GGUF value type (0-12)")
    code, width = SCALARS[vtype]
    value = h.unpack("<" + code, width, where)[0]
    if vtype == BOOL and value > 1:
        raise h.error(where, f"bool value is {value}, not 0 or 1")
    return bool(value) if vtype == BOOL else value


def _read_array(h: _Header, where: str, elem: int, length: int) -> list[Any]:
    if elem == ARRAY:
        raise h.error(where, "is an array of arrays, which GGUF readers (llama.cpp's gguf.cpp) refuse")
    if elem != STRING and elem not in SCALARS:
        raise h.error(where, f"array element type {elem} is not a GGUF value type (0-8, 10-12)")
    if length > h.values_left:
        raise h.error(
            where,
            f"an array of {length} elements takes the metadata past Kiln's limit of {MAX_ARRAY_VALUES} "
            "array elements in all",
            OVER_CAP,
        )
    h.values_left -= length
    code, width = SCALARS.get(elem, ("", 8))  # a string takes 8 bytes at least: its length
    h.room(length * width, f"{where} (an array of {length} {VALUE_TYPE_NAMES[elem]})")
    if elem == STRING:
        return [h.string(f"{where}[{i}]", MAX_STRING_BYTES) for i in range(length)]
    values = list(struct.unpack_from(f"<{length}{code}", h.data, h.take(length * width, where)))
    if elem == BOOL:
        bad = next((i for i, v in enumerate(values) if v > 1), None)
        if bad is not None:
            raise h.error(f"{where}[{bad}]", f"bool value is {values[bad]}, not 0 or 1")
        return [v == 1 for v in values]
    return values


def _alignment(h: _Header, metadata: dict[str, MetadataValue], types: dict[str, tuple[int, ...]]) -> int:
    if ALIGNMENT_KEY not in metadata:
        return DEFAULT_ALIGNMENT
    vtype = types[ALIGNMENT_KEY]
    where = f"metadata key {ALIGNMENT_KEY!r}"
    if vtype != (UINT32,):
        found = " of ".join(VALUE_TYPE_NAMES.get(t, str(t)) for t in vtype)
        raise h.error(where, f"has type {found}; GGUF requires u32")
    value = metadata[ALIGNMENT_KEY]
    assert isinstance(value, int)
    if value == 0 or value & (value - 1):
        raise h.error(where, f"is {value}, not a power of two")
    return value


def _read_tensor_infos(h: _Header, count: int, alignment: int) -> list[_TensorInfo]:
    h.enter("tensor index", MAX_TENSOR_INFO_BYTES)
    infos: list[_TensorInfo] = []
    seen: set[str] = set()
    for i in range(count):
        name = h.string(f"tensor #{i}'s name", MAX_NAME_BYTES)
        where = f"tensor {name!r}"
        if not name:
            raise h.error(f"tensor #{i}", "has an empty name")
        if name in seen:
            raise h.error(where, "appears twice")
        seen.add(name)
        n_dims = h.u32(f"{where} (its number of dimensions)")
        if not 1 <= n_dims <= MAX_DIMS:
            raise h.error(where, f"has {n_dims} dimensions; a GGUF tensor has 1 to {MAX_DIMS}")
        ne = h.unpack(f"<{n_dims}Q", 8 * n_dims, f"{where} (its shape)")
        ggml_type = h.u32(f"{where} (its ggml type)")
        offset = h.u64(f"{where} (its data offset)")
        nbytes = _tensor_bytes(h, where, ne, ggml_type)
        if offset % alignment:
            raise h.error(
                where, f"data offset {offset} is not a multiple of the file's alignment {alignment}"
            )
        infos.append(_TensorInfo(name, ne, ggml_type, offset, nbytes))
    return infos


def _tensor_bytes(h: _Header, where: str, ne: tuple[int, ...], ggml_type: int) -> int:
    if not all(ne):
        raise h.error(where, f"has a zero dimension (ne = {list(ne)})")
    sizes = QUANT_SIZES.get(ggml_type)
    if sizes is None:
        raise h.error(
            where,
            f"ggml type {ggml_type} is none of the {len(QUANT_SIZES)} GGML types Kiln knows "
            "(a removed or a newer quantization)",
            "re-export the model with a quantization type llama.cpp currently supports",
        )
    block, type_size = sizes
    if ne[0] % block:
        name = ggml_type_name(ggml_type)
        raise h.error(
            where, f"is {name} with rows of {ne[0]} values, not a multiple of its {block}-value block"
        )
    return math.prod(ne) // block * type_size


def _place(h: _Header, infos: list[_TensorInfo], data_start: int) -> dict[str, GgufTensor]:
    """Each tensor at its absolute offsets, inside the file and overlapping no other."""
    tensors: dict[str, GgufTensor] = {}
    for info in infos:
        start, end = data_start + info.offset, data_start + info.offset + info.nbytes
        where = f"tensor {info.name!r}"
        if start >= h.size:
            raise h.error(
                where,
                f"data offset {info.offset} puts it at byte {start}, past the end of the file "
                f"({h.size} bytes): the file is truncated or the offset corrupt",
            )
        if end > h.size:
            raise h.error(
                where,
                f"its {info.nbytes} bytes at {start}-{end} run past the end of the file ({h.size} bytes): "
                "the file is truncated",
            )
        tensors[info.name] = GgufTensor(info.name, info.ggml_type, tuple(reversed(info.ne)), start, end)
    ordered = sorted(tensors.values(), key=lambda t: t.start)
    for a, b in itertools.pairwise(ordered):
        if b.start < a.end:
            raise h.error(
                f"tensor {b.name!r}",
                f"its bytes {b.start}-{b.end} overlap tensor {a.name!r}'s ({a.start}-{a.end})",
            )
    return tensors
