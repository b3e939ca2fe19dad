"""Convert one planned (checkpoint, target, tp) into a committed artifact, unit by unit.

Each unit of the plan (services/convert/units) converts itself into the rank files; the tensors no
unit reads are copied to every rank (sm75's fp16 narrows bf16 / fp32 ones). The source files are
hashed in parallel with the conversion; the artifact id (and with it the no-op check) follows as soon
as the hashes are in (services/convert/artifact_writer.py owns staging, naming, reuse and the commit;
services/convert/manifest.py the manifest).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.artifact.manifest import Manifest
from services.convert.artifact_writer import (
    ConversionResult,
    StagedArtifact,
    committed,
    plan_artifact_id,
)
from services.convert.checkpoint import Checkpoint
from services.convert.errors import Cancelled
from services.convert.formats.base import CheckpointFormat
from services.convert.heap import release_freed_heap
from services.convert.manifest import build_manifest
from services.convert.plan import Plan
from services.convert.units.base import RankFiles, UnitEntry
from services.storage.base import ArtifactStore
from services.storage.errors import ArtifactExistsError

log = logging.getLogger(__name__)

__all__ = ["CancelFn", "ConversionResult", "Progress", "ProgressFn", "convert_plan", "plan_artifact_id"]


@dataclass(frozen=True)
class Progress:
    stage: str  # hashing | converting | writing | committing | done
    done: int  # units done
    total: int
    bytes_done: int  # source bytes processed
    bytes_total: int
    message: str = ""


ProgressFn = Callable[[Progress], None]
CancelFn = Callable[[], bool]


class _Tracker:
    """Progress reports and cancellation checks of one conversion."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, progress: ProgressFn | None, cancel: CancelFn | None):
        self.plan = plan
        self.report = progress or (lambda p: None)
        self.cancelled = cancel or (lambda: False)
        self.total = len(plan.units) + 1
        self.bytes_done = 0
        names = [t for u in plan.units for t in u.source_tensors] + plan.other_tensors
        self.bytes_total = sum(ckpt.info(t).nbytes for t in names)

    def stop_if_cancelled(self, where: str) -> None:
        if self.cancelled():
            raise Cancelled(f"conversion of {self.plan.source} for {self.plan.target.value} cancelled{where}")

    def done(self, stage: str, done: int, message: str, nbytes: int = 0) -> None:
        self.bytes_done += nbytes
        self.report(Progress(stage, done, self.total, self.bytes_done, self.bytes_total, message))


def _other_dtype(dtype: torch.dtype, plan: Plan) -> torch.dtype:
    """What a plain tensor (embedding, norm) is stored as: fp16 for a float16 plan (sm75 has no bf16)."""
    if plan.act_dtype == "float16" and dtype in (torch.bfloat16, torch.float32):
        return torch.float16
    return dtype


def _other_tensor(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    return t.to(_other_dtype(t.dtype, plan))


def convert_plan(
    ckpt: Checkpoint,
    fmt: CheckpointFormat,
    plan: Plan,
    store: ArtifactStore,
    *,
    progress: ProgressFn | None = None,
    should_cancel: CancelFn | None = None,
    workdir: Path | None = None,
) -> ConversionResult:
    ckpt.start_hashing()  # the source is hashed while it is converted (one more reader, no extra pass)
    hashes = ckpt.hashes_if_ready()
    if hashes is not None and (reused := committed(store, plan_artifact_id(plan, hashes), plan)):
        return reused
    tracker = _Tracker(ckpt, plan, progress, should_cancel)
    started = time.monotonic()
    staged = StagedArtifact(store, plan, ckpt, workdir)
    entries: dict[str, dict[str, UnitEntry]] = {}  # manifest section -> unit name -> entry
    try:
        reused = _convert_units(ckpt, fmt, plan, staged, tracker, entries)
        return reused or _commit(ckpt, plan, staged, tracker, entries, started)
    except BaseException:
        staged.discard()
        raise
    finally:
        staged.remove_scratch()


def _convert_units(
    ckpt: Checkpoint,
    fmt: CheckpointFormat,
    plan: Plan,
    staged: StagedArtifact,
    tracker: _Tracker,
    entries: dict[str, dict[str, UnitEntry]],
) -> ConversionResult | None:
    """Every unit and the other tensors into the rank files; an already committed artifact of the
    same id, found once the hashes are in, ends the conversion early (returned)."""
    files = RankFiles(ckpt, fmt, plan.target, plan.model, staged.rank_writers)
    for i, unit in enumerate(plan.units):
        tracker.stop_if_cancelled(f" at layer {unit.name}")
        entries.setdefault(unit.section, {})[unit.name] = unit.convert(files)
        release_freed_heap()
        if (reused := staged.name_when_hashed()) is not None:
            return reused
        nbytes = sum(ckpt.info(t).nbytes for t in unit.source_tensors)
        tracker.done("converting", i + 1, f"{plan.target.value}: {unit.name}", nbytes)
    tracker.stop_if_cancelled("")
    for name in plan.other_tensors:
        if (made := ckpt.row_blocks(name)) is not None:
            dtype, shape, blocks = made
            stored = (_other_tensor(b, plan) for b in blocks)
            staged.add_rows_to_every_rank(name, _other_dtype(dtype, plan), shape, stored)
        else:
            staged.add_to_every_rank(name, _other_tensor(ckpt.read_one(name), plan))
        tracker.bytes_done += ckpt.info(name).nbytes
    tracker.done("writing", tracker.total, "rank files")
    return staged.name_when_hashed(wait=True)


def _commit(
    ckpt: Checkpoint,
    plan: Plan,
    staged: StagedArtifact,
    tracker: _Tracker,
    entries: dict[str, dict[str, UnitEntry]],
    started: float,
) -> ConversionResult:
    hashes = ckpt.file_hashes()
    aid, files = staged.write_files()
    tracker.stop_if_cancelled(" before commit")
    seconds = time.monotonic() - started
    manifest = build_manifest(plan, ckpt.config, aid, hashes, files, entries, seconds)
    tracker.done("committing", tracker.total, aid)
    try:
        staged.commit(manifest)
    except ArtifactExistsError:
        log.info("artifact %s was committed concurrently by another writer; using it", aid)
        store = staged.store
        return ConversionResult(
            aid, plan.target, plan.tp, store.uri(aid), Manifest.parse(store.read_manifest(aid)), reused=True
        )
    tracker.done("done", tracker.total, aid)
    return ConversionResult(aid, plan.target, plan.tp, staged.store.uri(aid), manifest, reused=False)
