"""Convert one planned (checkpoint, target, tp) into a committed artifact, layer by layer.

Per linear layer: read its source tensors (positioned reads into one buffer / ranged GETs), decode
every shard into a canonical weight, then per TP rank slice + fuse (a view when the shards lie back
to back), quantize online (--method fp8), `kernel.prepare`, verify `kernel.dequantize` against the
source (a dense kernel's stored weight directly), and append the tensors to that rank's streaming
safetensors writer, which writes each byte once on a background thread. Only one layer's tensors
are in memory at a time. The source files are hashed in parallel with the conversion; the artifact
id (and with it the no-op check) follows as soon as the hashes are in. Files are staged through
the store's writer; manifest.json is written last (the commit point); any failure or cancellation
aborts the writer so nothing is left visible.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from kernels.base import DenseWeight, IntWeight, SourceWeight, Target, check_stored
from kernels.codecs.fp8 import quantize_fp8
from kernels.errors import LayoutError
from runtime.artifact.hf_config import artifact_hf_config
from runtime.artifact.manifest import (
    MOE_SCHEMA_VERSION,
    SCHEMA_VERSION,
    ExpertGroupEntry,
    FileEntry,
    LayerEntry,
    LayerVerification,
    Manifest,
    Rejection,
    SourceInfo,
    Verification,
    artifact_id,
    source_digest,
)
from runtime.model_layout import shard_rows
from runtime.version import kiln_version
from services.convert.checkpoint import Checkpoint
from services.convert.errors import Cancelled, VerificationError
from services.convert.experts import PlannedExperts, check_source_shape, convert_experts
from services.convert.formats.base import CheckpointFormat
from services.convert.plan import Plan, PlannedLayer
from services.convert.safetensors_io import StreamingSafetensorsWriter
from services.convert.tp import fuse, slice_cols, slice_rows
from services.convert.verify import compare, compare_dense_stored, compare_int_stored, worst_of
from services.storage.base import ArtifactStore, ArtifactWriter
from services.storage.errors import ArtifactExistsError

log = logging.getLogger(__name__)

MAX_TENSORS_PER_LAYER = 8  # qweight, scales, zeros, g_idx, perm, bias, ... (the header estimate)


@dataclass(frozen=True)
class Progress:
    stage: str  # hashing | converting | writing | committing | done
    done: int  # layers done
    total: int
    bytes_done: int  # source bytes processed
    bytes_total: int
    message: str = ""


@dataclass(frozen=True)
class ConversionResult:
    artifact_id: str
    target: Target
    tp: int
    uri: str
    manifest: Manifest
    reused: bool


ProgressFn = Callable[[Progress], None]
CancelFn = Callable[[], bool]


def plan_artifact_id(plan: Plan, hashes: dict[str, str]) -> str:
    return artifact_id(
        source_digest(hashes), plan.target, plan.tp, plan.method, plan.layout_versions(), plan.options
    )


def _rank_weight(plan: Plan, pl: PlannedLayer, shards: list[SourceWeight], rank: int) -> SourceWeight:
    layout = pl.layout
    parts = []
    for shard, w in zip(layout.shards, shards, strict=True):
        if layout.row_parallel:
            parts.append(slice_cols(w, rank, plan.tp, shard.module))
        else:
            parts.append(slice_rows(w, shard_rows(shard, layout, plan.model, rank, plan.tp), shard.module))
    return fuse(parts, [s.module for s in layout.shards])


def _header_reserve(plan: Plan) -> int:
    """Bytes to reserve for a rank file's safetensors header (about twice what it will need)."""
    per_entry = 160  # {"dtype":"BF16","shape":[...],"data_offsets":[...]} plus quoting
    linear = sum(MAX_TENSORS_PER_LAYER * (len(pl.name) + 24 + per_entry) for pl in plan.layers)
    groups = sum(2 * MAX_TENSORS_PER_LAYER * (len(pe.name) + 28 + per_entry) for pe in plan.expert_groups)
    other = sum(len(n) + per_entry for n in plan.other_tensors)
    return 4096 + linear + groups + other


def _finish_all(writers: list[StreamingSafetensorsWriter]) -> list[Path]:
    """Finish every rank file; their sha256 passes run in parallel (hashlib releases the GIL)."""
    if len(writers) == 1:
        return [writers[0].finish()]
    with ThreadPoolExecutor(max_workers=len(writers), thread_name_prefix="kiln-finish") as pool:
        return list(pool.map(lambda w: w.finish(), writers))


def convert_layer(
    ckpt: Checkpoint,
    fmt: CheckpointFormat,
    plan: Plan,
    pl: PlannedLayer,
    writers: list[StreamingSafetensorsWriter],
) -> LayerEntry:
    tensors = ckpt.read(pl.source_tensors)
    shards = [fmt.decode(s.module, pl.quant, tensors) for s in pl.layout.shards]
    del tensors
    for shard, w in zip(pl.layout.shards, shards, strict=True):
        check_source_shape(shard.module, w, (shard.size, pl.layout.k))
    worst: LayerVerification | None = None
    suffixes: list[str] | None = None
    for rank, spec in enumerate(pl.specs):
        weight = _rank_weight(plan, pl, shards, rank)
        reference = weight
        if pl.online_fp8:
            assert isinstance(weight, DenseWeight)
            strategy = pl.target_quant.fp8_strategy or "tensor"
            weight = quantize_fp8(
                weight.weight, strategy, block_size=pl.target_quant.block_size or (128, 128)
            )
            weight.bias = reference.bias
        prepared = pl.kernel.prepare(weight, spec, plan.target)
        try:
            check_stored(pl.kernel.name, spec, pl.kernel.stored_tensors(spec, plan.target), prepared)
        except LayoutError as e:
            raise VerificationError(
                f"{e}: kernel {pl.kernel.name}'s prepare does not write the tensors it declares (a kernel "
                "bug — disable the kernel with KILN_DISABLED_KERNELS and report it)"
            ) from e
        if pl.kernel.stores_plain_weight and isinstance(reference, DenseWeight) and not pl.online_fp8:
            check = compare_dense_stored(prepared["weight"], reference)
        else:
            act = spec.torch_act_dtype
            stored = pl.kernel.stored_int_weight(prepared, spec) if isinstance(reference, IntWeight) else None
            check = compare_int_stored(stored, reference, act) or compare(
                pl.kernel.dequantize(prepared, spec), reference, act, online_fp8=pl.online_fp8
            )
            del stored
        if not check.ok:
            raise VerificationError(
                f"layer {pl.name} (rank {rank}, kernel {pl.kernel.name}): the artifact's weights do not "
                f"reproduce the source: {check.metric} {check.value:.4g} > bound {check.bound:.4g}; "
                "this is a kernel layout bug — disable the kernel with KILN_DISABLED_KERNELS and report it"
            )
        worst = worst_of(worst, check)
        names = sorted(prepared)
        if suffixes is not None and names != suffixes:
            raise VerificationError(f"layer {pl.name}: ranks store different tensors ({suffixes} vs {names})")
        suffixes = names
        for suffix in names:
            writers[rank].add(f"{pl.name}.{suffix}", prepared[suffix])
        del prepared, weight
    return LayerEntry(
        kernel=pl.kernel.name,
        layout_version=pl.kernel.layout_version,
        spec=pl.specs[0].to_json(),
        tensors=suffixes or [],
        source_tensors=list(pl.source_tensors),
        rejected=[Rejection(kernel=k, reason=r) for k, r in pl.rejected],
        fallback=pl.fallback,
        verification=worst,
    )


def _other_tensor(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    if plan.act_dtype == "float16" and t.dtype in (torch.bfloat16, torch.float32):
        return t.to(torch.float16)  # sm75 has no bf16
    return t


def _reuse(store: ArtifactStore, aid: str, plan: Plan) -> ConversionResult | None:
    if not store.exists(aid):
        return None
    log.info("artifact %s already exists at %s: nothing to do", aid, store.uri(aid))
    return ConversionResult(
        aid, plan.target, plan.tp, store.uri(aid), Manifest.parse(store.read_manifest(aid)), reused=True
    )


class _Staging:
    """The scratch directory for the rank files and the store's writer. The artifact id needs the
    source hashes, which are computed while converting: until then the scratch directory is named
    `pending-scratch-*`; once the id is known it is renamed `{id}-scratch-*` (like the store's
    staging entries, so a dead attempt's leftovers are found by id) and the store's writer begins."""

    def __init__(self, store: ArtifactStore, workdir: Path | None) -> None:
        self.store = store
        self.scratch = Path(tempfile.mkdtemp(prefix="pending-scratch-", dir=workdir))
        self.aid: str | None = None
        self.writer: ArtifactWriter | None = None

    def named(self, aid: str, rank_writers: list[StreamingSafetensorsWriter]) -> None:
        renamed = self.scratch.with_name(f"{aid}-scratch-{self.scratch.name.rsplit('-', 1)[-1]}")
        self.scratch.rename(renamed)  # open files follow the directory
        self.scratch = renamed
        for w in rank_writers:
            w.moved_to(renamed)
        self.aid = aid
        self.writer = self.store.begin(aid)


def _discard(rank_writers: list[StreamingSafetensorsWriter], staged: _Staging) -> None:
    for w in rank_writers:
        w.discard()
    if staged.writer is not None:
        staged.writer.abort()


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
    if hashes is not None:
        reused = _reuse(store, plan_artifact_id(plan, hashes), plan)
        if reused is not None:
            return reused
    report = progress or (lambda p: None)
    cancelled = should_cancel or (lambda: False)
    started = time.monotonic()
    staged = _Staging(store, workdir)
    reserve = _header_reserve(plan)
    rank_writers = [
        StreamingSafetensorsWriter(staged.scratch / f"rank{r}.safetensors", reserve_header_bytes=reserve)
        for r in range(plan.tp)
    ]
    units: list[PlannedLayer | PlannedExperts] = [*plan.layers, *plan.expert_groups]
    total = len(units) + 1
    bytes_total = sum(ckpt.info(t).nbytes for u in units for t in u.source_tensors) + sum(
        ckpt.info(t).nbytes for t in plan.other_tensors
    )
    bytes_done = 0
    try:
        entries: dict[str, LayerEntry] = {}
        groups: dict[str, ExpertGroupEntry] = {}
        for i, pl in enumerate(units):
            if cancelled():
                raise Cancelled(
                    f"conversion of {plan.source} for {plan.target.value} cancelled at layer {pl.name}"
                )
            if isinstance(pl, PlannedExperts):
                groups[pl.name] = convert_experts(ckpt, fmt, pl, plan.target, rank_writers)
            else:
                entries[pl.name] = convert_layer(ckpt, fmt, plan, pl, rank_writers)
            if staged.aid is None and (hashes := ckpt.hashes_if_ready()) is not None:
                aid = plan_artifact_id(plan, hashes)
                if (reused := _reuse(store, aid, plan)) is not None:
                    _discard(rank_writers, staged)
                    return reused
                staged.named(aid, rank_writers)
            bytes_done += sum(ckpt.info(t).nbytes for t in pl.source_tensors)
            report(
                Progress(
                    "converting", i + 1, total, bytes_done, bytes_total, f"{plan.target.value}: {pl.name}"
                )
            )
        if cancelled():
            raise Cancelled(f"conversion of {plan.source} for {plan.target.value} cancelled")
        for name in plan.other_tensors:
            t = _other_tensor(ckpt.read_one(name), plan)
            for w in rank_writers:
                w.add(name, t)
            bytes_done += ckpt.info(name).nbytes
        report(Progress("writing", total, total, bytes_done, bytes_total, "rank files"))
        if staged.aid is None:
            hashes = ckpt.file_hashes()
            if (reused := _reuse(store, plan_artifact_id(plan, hashes), plan)) is not None:
                _discard(rank_writers, staged)
                return reused
            staged.named(plan_artifact_id(plan, hashes), rank_writers)
        hashes = ckpt.file_hashes()
        aid = staged.aid
        writer = staged.writer
        assert aid is not None and writer is not None
        files: list[FileEntry] = []
        for rank, (w, path) in enumerate(zip(rank_writers, _finish_all(rank_writers), strict=True)):
            size, digest = writer.put_file(path.name, path, move=True, sha256=w.sha256)
            files.append(FileEntry(name=path.name, size=size, sha256=digest, rank=rank))
        config = artifact_hf_config(
            ckpt.config, artifact_id=aid, target=plan.target.value, source_format=plan.format
        )
        size, digest = writer.put_bytes("config.json", config)
        files.append(FileEntry(name="config.json", size=size, sha256=digest, rank=None))
        for name in ckpt.present_side_files():
            size, digest = writer.put_bytes(name, ckpt.source.read_bytes(name))
            files.append(FileEntry(name=name, size=size, sha256=digest, rank=None))
        if cancelled():
            raise Cancelled(f"conversion of {plan.source} for {plan.target.value} cancelled before commit")
        recorded = [*entries.values(), *groups.values()]
        checks = [e.verification for e in recorded if e.verification is not None]
        manifest = Manifest(
            schema_version=MOE_SCHEMA_VERSION if groups else SCHEMA_VERSION,
            artifact_id=aid,
            kiln_version=kiln_version(),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            source=SourceInfo(
                uri=plan.source,
                format=plan.format,
                digest=source_digest(hashes),
                files=hashes,
                quantization=plan.quantization,
            ),
            target=plan.target,
            tp=plan.tp,
            method=plan.method,
            options=plan.options,
            architecture=plan.model.architecture,
            act_dtype=plan.act_dtype,
            hf_config=ckpt.config,
            layers=entries,
            other_tensors=plan.other_tensors,
            expert_groups=groups,
            expert_parallel=plan.expert_parallel,
            files=files,
            verification=Verification(
                ok=all(c.ok for c in checks),
                layers_checked=len(checks),
                layers_exact=sum(c.metric == "exact" for c in checks),
                max_rel_err=max((c.value for c in checks if c.metric == "max_rel_err"), default=0.0),
                seconds=round(time.monotonic() - started, 3),
            ),
        )
        report(Progress("committing", total, total, bytes_done, bytes_total, aid))
        writer.commit(manifest.to_json_bytes())
    except ArtifactExistsError:
        log.info("artifact %s was committed concurrently by another writer; using it", aid)
        return ConversionResult(
            aid,
            plan.target,
            plan.tp,
            store.uri(aid),
            Manifest.parse(store.read_manifest(aid)),
            reused=True,
        )
    except BaseException:
        _discard(rank_writers, staged)
        raise
    finally:
        shutil.rmtree(staged.scratch, ignore_errors=True)
    report(Progress("done", total, total, bytes_done, bytes_total, aid))
    return ConversionResult(aid, plan.target, plan.tp, store.uri(aid), manifest, reused=False)
