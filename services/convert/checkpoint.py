"""A Hugging Face checkpoint opened for conversion: configs, tensor index, per-layer tensor reads.

Works over any `SourceReader` (local directory or S3 prefix). Only safetensors headers are read up
front; tensors are read when a layer is converted: from a local file with positioned reads into one
buffer per layer (released with the layer), from S3 with one ranged GET per tensor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import torch

from services.convert.errors import ConversionError, NotACheckpointError, UnsupportedError
from services.convert.limits import check_dimensions, check_json_size
from services.convert.safetensors_io import (
    DTYPES,
    TensorInfo,
    hash_file,
    parse_header,
    tensor_from_bytes,
)
from services.storage.base import SourceReader
from services.storage.errors import StorageError
from services.storage.keys import check_name

log = logging.getLogger(__name__)

HEADER_PROBE_BYTES = 1 << 20
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HASH_THREADS = min(4, os.cpu_count() or 1)
# Copied verbatim into every artifact when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
SIDE_FILES = ("generation_config.json", *TOKENIZER_FILES)
QUANT_SIDE_CONFIGS = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")


@dataclass
class Checkpoint:
    """Everything known about a source checkpoint before converting it."""

    source: SourceReader
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    weight_files: list[str]
    side_configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # quantize_config.json, ...
    _hashes: dict[str, str] | None = None
    _hash_future: Future[dict[str, str]] | None = None

    @property
    def uri(self) -> str:
        return self.source.uri

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError as e:
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint at {self.uri}") from e

    def modules_with(self, suffix: str) -> set[str]:
        tail = "." + suffix
        return {n[: -len(tail)] for n in self.tensors if n.endswith(tail)}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read tensors: local files straight into one buffer per call (`readinto`, one copy from
        the page cache; tensors with the same name suffix laid out back to back in the order given,
        so fused shards like q/k/v `.weight` end up adjacent and fuse without a copy); S3 sources
        with one ranged GET per tensor."""
        infos = [self.info(n) for n in names]
        out: dict[str, torch.Tensor] = {}
        local = [i for i in infos if self.source.local_path(i.file) is not None]
        if local:
            out.update(self._read_local(local))
        for info in infos:
            if info.name not in out:
                out[info.name] = tensor_from_bytes(
                    info, self.source.read_range(info.file, info.start, info.end)
                )
        return {i.name: out[i.name] for i in infos}

    def _read_local(self, infos: list[TensorInfo]) -> dict[str, torch.Tensor]:
        groups: dict[str, list[TensorInfo]] = {}
        for info in infos:
            groups.setdefault(info.name.rsplit(".", 1)[-1], []).append(info)
        ordered = [i for group in groups.values() for i in group]
        offsets: list[int] = []
        pos = 0
        for info in ordered:
            size = DTYPES[info.dtype].itemsize
            pos += -pos % size
            offsets.append(pos)
            pos += info.nbytes
        buf = torch.empty(pos, dtype=torch.uint8)
        view = buf.numpy()
        handles: dict[str, BinaryIO] = {}
        try:
            for info, off in zip(ordered, offsets, strict=True):
                f = handles.get(info.file)
                if f is None:
                    path = self.source.local_path(info.file)
                    assert path is not None
                    f = handles[info.file] = path.open("rb", buffering=0)
                self._pread(f, view[off : off + info.nbytes], info, info.start)
        finally:
            for f in handles.values():
                f.close()
        return {
            info.name: buf[off : off + info.nbytes].view(DTYPES[info.dtype]).reshape(info.shape)
            for info, off in zip(ordered, offsets, strict=True)
        }

    def _pread(self, f: BinaryIO, view: np.ndarray, info: TensorInfo, at: int) -> None:
        """len(view) bytes of tensor `info`'s file from offset `at` into `view`, with positioned reads."""
        got = 0
        while got < len(view):  # one read returns at most ~2 GiB on Linux
            n = os.preadv(f.fileno(), [view[got:]], at + got)
            if n <= 0:
                raise ConversionError(
                    f"{self.uri}/{info.file}: tensor {info.name}: read {got} of {len(view)} "
                    "bytes (file truncated while converting?)"
                )
            got += n

    def read_raw(
        self, name: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Bytes [start, end) of a tensor's data (all of it by default) as a uint8 tensor — into the
        front of `out` when given (a buffer reused across reads): a local file read straight into it,
        an S3 source with one ranged GET."""
        info = self.info(name)
        end = info.nbytes if end is None else end
        if not 0 <= start <= end <= info.nbytes:
            raise ConversionError(f"tensor {name}: bytes [{start}, {end}) are outside its {info.nbytes}")
        buf = torch.empty(end - start, dtype=torch.uint8) if out is None else out[: end - start]
        path = self.source.local_path(info.file)
        if path is None:
            data = self.source.read_range(info.file, info.start + start, info.start + end)
            if len(data) != end - start:
                raise ConversionError(
                    f"{self.uri}/{info.file}: tensor {name}: got {len(data)} of {end - start} bytes"
                )
            buf.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            return buf
        with path.open("rb", buffering=0) as f:
            self._pread(f, buf.numpy(), info, info.start + start)
        return buf

    def row_blocks(self, name: str) -> tuple[torch.dtype, tuple[int, ...], Iterator[torch.Tensor]] | None:
        """A tensor this checkpoint makes rather than reads (a dequantized GGUF embedding) as (dtype,
        shape, its row blocks in order), so that it can be written without being whole in memory;
        None for a tensor read as stored (`read_one`)."""
        return None

    def read_one(self, name: str) -> torch.Tensor:
        return self.read([name])[name]

    def start_hashing(self) -> None:
        """Begin `file_hashes()` on a background thread (idempotent), so a conversion can run while
        the source files are hashed; `hashes_if_ready()` polls, `file_hashes()` waits."""
        if self._hashes is None and self._hash_future is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-hash-all")
            self._hash_future = pool.submit(self._compute_hashes)
            pool.shutdown(wait=False)

    def hashes_if_ready(self) -> dict[str, str] | None:
        if self._hashes is None and self._hash_future is not None and self._hash_future.done():
            return self.file_hashes()
        return self._hashes

    def file_hashes(self) -> dict[str, str]:
        """sha256 of every file the conversion reads (configs, weights, tokenizer), computed once."""
        if self._hashes is None:
            future, self._hash_future = self._hash_future, None
            self._hashes = future.result() if future is not None else self._compute_hashes()
        return self._hashes

    def _compute_hashes(self) -> dict[str, str]:
        names = sorted(
            {
                "config.json",
                *self.weight_files,
                *self.present_side_files(),
                *(n for n in QUANT_SIDE_CONFIGS if n in self.side_configs),
            }
        )
        if self.source.exists(INDEX_NAME):
            names.append(INDEX_NAME)
        ordered = sorted(set(names))
        # hashlib and file/network reads release the GIL: hash the files in parallel
        with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="kiln-hash") as pool:
            digests = list(pool.map(self._sha256, ordered))
        return dict(zip(ordered, digests, strict=True))

    def _sha256(self, name: str) -> str:
        path = self.source.local_path(name)
        return hash_file(path)[1] if path is not None else self.source.sha256(name)

    def present_side_files(self) -> list[str]:
        listing = set(self.source.list())
        return [n for n in SIDE_FILES if n in listing]

    def side_file(self, name: str) -> bytes:
        """A side file's bytes (tokenizer, generation config), copied into the artifact."""
        return self.source.read_bytes(name)


def _read_json(source: SourceReader, name: str) -> dict[str, Any]:
    size = source.size(name)
    check_json_size(source.uri, name, size)
    try:
        data = json.loads(source.read_range(name, 0, size))
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, over-long numbers, deep nesting
        raise ConversionError(f"{source.uri}/{name} is not valid JSON ({str(e)[:200]}); fix the file") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{source.uri}/{name}: expected a JSON object")
    return data


def _index_files(source: SourceReader, weight_map: dict[str, Any]) -> list[str]:
    """The weight files a sharded index names, each a plain relative path inside the checkpoint."""
    out = []
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise ConversionError(
                f"{source.uri}/{INDEX_NAME}: weight_map[{tensor!r}] must be a file name, got {file!r}"
            )
        try:
            check_name(file)
        except StorageError as e:
            raise ConversionError(
                f"{source.uri}/{INDEX_NAME}: weight_map[{tensor!r}] names {file!r}, outside the checkpoint "
                "directory; shard files must be relative paths inside it (fix the index)"
            ) from e
        out.append(file)
    return out


def gguf_in(source: SourceReader, listing: set[str]) -> str | None:
    """The GGUF file a source without config.json holds (None: it holds none)."""
    ggufs = sorted(n for n in listing if n.endswith(".gguf") and "/" not in n)
    if "config.json" in listing or not ggufs:
        return None
    if len(ggufs) > 1:
        raise ConversionError(
            f"{source.uri} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:3])}); name the one to "
            f"convert: {source.uri}/{ggufs[0]}"
        )
    return ggufs[0]


def open_checkpoint(source: SourceReader) -> Checkpoint:
    """The Hugging Face checkpoint directory `source` (config.json, safetensors weights)."""
    listing = set(source.list())
    if "config.json" not in listing:
        raise NotACheckpointError(f"{source.uri} has no config.json: not a Hugging Face checkpoint directory")
    config = _read_json(source, "config.json")
    side = {n: _read_json(source, n) for n in QUANT_SIDE_CONFIGS if n in listing}
    if INDEX_NAME in listing:
        index = _read_json(source, INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{source.uri}/{INDEX_NAME} has no weight_map")
        files = sorted(set(_index_files(source, weight_map)))
    elif SINGLE_NAME in listing:
        files = [SINGLE_NAME]
    else:
        files = sorted(n for n in listing if n.endswith(".safetensors") and "/" not in n)
        if not files:
            if any(n.endswith(".bin") or n.endswith(".pt") for n in listing):
                raise UnsupportedError(
                    f"{source.uri} holds PyTorch pickle weights (.bin); only safetensors checkpoints are "
                    "supported — re-save with save_pretrained(safe_serialization=True)"
                )
            raise ConversionError(f"{source.uri} has no safetensors weights")
    for name in ["config.json", *side, *files, *(n for n in SIDE_FILES if n in listing)]:
        if name in listing:
            source.local_path(name)  # a local source refuses a symlink out of its directory here
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        if file not in listing:
            raise ConversionError(f"{source.uri}: {INDEX_NAME} names {file}, which is missing")
        size = source.size(file)
        probe = source.read_range(file, 0, min(size, HEADER_PROBE_BYTES))

        def more(start: int, end: int, file: str = file) -> bytes:
            return source.read_range(file, start, end)

        for name, info in parse_header(file, probe, more, size).items():
            if name in tensors:
                raise ConversionError(f"tensor {name} appears in both {tensors[name].file} and {file}")
            if info.end > size:
                raise ConversionError(f"{file}: tensor {name} extends past the end of the file (truncated?)")
            tensors[name] = info
    check_dimensions(config, tensors)
    log.info("opened %s: %d tensors in %d files", source.uri, len(tensors), len(files))
    return Checkpoint(source=source, config=config, tensors=tensors, weight_files=files, side_configs=side)
