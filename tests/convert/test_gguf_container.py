"""The GGUF container parser (services/convert/gguf/container.py): files written by the gguf package's
GGUFWriter and SmolLM2's real GGUF read exactly as gguf.GGUFReader reads them, the header by a few
ranged reads; every malformed or hostile header refused with GgufFormatError naming the file, the
field, what was found and what to do. (Random mutations: tests/reliability/test_fuzz.py.)"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools.builders.smollm2 import CheckpointUnavailable, gguf_file
from services.convert.errors import ConversionError
from services.convert.gguf import container
from services.convert.gguf.container import (
    GGUF_PROBE_BYTES,
    MAX_ARRAY_VALUES,
    MAX_KV_COUNT,
    MAX_NAME_BYTES,
    MAX_STRING_BYTES,
    MAX_TENSOR_COUNT,
    GgufFile,
    GgufFormatError,
    open_gguf,
    parse_gguf,
)
from services.storage.local import LocalSource
from tests.reliability.fuzz_targets import gguf_reader_view, gguf_view, write_sample_gguf

Reads = list[tuple[int, int]]
F32, Q8_0 = 0, 8
U32, I32, STR, ARR = 4, 5, 8, 9


def parse(blob: bytes, probe: int = GGUF_PROBE_BYTES, reads: Reads | None = None) -> GgufFile:
    def more(start: int, end: int) -> bytes:
        if reads is not None:
            reads.append((start, end))
        return blob[start:end]

    return parse_gguf("m.gguf", blob[:probe], more, len(blob))


# ---- files from GGUFWriter and a real model ------------------------------------------------------


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_writer_files_parse_as_gguf_reader_reads_them(tmp_path: Path, alignment: int | None) -> None:
    path = write_sample_gguf(tmp_path / "s.gguf", alignment=alignment)
    parsed = parse(path.read_bytes(), probe=100)
    assert gguf_view(parsed) == gguf_reader_view(path)
    assert parsed.alignment == (alignment or 32) and parsed.data_start % parsed.alignment == 0


def test_values_types_and_shapes(tmp_path: Path) -> None:
    parsed = parse(write_sample_gguf(tmp_path / "s.gguf").read_bytes())
    m, types = parsed.metadata, parsed.value_types
    assert (m["sample.u64"], m["sample.i8"], m["sample.bool"]) == (2**64 - 1, -100, True)
    assert m["sample.f32"] == struct.unpack("<f", struct.pack("<f", 0.1))[0] and m["sample.f64"] == 1e-300
    assert m["sample.string"] == "héllo ✓ <0x0A>" and m["sample.strings"] == ["<s>", "", "ünï", "Ġthe"]
    assert m["sample.bools"] == [True, False, True] and m["sample.u64s"] == [0, 2**64 - 1]
    assert types["sample.u8"] == (0,) and types["sample.strings"] == (ARR, STR)
    assert types["sample.i32s"] == (ARR, I32)
    embed, conv = parsed.tensors["token_embd.weight"], parsed.tensors["blk.0.conv.weight"]
    assert (embed.type_name, embed.shape, embed.nbytes) == ("Q8_0", (4, 64), 4 * 68)  # 34-byte blocks
    assert (conv.type_name, conv.shape, conv.nbytes) == ("F32", (2, 3, 4), 96)  # torch order: reversed(ne)
    assert next(iter(parsed.tensors)) == "token_embd.weight"  # file order


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return gguf_file()
    except CheckpointUnavailable as e:
        pytest.skip(str(e))


def test_smollm2_parses_as_gguf_reader_reads_it(smollm2: Path) -> None:
    blob = smollm2.read_bytes()
    parsed = parse(blob)
    reference = gguf_reader_view(smollm2)
    assert gguf_view(parsed) == reference
    tokens = parsed.metadata["tokenizer.ggml.tokens"]
    assert len(parsed.tensors) == 272 and isinstance(tokens, list) and len(tokens) == 49152
    assert max(t.end for t in parsed.tensors.values()) <= len(blob)


def test_smollm2_header_takes_a_few_ranged_reads_ending_near_it(smollm2: Path) -> None:
    """The header (~1.8 MB: a 49k-token vocabulary and its merges) after a 1 MiB probe, or after
    almost none: reads double in size, so they are few and end within twice the header's length,
    far from the end of the 98 MB file."""
    blob = smollm2.read_bytes()
    for probe, most in ((GGUF_PROBE_BYTES, 1), (4096, 6), (0, 7)):
        reads: Reads = []
        parsed = parse(blob, probe=probe, reads=reads)
        assert 0 < len(reads) <= most, (probe, reads)
        assert reads[0][0] == probe and all(b[0] == a[1] for a, b in itertools.pairwise(reads))
        assert max(end for _, end in reads) <= 2 * parsed.data_start < len(blob) // 20


def test_open_gguf_reads_a_source_by_ranges(tmp_path: Path) -> None:
    path = write_sample_gguf(tmp_path / "s.gguf")
    calls: Reads = []

    class Counting(LocalSource):
        def read_range(self, name: str, start: int, end: int) -> bytes:
            calls.append((start, end))
            return super().read_range(name, start, end)

    parsed = open_gguf(Counting(tmp_path), "s.gguf")
    assert gguf_view(parsed) == gguf_reader_view(path)
    assert calls == [(0, path.stat().st_size)]  # the probe holds this small file whole


# ---- malformed files -----------------------------------------------------------------------------


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def ti(name: str | bytes, ne: tuple[int, ...], ggml_type: int = F32, offset: int = 0) -> bytes:
    return s(name) + struct.pack(f"<I{len(ne)}Q", len(ne), *ne) + struct.pack("<IQ", ggml_type, offset)


ARCH = kv("general.architecture", STR, s("llama"))
TENSORS = (ti("a", (8,), F32, 0), ti("b", (32,), Q8_0, 32))
DATA = bytes(32 + 34)


def gguf_bytes(
    kvs: tuple[bytes, ...] = (ARCH,),
    tis: tuple[bytes, ...] = TENSORS,
    data: bytes = DATA,
    *,
    version: int = 3,
    counts: tuple[int, int] | None = None,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    """A GGUF file assembled by hand, defects included: (tensor, key) `counts` override the real ones."""
    n_tensors, n_kv = counts if counts is not None else (len(tis), len(kvs))
    head = magic + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(tis)
    return head + bytes(-len(head) % alignment) + data


def test_the_hand_built_file_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes())
    parsed = parse(path.read_bytes())
    assert gguf_view(parsed) == gguf_reader_view(path)
    assert [(t.start - parsed.data_start, t.nbytes) for t in parsed.tensors.values()] == [(0, 32), (32, 34)]


def align(value: int) -> bytes:
    return kv("general.alignment", U32, struct.pack("<I", value))


HUGE = 2**63
MALFORMED: dict[str, tuple[bytes, str]] = {
    "bad magic": (
        gguf_bytes(magic=b"GGML"),
        r"header: starts with b'GGML', not b'GGUF': this is not a GGUF file",
    ),
    "big-endian": (gguf_bytes(version=3 << 24), r"version field 0x03000000 is a big-endian GGUF file"),
    "version 1": (gguf_bytes(version=1), r"GGUF version 1; Kiln reads versions 2 and 3"),
    "version 4": (gguf_bytes(version=4), r"GGUF version 4"),
    "too many keys": (
        gguf_bytes(counts=(2, MAX_KV_COUNT + 1)),
        rf"claims {MAX_KV_COUNT + 1} metadata keys, over",
    ),
    "too many tensors": (
        gguf_bytes(counts=(HUGE, 1)),
        rf"claims {HUGE} tensors, over Kiln's limit of {MAX_TENSOR_COUNT}",
    ),
    "counts past the file": (
        gguf_bytes(counts=(2, 1000)),
        r"claims 1000 metadata keys and 2 tensors, more than",
    ),
    "unknown value type": (
        gguf_bytes((kv("x.y", 13, b"\0" * 8),)),
        r"key 'x.y': value type 13 is not a GGUF value",
    ),
    "unknown element type": (
        gguf_bytes((kv("x.y", ARR, struct.pack("<IQ", 99, 1) + b"\0" * 8),)),
        r"key 'x.y': array element type 99 is not a GGUF value type",
    ),
    "nested array": (
        gguf_bytes((kv("x.y", ARR, struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", U32, 0)),)),
        r"key 'x.y': is an array of arrays",
    ),
    "string length huge": (
        gguf_bytes((kv("x.y", STR, struct.pack("<Q", 2**64 - 1)),)),
        rf"key 'x.y': claims a length of {2**64 - 1} bytes, over Kiln's {MAX_STRING_BYTES}-byte limit",
    ),
    "string past the end": (
        gguf_bytes((kv("x.y", STR, struct.pack("<Q", 5000)),)),
        r"key 'x.y': needs 5000 bytes from byte \d+, but the file ends at byte \d+: it is truncated",
    ),
    "key length huge": (
        gguf_bytes((struct.pack("<Q", HUGE) + b"k",)),
        rf"metadata key #0: claims a length of {HUGE} bytes, over Kiln's {MAX_NAME_BYTES}-byte limit",
    ),
    "array length huge": (
        gguf_bytes((kv("x.y", ARR, struct.pack("<IQ", U32, HUGE)),)),
        rf"key 'x.y': an array of {HUGE} elements takes the metadata past Kiln's limit of {MAX_ARRAY_VALUES}",
    ),
    "array past the end": (
        gguf_bytes((kv("x.y", ARR, struct.pack("<IQ", STR, 1000)),)),
        r"key 'x.y' \(an array of 1000 string\): needs 8000 bytes .* truncated",
    ),
    "duplicate key": (gguf_bytes((ARCH, ARCH)), r"key 'general.architecture': appears twice"),
    "empty key": (gguf_bytes((kv("", U32, bytes(4)),)), r"metadata key #0: is empty"),
    "bad UTF-8 key": (
        gguf_bytes((kv(b"x\xff", U32, bytes(4)),)),
        r"metadata key #0: is not valid UTF-8 \(byte 33 ",
    ),
    "bad UTF-8 value": (gguf_bytes((kv("x.y", STR, s(b"\xc3(")),)), r"key 'x.y': is not valid UTF-8"),
    "bool 2": (gguf_bytes((kv("x.y", 7, b"\x02"),)), r"key 'x.y': bool value is 2, not 0 or 1"),
    "bool array 5": (
        gguf_bytes((kv("x.y", ARR, struct.pack("<IQ", 7, 3) + b"\x01\x00\x05"),)),
        r"key 'x.y'\[2\]: bool value is 5, not 0 or 1",
    ),
    "alignment 0": (gguf_bytes((align(0),)), r"key 'general.alignment': is 0, not a power of two"),
    "alignment 3": (gguf_bytes((align(3),)), r"key 'general.alignment': is 3, not a power of two"),
    "alignment i32": (
        gguf_bytes((kv("general.alignment", I32, struct.pack("<i", 32)),)),
        r"key 'general.alignment': has type i32; GGUF requires u32",
    ),
    "alignment string": (
        gguf_bytes((kv("general.alignment", STR, s("32")),)),
        r"key 'general.alignment': has type string; GGUF requires u32",
    ),
    "alignment array": (
        gguf_bytes((kv("general.alignment", ARR, struct.pack("<IQI", U32, 1, 32)),)),
        r"key 'general.alignment': has type array of u32",
    ),
    "n_dims 0": (
        gguf_bytes(tis=(ti("w", ()),), data=b""),
        r"tensor 'w': has 0 dimensions; a GGUF tensor has 1 to 4",
    ),
    "n_dims 9": (gguf_bytes(tis=(ti("w", (1,) * 9),)), r"tensor 'w': has 9 dimensions"),
    "n_dims huge": (
        gguf_bytes(tis=(s("w") + struct.pack("<I", 2**32 - 1),)),
        r"tensor 'w': has 4294967295 dim",
    ),
    "zero dimension": (
        gguf_bytes(tis=(ti("w", (4, 0)),)),
        r"tensor 'w': has a zero dimension \(ne = \[4, 0\]\)",
    ),
    "unknown ggml type": (
        gguf_bytes(tis=(ti("w", (32,), 4),)),
        r"tensor 'w': ggml type 4 is none of the \d+ GGML types",
    ),
    "ggml type 2^32-1": (gguf_bytes(tis=(ti("w", (32,), 2**32 - 1),)), r"tensor 'w': ggml type 4294967295"),
    "row not whole blocks": (
        gguf_bytes(tis=(ti("w", (16, 2), Q8_0),)),
        r"tensor 'w': is Q8_0 with rows of 16 values, not a multiple of its 32-value block",
    ),
    "misaligned offset": (
        gguf_bytes(tis=(ti("a", (8,)), ti("b", (32,), Q8_0, 48)), data=bytes(100)),
        r"tensor 'b': data offset 48 is not a multiple of the file's alignment 32",
    ),
    "offset past end": (
        gguf_bytes(tis=(ti("a", (8,)), ti("b", (32,), Q8_0, 2**64 - 32))),
        rf"tensor 'b': data offset {2**64 - 32} puts it at byte \d+, past the end of the file",
    ),
    "truncated tensor data": (
        gguf_bytes(data=DATA[:-1]),
        r"tensor 'b': its 34 bytes at \d+-\d+ run past the end of the file \(\d+ bytes\): the file is trunc",
    ),
    "huge tensor": (
        gguf_bytes(tis=(ti("w", (2**60, 2**60)),)),
        r"tensor 'w': its \d+ bytes at .* run past the end",
    ),
    "overlapping tensors": (
        gguf_bytes(tis=(ti("a", (8,)), ti("b", (32,), Q8_0, 0))),
        r"tensor 'b': its bytes (\d+)-\d+ overlap tensor 'a''s \(\1-\d+\)",
    ),
    "duplicate tensor": (
        gguf_bytes(tis=(ti("a", (8,)), ti("a", (8,), F32, 32))),
        r"tensor 'a': appears twice",
    ),
    "empty tensor name": (gguf_bytes(tis=(ti("", (8,)),)), r"tensor #0: has an empty name"),
    "bad UTF-8 tensor name": (
        gguf_bytes(tis=(ti(b"\xe2\x82", (8,)),)),
        r"tensor #0's name: is not valid UTF-8",
    ),
    "tensor name huge": (
        gguf_bytes(tis=(struct.pack("<Q", 2**40),)),
        rf"tensor #0's name: claims a length of {2**40} bytes, over Kiln's {MAX_NAME_BYTES}-byte limit",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_are_refused_with_what_to_do(case: str) -> None:
    blob, pattern = MALFORMED[case]
    with pytest.raises(GgufFormatError) as info:
        parse(blob, probe=40)
    message = str(info.value)
    assert message.startswith("m.gguf: ") and re.search(pattern, message), message
    assert re.search(r"re-download|re-export", message), message
    assert isinstance(info.value, ConversionError)


def test_every_truncation_is_refused_until_the_last_tensor_is_whole(tmp_path: Path) -> None:
    blob = write_sample_gguf(tmp_path / "s.gguf").read_bytes()
    whole = max(t.end for t in parse(blob).tensors.values())
    assert whole < len(blob)  # GGUFWriter pads the last tensor too
    for cut in range(len(blob)):
        if cut >= whole:
            assert parse(blob[:cut], probe=64).tensors
            continue
        with pytest.raises(GgufFormatError, match=r"truncated|not a GGUF file"):
            parse(blob[:cut], probe=64)


@pytest.mark.parametrize(
    ("cap", "value", "blob", "pattern"),
    [
        (
            "MAX_METADATA_BYTES",
            64,
            gguf_bytes((ARCH, kv("x.y", STR, s("z" * 60)))),
            "takes the metadata past",
        ),
        (
            "MAX_TENSOR_INFO_BYTES",
            45,
            gguf_bytes(),
            r"'b' \(its number of dimensions\): takes the tensor index",
        ),
        (
            "MAX_ARRAY_VALUES",
            4,
            gguf_bytes((kv("x.y", ARR, struct.pack("<IQ", U32, 5) + bytes(20)),)),
            "limit of 4",
        ),
    ],
)
def test_section_caps(
    cap: str, value: int, blob: bytes, pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse(blob)
    monkeypatch.setattr(container, cap, value)
    with pytest.raises(GgufFormatError, match=pattern):
        parse(blob)


@pytest.mark.parametrize("reply", [lambda b: b[:-1], lambda b: b + b"x", lambda b: b""])
def test_a_short_or_long_read_is_refused(reply: Callable[[bytes], bytes]) -> None:
    blob = gguf_bytes()
    with pytest.raises(GgufFormatError, match=r"m.gguf: bytes 10-\d+: reading them returned \d+ bytes"):
        parse_gguf("m.gguf", blob[:10], lambda start, end: reply(blob[start:end]), len(blob))
