"""Malformed safetensors files: the converter's reader and the runtime loader refuse each defect with
SafetensorsFormatError (SourceSafetensorsError / CorruptRankFileError) naming the file and tensor and
what to do, and a conversion from a directory holding such a file leaves nothing in the store."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from devtools.builders.synthetic import Dims, write_checkpoint
from runtime.artifact.safetensors_header import FIX_HINT, MAX_HEADER_BYTES, SafetensorsFormatError
from runtime.loader import CorruptRankFileError, LoadError, map_safetensors
from services.convert.errors import ConversionError, SourceSafetensorsError
from services.convert.library import ConversionRequest, convert
from services.storage.local import LocalStore
from tests.reliability.st_files import build, valid_header

EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"
SMALL = Dims(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, head_dim=32, vocab=64)


def _mutated(change: Callable[[dict[str, Any]], None], data_extra: bytes = b"", cut: int = 0) -> bytes:
    header, data = valid_header()
    change(header)
    data += data_extra
    return build(header, data[: len(data) - cut] if cut else data)


def _set(name: str, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda h: h[name].__setitem__(key, value)


def _rename(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    return lambda h: h.__setitem__(new, h.pop(old))


def _dup_keys() -> bytes:
    header, data = valid_header()
    text = json.dumps(header)
    entry = json.dumps(header[NORM])
    return build(text[:-1].encode() + f', "{NORM}": {entry}}}'.encode(), data)


# defect -> (file bytes, message parts besides the file name and FIX_HINT)
DEFECTS: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "too_short": (b"\x05\x00", ("too short",)),
    "header_len_beyond_file": (
        build(b'{"a": 1}', b"", header_len=4096),
        ("header length 4096", "past the end"),
    ),
    "header_over_100mb": (
        build(b"{}", b"", header_len=MAX_HEADER_BYTES + 1),
        (f"header length {MAX_HEADER_BYTES + 1}", "limit"),
    ),
    "non_utf8": (build(b'{"\xff\xfe": 1}', b""), ("not UTF-8",)),
    "non_json": (build(b"{this is not json", b""), ("not valid JSON",)),
    "not_an_object": (build(b"[1, 2, 3]", b""), ("must be a JSON object",)),
    "deeply_nested": (build(b"[" * 100_000 + b"]" * 100_000, b""), ("not valid JSON",)),
    "duplicate_keys": (_dup_keys(), ("duplicate key", NORM)),
    "overlapping_offsets": (_mutated(_set(NORM, "data_offsets", [8, 16]), cut=0), ("overlaps", NORM)),
    "out_of_range_offsets": (_mutated(lambda h: None, cut=4), (NORM, "past the")),
    "unsorted_offsets": (_mutated(_set(NORM, "data_offsets", [24, 16])), (NORM, "unsorted")),
    "gap_between_tensors": (
        _mutated(_set(NORM, "data_offsets", [20, 28]), data_extra=b"\0" * 4),
        ("gap of 4 bytes", NORM),
    ),
    "trailing_bytes": (_mutated(lambda h: None, data_extra=b"junk"), ("trailing bytes", NORM)),
    "byte_count_mismatch": (_mutated(_set(EMBED, "shape", [3, 3])), (EMBED, "needs 36", "hold 16 bytes")),
    "nul_in_name": (_mutated(_rename(NORM, "model.norm\0.weight")), ("NUL",)),
    "slash_in_name": (_mutated(_rename(NORM, "../../etc/passwd")), ("../../etc/passwd", "'/'")),
    "backslash_in_name": (_mutated(_rename(NORM, "model\\norm")), ("model\\\\norm",)),
    "unknown_dtype": (_mutated(_set(NORM, "dtype", "Q4_K")), (NORM, "unsupported dtype 'Q4_K'")),
    "non_integer_shape": (_mutated(_set(NORM, "shape", [2.0, 2])), (NORM, "list of integers")),
    "negative_dim": (_mutated(_set(NORM, "shape", [-4])), (NORM, "negative dimension")),
    "bool_offsets": (_mutated(_set(NORM, "data_offsets", [True, 24])), (NORM, "data_offsets")),
    "missing_offsets": (_mutated(lambda h: h[NORM].pop("data_offsets")), (NORM, "lacks data_offsets")),
    "entry_not_object": (_mutated(lambda h: h.__setitem__(NORM, [1, 2])), (NORM, "must be an object")),
    "metadata_not_str_map": (
        _mutated(lambda h: h.__setitem__("__metadata__", {"format": 1})),
        ("__metadata__", "strings to strings"),
    ),
}


def _check(err: BaseException, file: str, parts: tuple[str, ...]) -> None:
    msg = str(err)
    assert file in msg, msg
    assert FIX_HINT in msg or "pull it again" in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("rel") / "dense", "dense", dims=SMALL)


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_converter_refuses_and_leaves_nothing(defect: str, small_checkpoint: Path, tmp_path: Path) -> None:
    blob, parts = DEFECTS[defect]
    src = tmp_path / "src"
    shutil.copytree(small_checkpoint, src)
    (src / "model.safetensors").write_bytes(blob)
    out = tmp_path / "out"
    with pytest.raises(SourceSafetensorsError) as info:
        convert(ConversionRequest(str(src), ["cpu"], out=str(out)))
    assert isinstance(info.value, ConversionError) and isinstance(info.value, SafetensorsFormatError)
    _check(info.value, "model.safetensors", parts)
    if out.exists():
        store = LocalStore(out)
        assert store.list_ids() == [] and store.staging_entries() == []
        assert [p for p in out.rglob("*") if p.name != ".staging"] == []


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_runtime_loader_refuses(defect: str, tmp_path: Path) -> None:
    blob, parts = DEFECTS[defect]
    path = tmp_path / "rank0.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CorruptRankFileError) as info:
        map_safetensors(path)
    assert isinstance(info.value, LoadError) and isinstance(info.value, SafetensorsFormatError)
    _check(info.value, "rank0.safetensors", parts if defect != "too_short" else ("too short",))


def test_valid_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    header, data = valid_header()
    path.write_bytes(build(header, data))
    mapped = map_safetensors(path)
    assert mapped.tensors[EMBED].shape == (2, 2) and mapped.tensors[NORM].shape == (4,)
    assert mapped.tensors[EMBED].numpy().tobytes() == bytes(range(16))
    assert mapped.tensors[NORM].view(torch.int16).numpy().tobytes() == bytes(range(100, 108))


def test_header_longer_than_first_read_is_fetched_and_validated() -> None:
    from services.convert.safetensors_io import parse_header

    header, data = valid_header()
    header["__metadata__"]["pad"] = "x" * 5000
    blob = build(header, data)
    reads: list[tuple[int, int]] = []

    def more(start: int, end: int) -> bytes:
        reads.append((start, end))
        return blob[start:end]

    infos = parse_header("model.safetensors", blob[:100], more, len(blob))
    assert reads == [(100, len(blob) - len(data))]
    assert infos[NORM].end == len(blob) and infos[NORM].nbytes == 8
