"""Local directory store (the embedded default) and local checkpoint sources.

Layout: committed artifacts at `{root}/{id}/`; a writer stages under `{root}/.staging/{id}-{random}/`
and publishes with one `rename` after writing manifest.json, so readers never see partial files.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

from runtime.artifact.manifest import MANIFEST_NAME
from services.storage.base import HASH_CHUNK, ArtifactStore, ArtifactWriter, SourceReader
from services.storage.errors import ArtifactExistsError, NotFoundError, StorageError
from services.storage.keys import check_artifact_id, check_name, resolve_inside

STAGING_DIR = ".staging"


def _hash_file(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(HASH_CHUNK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalWriter(ArtifactWriter):
    def __init__(self, root: Path, aid: str) -> None:
        self.root = root
        self.aid = aid
        self.staging = root / STAGING_DIR / f"{aid}-{secrets.token_hex(6)}"
        self.staging.mkdir(parents=True)
        self._done = False

    def _dest(self, name: str) -> Path:
        check_name(name)
        if name == MANIFEST_NAME:
            raise StorageError("manifest.json is written by commit(), not put_*")
        dest = self.staging / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest

    def put_file(
        self, name: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> tuple[int, str]:
        dest = self._dest(name)
        if move:
            size, digest = (path.stat().st_size, sha256) if sha256 else _hash_file(path)
            try:
                os.replace(path, dest)
                return size, digest
            except OSError:  # another filesystem: fall back to copying
                pass
        h = hashlib.sha256()
        size = 0
        with path.open("rb") as src, dest.open("wb") as out:
            while block := src.read(HASH_CHUNK):
                h.update(block)
                out.write(block)
                size += len(block)
        return size, h.hexdigest()

    def put_bytes(self, name: str, data: bytes) -> tuple[int, str]:
        self._dest(name).write_bytes(data)
        return len(data), hashlib.sha256(data).hexdigest()

    def commit(self, manifest_bytes: bytes) -> None:
        final = self.root / self.aid
        manifest = self.staging / MANIFEST_NAME
        manifest.write_bytes(manifest_bytes)
        with manifest.open("rb") as f:
            os.fsync(f.fileno())
        if (final / MANIFEST_NAME).exists():
            self.abort()
            raise ArtifactExistsError(f"artifact {self.aid} is already committed at {final}")
        if final.exists():  # no manifest: the remains of an interrupted delete, never a commit
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(self.staging, final)  # atomic; fails if `final` exists and is not empty
        except OSError as e:
            self.abort()
            raise ArtifactExistsError(f"artifact {self.aid} is already committed at {final} ({e})") from e
        _fsync_dir(self.root)
        self._done = True

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._done = True


class LocalStore(ArtifactStore):
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, aid: str) -> Path:
        return self.root / check_artifact_id(aid)

    def uri(self, aid: str) -> str:
        return str(self._dir(aid))

    def exists(self, aid: str) -> bool:
        return (self._dir(aid) / MANIFEST_NAME).is_file()

    def begin(self, aid: str) -> LocalWriter:
        return LocalWriter(self.root, check_artifact_id(aid))

    def read_manifest(self, aid: str) -> bytes:
        path = self._dir(aid) / MANIFEST_NAME
        if not path.is_file():
            raise NotFoundError(f"artifact {aid} not found in {self.root}")
        return path.read_bytes()

    def presigned_urls(self, aid: str) -> dict[str, str]:
        d = self._dir(aid)
        if not (d / MANIFEST_NAME).is_file():
            raise NotFoundError(f"artifact {aid} not found in {self.root}")
        return {p.relative_to(d).as_posix(): p.as_uri() for p in sorted(d.rglob("*")) if p.is_file()}

    def delete(self, aid: str) -> None:
        d = self._dir(aid)
        if not d.exists():
            raise NotFoundError(f"artifact {aid} not found in {self.root}")
        (d / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)

    def list_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST_NAME).is_file())

    def discard_staged(self, aid: str) -> int:
        """Remove what earlier (dead) writers staged for `aid`; returns how many entries were removed."""
        check_artifact_id(aid)
        gone = [e for e in self.staging_entries() if e.name.startswith(f"{aid}-")]
        for entry in gone:
            shutil.rmtree(entry, ignore_errors=True)
        return len(gone)

    def sweep_staging(self, older_than_s: float) -> int:
        """No age-based sweep for a local store: its staging directory is shared with writers that
        have no time limit (`kiln convert`, the embedded worker), so age does not prove a writer
        dead. A dead writer's staging is removed by `discard_staged` when its artifact is committed."""
        return 0

    def staging_entries(self) -> list[Path]:
        """Leftover staging directories (for tests and cleanup tools)."""
        staging = self.root / STAGING_DIR
        return sorted(staging.iterdir()) if staging.is_dir() else []


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # unreadable entries (e.g. /proc/1/cwd) are not checkpoint files
        return False


class LocalSource(SourceReader):
    """A checkpoint directory on the local filesystem."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise NotFoundError(f"checkpoint directory {self.root} does not exist")
        self.uri = str(self.root)

    def _path(self, name: str) -> Path:
        return resolve_inside(self.root, name)

    def list(self) -> list[str]:
        """The visible files directly in the directory: a checkpoint keeps its config, index and weights
        there, and walking subfolders could mean walking a whole filesystem (source "/")."""
        try:
            entries = list(self.root.iterdir())
        except OSError as e:
            raise StorageError(f"checkpoint directory {self.root} cannot be listed: {e.strerror}") from e
        return sorted(p.name for p in entries if not p.name.startswith(".") and _is_file(p))

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def size(self, name: str) -> int:
        try:
            return self._path(name).stat().st_size
        except FileNotFoundError as e:
            raise NotFoundError(f"{self.root / name} not found") from e

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with self._path(name).open("rb") as f:
            f.seek(start)
            return f.read(end - start)

    def local_path(self, name: str) -> Path:
        return self._path(name)

    def sha256(self, name: str) -> str:
        return _hash_file(self._path(name))[1]
