"""One artifact on its way into the store: staging, naming, reuse and the commit.

The rank files are written into a scratch directory by streaming safetensors writers (each byte once,
on a background thread). The artifact id needs the source hashes, computed while converting: until
they are in, the scratch directory is named `pending-scratch-*`; once the id is known it is renamed
`{id}-scratch-*` (like the store's staging entries, so a dead attempt's leftovers are found by id) and
the store's writer begins — unless an artifact of that id is already committed, which is then reused
and this one discarded. Files are staged through the store's writer; manifest.json is written last
(the commit point); `discard` on any failure or cancellation leaves nothing visible.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.base import Target
from runtime.artifact.hf_config import artifact_hf_config
from runtime.artifact.manifest import FileEntry, Manifest, artifact_id, source_digest
from services.convert.checkpoint import Checkpoint
from services.convert.plan import Plan
from services.convert.safetensors_io import StreamingSafetensorsWriter
from services.storage.base import ArtifactStore, ArtifactWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionResult:
    artifact_id: str
    target: Target
    tp: int
    uri: str
    manifest: Manifest
    reused: bool


def plan_artifact_id(plan: Plan, hashes: dict[str, str]) -> str:
    return artifact_id(
        source_digest(hashes), plan.target, plan.tp, plan.method, plan.layout_versions(), plan.options
    )


def committed(store: ArtifactStore, aid: str, plan: Plan) -> ConversionResult | None:
    """The artifact `aid` when the store already holds it (a no-op conversion)."""
    if not store.exists(aid):
        return None
    log.info("artifact %s already exists at %s: nothing to do", aid, store.uri(aid))
    return ConversionResult(
        aid, plan.target, plan.tp, store.uri(aid), Manifest.parse(store.read_manifest(aid)), reused=True
    )


class StagedArtifact:
    def __init__(self, store: ArtifactStore, plan: Plan, ckpt: Checkpoint, workdir: Path | None) -> None:
        self.store, self.plan, self.ckpt = store, plan, ckpt
        self.scratch = Path(tempfile.mkdtemp(prefix="pending-scratch-", dir=workdir))
        reserve = plan.header_reserve()
        self.rank_writers = [
            StreamingSafetensorsWriter(self.scratch / f"rank{r}.safetensors", reserve_header_bytes=reserve)
            for r in range(plan.tp)
        ]
        self.aid: str | None = None
        self._writer: ArtifactWriter | None = None

    def name_when_hashed(self, *, wait: bool = False) -> ConversionResult | None:
        """Once the source hashes are in (`wait`: block for them), name the staging after the
        artifact id — or, when that artifact is already committed, discard this one and return it."""
        if self.aid is not None:
            return None
        hashes = self.ckpt.file_hashes() if wait else self.ckpt.hashes_if_ready()
        if hashes is None:
            return None
        aid = plan_artifact_id(self.plan, hashes)
        if (reused := committed(self.store, aid, self.plan)) is not None:
            self.discard()
            return reused
        renamed = self.scratch.with_name(f"{aid}-scratch-{self.scratch.name.rsplit('-', 1)[-1]}")
        self.scratch.rename(renamed)  # open files follow the directory
        self.scratch = renamed
        for w in self.rank_writers:
            w.moved_to(renamed)
        self.aid = aid
        self._writer = self.store.begin(aid)
        return None

    def add_to_every_rank(self, name: str, tensor: torch.Tensor) -> None:
        for w in self.rank_writers:
            w.add(name, tensor)

    def add_rows_to_every_rank(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], blocks: Iterable[torch.Tensor]
    ) -> None:
        """A tensor arriving as its row blocks, in order (never whole in memory)."""
        for w in self.rank_writers:
            w.reserve(name, dtype, shape)
        row = 0
        for block in blocks:
            for w in self.rank_writers:
                w.write_slices(name, row, block)
            row += block.shape[0]

    def write_files(self) -> tuple[str, list[FileEntry]]:
        """Finish the rank files and stage them with config.json and the source's side files (the
        id must be known: `name_when_hashed(wait=True)`); the id and the file entries."""
        aid, writer = self.aid, self._writer
        assert aid is not None and writer is not None
        files: list[FileEntry] = []
        for rank, (w, path) in enumerate(zip(self.rank_writers, _finish_all(self.rank_writers), strict=True)):
            size, digest = writer.put_file(path.name, path, move=True, sha256=w.sha256)
            files.append(FileEntry(name=path.name, size=size, sha256=digest, rank=rank))
        config = artifact_hf_config(
            self.ckpt.config, artifact_id=aid, target=self.plan.target.value, source_format=self.plan.format
        )
        shared = [("config.json", config)] + [
            (name, self.ckpt.side_file(name)) for name in self.ckpt.present_side_files()
        ]
        for name, data in shared:
            size, digest = writer.put_bytes(name, data)
            files.append(FileEntry(name=name, size=size, sha256=digest, rank=None))
        return aid, files

    def commit(self, manifest: Manifest) -> None:
        assert self._writer is not None
        self._writer.commit(manifest.to_json_bytes())

    def discard(self) -> None:
        for w in self.rank_writers:
            w.discard()
        if self._writer is not None:
            self._writer.abort()

    def remove_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _finish_all(writers: list[StreamingSafetensorsWriter]) -> list[Path]:
    """Finish every rank file; their sha256 passes run in parallel (hashlib releases the GIL)."""
    if len(writers) == 1:
        return [writers[0].finish()]
    with ThreadPoolExecutor(max_workers=len(writers), thread_name_prefix="kiln-finish") as pool:
        return list(pool.map(lambda w: w.finish(), writers))
