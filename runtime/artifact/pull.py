"""Pull an artifact into the local cache: parallel ranged GETs, resumable, verified, atomic.

    s3://bucket/prefix/<artifact_id>  ->  {cache_dir}/<artifact_id>/

1. An artifact already in the cache (manifest.json present, every needed file present with its
   manifest size) is returned without touching the network: artifacts are immutable.
2. manifest.json is read first (into memory). A TP rank needs only its own rank files plus the
   shared ones (config, tokenizer); `rank=None` pulls everything.
3. Each missing file is downloaded as `<name>.part` in ranges of `chunk_size` bytes by a thread
   pool; `<name>.part.progress` (JSON) records the ranges already written, so an interrupted pull
   continues where it stopped.
4. A complete `.part` is hashed; only when its sha256 equals the manifest's is it renamed to its
   name (a crash never leaves a file that looks complete). A mismatch deletes the `.part` and
   raises `PullError` naming the file, expected and actual digests; nothing is published.
5. manifest.json is written last, so its presence marks the artifact as complete for this rank;
   `.manifest.sha256` before it records the sha256 of the manifest fetched
   (runtime/artifact/manifest_pin.py).

Before any file is fetched the manifest itself is checked: its size (MAX_MANIFEST_BYTES), its digest
against a pin the URI may carry (`…/ka-…@sha256:<hex>`), its artifact id against the URI's and
against the digest of its own id fields (`check_derived_id`), and every value of its model config
(`checked_model_config`). A local directory URI gets the same checks and is verified in place
(sizes and sha256 of every file it lists) and returned as is: no copy.

File names come from the manifest, which `Manifest.parse` restricts to plain names of the artifact's
own files; every join below goes through `artifact_file`, which checks the name again and refuses a
symlink that leads out of the artifact. The URI's last component must be the manifest's artifact id.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.errors import KilnError
from runtime.artifact.cache_files import (
    create_fresh,
    open_own_file,
    read_own_file,
    replace_atomically,
    same_file,
    sha256_fd,
)
from runtime.artifact.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    PART_SUFFIX,
    PROGRESS_SUFFIX,
    TMP_SUFFIX,
    FileEntry,
    Manifest,
    ManifestError,
    artifact_file,
    check_derived_id,
    is_artifact_id,
    read_manifest_bytes,
    sha256_file,
)
from runtime.artifact.manifest_pin import (
    RECORD_NAME,
    check_pin,
    check_recorded,
    manifest_sha256,
    record,
    recorded,
    split_pin,
)
from runtime.artifact.model_values import checked_model_config
from runtime.artifact.s3_client import make_client
from runtime.settings import RuntimeSettings, get_settings

log = logging.getLogger(__name__)

CHUNK_SIZE = 8 << 20
WORKERS = 8
# A progress record lists the ranges written (a few KB per GB); a larger one is not ours: start over.
MAX_PROGRESS_RECORD_BYTES = 16 << 20


class PullError(KilnError):
    """The artifact could not be pulled: missing, truncated or tampered files, or storage errors."""


@dataclass
class PullProgress:
    file: str  # the file a chunk was just written to ("" for cache hits)
    bytes_done: int  # bytes of the needed files present locally so far
    bytes_total: int  # bytes of every file this pull needs
    bytes_fetched: int  # bytes downloaded by this call (0 for a cache hit)


ProgressFn = Callable[[PullProgress], None]


def needed_files(manifest: Manifest, rank: int | None) -> list[FileEntry]:
    if rank is None:
        return list(manifest.files)
    if not 0 <= rank < manifest.tp:
        raise PullError(f"rank {rank} does not exist: the artifact was sharded for tp={manifest.tp}")
    return [*manifest.rank_files(rank), *manifest.shared_files()]


def _is_published(path: Path, entry: FileEntry) -> bool:
    return path.is_file() and path.stat().st_size == entry.size


def check_sizes(artifact_dir: Path, entries: list[FileEntry]) -> None:
    """Every file present with its manifest size (cheap: no reads)."""
    for entry in entries:
        path = artifact_file(artifact_dir, entry.name)
        if not path.is_file():
            raise PullError(f"{path} is missing (the manifest lists it)")
        size = path.stat().st_size
        if size != entry.size:
            raise PullError(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or altered)")


def checked_manifest(raw: bytes, where: str, pin: str | None) -> Manifest:
    """The manifest in `raw`, refused unless it is the pinned one (when `pin`), its id is the digest
    of its own id fields, and every value of its model config is of its type and range."""
    check_pin(raw, where, pin)
    manifest = Manifest.parse(raw, where)
    check_derived_id(manifest, where)
    checked_model_config(manifest)
    return manifest


def verify_local(
    artifact_dir: Path,
    rank: int | None = None,
    progress: ProgressFn | None = None,
    *,
    workers: int = WORKERS,
    manifest_sha256: str | None = None,
) -> Manifest:
    """Check a local artifact: its manifest (`checked_manifest`; against `manifest_sha256` when
    given, and against the digest its pull recorded), then every needed file it lists: sizes, then
    sha256, hashed in parallel (hashlib releases the GIL); `progress` sees the bytes hashed."""
    raw = read_manifest_bytes(artifact_dir)
    check_recorded(artifact_dir, raw)
    manifest = checked_manifest(raw, str(artifact_dir / MANIFEST_NAME), manifest_sha256)
    entries = needed_files(manifest, rank)
    check_sizes(artifact_dir, entries)
    total = sum(e.size for e in entries)
    done = 0
    lock = threading.Lock()

    def hash_one(entry: FileEntry) -> None:
        nonlocal done
        path = artifact_file(artifact_dir, entry.name)
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise PullError(
                f"{path}: sha256 mismatch: expected {entry.sha256}, got {actual} (file altered or "
                "corrupted; pull or convert the artifact again)"
            )
        with lock:
            done += entry.size
            event = PullProgress(entry.name, done, total, 0)
        if progress is not None:
            progress(event)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kiln-verify") as pool:
        for fut in [pool.submit(hash_one, e) for e in entries]:
            fut.result()
    return manifest


def pull(
    uri: str,
    cache_dir: Path,
    rank: int | None = None,
    progress: ProgressFn | None = None,
    *,
    settings: RuntimeSettings | None = None,
    chunk_size: int = CHUNK_SIZE,
    workers: int = WORKERS,
) -> Path:
    """Local directory with the verified artifact (see the module docstring)."""
    uri, pin = split_pin(uri)
    if not uri.startswith("s3://"):
        path = Path(uri.removeprefix("file://")).expanduser()
        if not path.is_dir():
            raise PullError(
                f"{uri}: no such directory (artifact URIs are s3://bucket/prefix/<id> or a local dir)"
            )
        verify_local(path, rank, progress, workers=workers, manifest_sha256=pin)
        return path
    return _S3Pull(
        uri, Path(cache_dir), rank, progress, settings or get_settings(), chunk_size, workers, pin
    ).run()


class _S3Pull:
    def __init__(
        self,
        uri: str,
        cache_dir: Path,
        rank: int | None,
        progress: ProgressFn | None,
        settings: RuntimeSettings,
        chunk_size: int,
        workers: int,
        pin: str | None,
    ) -> None:
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        prefix = prefix.strip("/")
        if not bucket or not prefix:
            raise PullError(f"{uri}: expected s3://bucket/prefix/<artifact_id>")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix
        self.artifact_id = prefix.rsplit("/", 1)[-1]
        if not is_artifact_id(self.artifact_id) or ".." in prefix.split("/"):
            raise PullError(
                f"{uri}: expected s3://bucket/prefix/<artifact_id> ending in an artifact id "
                "(ka-<32 hex digits>), without '..' segments"
            )
        self.dest = cache_dir / self.artifact_id
        self.rank = rank
        self.progress = progress
        self.settings = settings
        self.chunk_size = chunk_size
        self.workers = workers
        self.pin = pin
        self._recorded = False  # this pull wrote the manifest's digest record
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._fetched = 0

    def _client(self) -> Any:
        return make_client(self.settings, max_pool_connections=max(10, self.workers * 2))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _report(self, file: str, written: int) -> None:
        with self._lock:
            self._done += written
            self._fetched += written
            event = PullProgress(file, self._done, self._total, self._fetched)
        if self.progress is not None:
            self.progress(event)

    def _cached(self) -> bool:
        if not (self.dest / MANIFEST_NAME).is_file():
            return False
        try:
            raw = read_manifest_bytes(self.dest)
            check_recorded(self.dest, raw)
            check_pin(raw, str(self.dest / MANIFEST_NAME), self.pin)
            manifest = Manifest.parse(raw, str(self.dest / MANIFEST_NAME))
        except ManifestError as e:
            log.warning("%s: not using the cached copy: %s", self.uri, e)
            return False
        entries = needed_files(manifest, self.rank)
        if not all(_is_published(artifact_file(self.dest, e.name), e) for e in entries):
            return False
        if self.progress is not None:
            total = sum(e.size for e in entries)
            self.progress(PullProgress("", total, total, 0))
        return True

    def run(self) -> Path:
        if self._cached():
            log.info("%s: already in the cache at %s", self.uri, self.dest)
            return self.dest
        from botocore.exceptions import BotoCoreError, ClientError

        client = self._client()
        try:
            # Read no more than the limit: Manifest.parse refuses a larger manifest unparsed.
            body = client.get_object(Bucket=self.bucket, Key=self._key(MANIFEST_NAME))["Body"]
            raw = body.read(MAX_MANIFEST_BYTES + 1)
            body.close()
        except (ClientError, BotoCoreError) as e:
            raise PullError(
                f"{self.uri}: cannot read {MANIFEST_NAME} ({e}); is this a committed artifact?"
            ) from e
        manifest = checked_manifest(raw, f"{self.uri}/{MANIFEST_NAME}", self.pin)
        if manifest.artifact_id != self.artifact_id:
            raise PullError(
                f"{self.uri}: its manifest describes artifact {manifest.artifact_id}, not "
                f"{self.artifact_id}; artifacts are stored under their own id — pull "
                f"s3://{self.bucket}/.../{manifest.artifact_id} or re-upload it under that id"
            )
        entries = needed_files(manifest, self.rank)
        created = not self.dest.exists()
        try:
            self.dest.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._cache_write_error(e) from e
        self._total = sum(e.size for e in entries)
        todo = []
        for entry in entries:
            if _is_published(artifact_file(self.dest, entry.name), entry):
                self._done += entry.size
            else:
                todo.append(entry)
        try:
            self._fetch_all(client, todo)
            if recorded(self.dest) != manifest_sha256(raw):
                self._recorded = True
                record(self.dest, raw)
            replace_atomically(self.dest / MANIFEST_NAME, raw)
        except (ClientError, BotoCoreError) as e:
            raise PullError(f"{self.uri}: download failed ({e}); run the pull again to resume") from e
        except OSError as e:
            if isinstance(e, ConnectionError | TimeoutError):
                raise
            self._undo(todo, created)
            raise self._cache_write_error(e) from e
        log.info("%s: pulled %d file(s) into %s", self.uri, len(todo), self.dest)
        return self.dest

    def _cache_write_error(self, e: OSError) -> PullError:
        return PullError(
            f"{self.uri}: cannot write into the cache at {self.dest} ({e.strerror or e}); nothing was "
            "published and this pull's partial files were removed. Free space on that filesystem (or "
            "make it writable), or set KILN_CACHE_DIR to another one, then pull again"
        )

    def _undo(self, entries: list[FileEntry], created: bool) -> None:
        """A local I/O fault (disk full, read-only, EIO): remove what this pull wrote, so that the
        cache holds what it held before (the files it fetched were not published before it)."""
        for entry in entries:
            final = artifact_file(self.dest, entry.name)
            for path in (
                final,
                final.with_name(final.name + PART_SUFFIX),
                final.with_name(final.name + PROGRESS_SUFFIX),
                final.with_name(final.name + PROGRESS_SUFFIX + TMP_SUFFIX),
            ):
                try:
                    path.unlink(missing_ok=True)
                except OSError as err:
                    log.warning("%s: could not remove %s (%s)", self.uri, path, err)
        try:
            (self.dest / (MANIFEST_NAME + TMP_SUFFIX)).unlink(missing_ok=True)
            (self.dest / (RECORD_NAME + TMP_SUFFIX)).unlink(missing_ok=True)
            if self._recorded:
                (self.dest / RECORD_NAME).unlink(missing_ok=True)
            if created:
                self.dest.rmdir()  # only if empty: a concurrent rank's files stay
        except OSError:
            pass

    def _fetch_all(self, client: Any, entries: list[FileEntry]) -> None:
        if not entries:
            return
        files = [_PartFile(self.dest, e, self.chunk_size) for e in entries]
        for f in files:
            self._done += f.bytes_present()
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kiln-pull")
        try:
            futures = [
                pool.submit(self._fetch_chunk, client, f, i) for f in files for i in f.missing_chunks()
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for fut in done:
                fut.result()  # re-raise the first failure
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            for f in files:
                f.close()
                if f.failed:  # a permanent fault of the stored object: keep nothing of it
                    f.discard()
            raise
        pool.shutdown(wait=True)
        errors: list[PullError] = []
        for f in files:
            try:
                f.publish()
            except PullError as e:
                errors.append(e)
        if errors:
            raise PullError("; ".join(str(e) for e in errors))

    def _fetch_chunk(self, client: Any, part: _PartFile, index: int) -> None:
        start, end = part.chunk_range(index)
        name = part.entry.name
        try:
            resp = client.get_object(
                Bucket=self.bucket, Key=self._key(name), Range=f"bytes={start}-{end - 1}"
            )
        except Exception as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            if code == "InvalidRange":
                part.failed = True
                raise PullError(
                    f"{name}: the stored object is shorter than the {part.entry.size} bytes "
                    "the manifest says (truncated); nothing was published"
                ) from e
            raise
        data = resp["Body"].read()
        if len(data) != end - start:
            part.failed = True
            raise PullError(
                f"{name}: got {len(data)} bytes for range {start}-{end - 1}, expected {end - start}: "
                f"the stored object does not have the manifest's {part.entry.size} bytes (truncated); "
                "nothing was published"
            )
        part.write(index, start, data)
        self._report(name, len(data))


class _PartFile:
    """`<name>.part` being filled by ranges, with its progress record `<name>.part.progress`.

    Both are this pull's own files (runtime/artifact/cache_files.py): created fresh, and a `.part`
    left by an interrupted pull is resumed only when it is a regular file with a single link."""

    def __init__(self, dest: Path, entry: FileEntry, chunk_size: int) -> None:
        self.entry = entry
        self.final = artifact_file(dest, entry.name)
        self.part = self.final.with_name(self.final.name + PART_SUFFIX)
        self.record = self.final.with_name(self.final.name + PROGRESS_SUFFIX)
        self.chunk_size = chunk_size
        self.num_chunks = -(-entry.size // chunk_size)
        self.done: set[int] = set()
        self.failed = False
        self._lock = threading.Lock()
        state = self._read_record()
        fd = None
        if (
            state is not None
            and state.get("sha256") == entry.sha256
            and state.get("size") == entry.size
            and state.get("chunk_size") == chunk_size
        ):
            fd = open_own_file(self.part, os.O_RDWR)
        if fd is not None and os.fstat(fd).st_size == entry.size:
            done = state.get("done")
            listed = done if isinstance(done, list) else []
            self.done = {i for i in listed if isinstance(i, int) and 0 <= i < self.num_chunks}
            log.info(
                "%s: resuming, %d of %d ranges already present", entry.name, len(self.done), self.num_chunks
            )
        else:
            if fd is not None:
                os.close(fd)
            fd = create_fresh(self.part)
            try:
                os.ftruncate(fd, entry.size)
            except OSError:
                os.close(fd)
                raise
            self._save()
        self._fd = fd

    def _read_record(self) -> dict[str, Any] | None:
        raw = read_own_file(self.record, MAX_PROGRESS_RECORD_BYTES)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def _save(self) -> None:
        state = {
            "sha256": self.entry.sha256,
            "size": self.entry.size,
            "chunk_size": self.chunk_size,
            "done": sorted(self.done),
        }
        replace_atomically(self.record, json.dumps(state).encode())

    def bytes_present(self) -> int:
        return sum(e - s for s, e in map(self.chunk_range, self.done))

    def missing_chunks(self) -> list[int]:
        return [i for i in range(self.num_chunks) if i not in self.done]

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.entry.size)

    def write(self, index: int, offset: int, data: bytes) -> None:
        os.pwrite(self._fd, data, offset)
        with self._lock:
            self.done.add(index)
            self._save()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)
        self.record.unlink(missing_ok=True)

    def publish(self) -> None:
        """Hash what this pull wrote (through its own descriptor) and rename it into place when the
        sha256 is the manifest's and the `.part` path still names that file."""
        try:
            actual = sha256_fd(self._fd)
            intact = same_file(self._fd, self.part)
        finally:
            self.close()
        if actual != self.entry.sha256 or not intact:
            self.discard()
            found = f"got {actual}" if intact else f"{self.part.name} was replaced during the pull"
            raise PullError(
                f"{self.entry.name}: sha256 mismatch: expected {self.entry.sha256}, {found} — "
                "the stored file was altered or corrupted; it was not published "
                "(re-convert or re-upload the artifact)"
            )
        os.replace(self.part, self.final)
        self.record.unlink(missing_ok=True)
