"""The storage interfaces: where artifacts are written (ArtifactStore) and checkpoints read (SourceReader).

An artifact is written through an `ArtifactWriter`: files are staged out of sight, and `commit`
writes `manifest.json` last, which makes the artifact visible under `{store}/{artifact_id}/`
atomically (local: a directory rename; S3: the manifest object is the commit point). `abort`
removes everything staged, so a failed conversion leaves nothing visible. What a killed writer
staged stays behind, out of sight: `discard_staged` removes it once its artifact is committed, and
`sweep_staging` removes staging older than any live writer can be.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from pathlib import Path

HASH_CHUNK = 8 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ArtifactWriter(ABC):
    """Stages one artifact's files; nothing is visible until `commit`."""

    @abstractmethod
    def put_file(
        self, name: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> tuple[int, str]:
        """Stage a local file under `name`; returns (size, sha256). `move` may consume `path`;
        `sha256`, when the caller already computed it while writing the file, skips re-hashing."""

    @abstractmethod
    def put_bytes(self, name: str, data: bytes) -> tuple[int, str]:
        """Stage bytes under `name`; returns (size, sha256)."""

    @abstractmethod
    def commit(self, manifest_bytes: bytes) -> None:
        """Write manifest.json last and publish; raises ArtifactExistsError if already committed."""

    @abstractmethod
    def abort(self) -> None:
        """Remove everything staged (idempotent)."""


class ArtifactStore(ABC):
    """A local directory or an S3 prefix holding committed artifacts `{root}/{artifact_id}/`."""

    @abstractmethod
    def uri(self, aid: str) -> str: ...

    @abstractmethod
    def exists(self, aid: str) -> bool:
        """True when the artifact is committed (its manifest.json exists)."""

    @abstractmethod
    def begin(self, aid: str) -> ArtifactWriter: ...

    @abstractmethod
    def read_manifest(self, aid: str) -> bytes: ...

    @abstractmethod
    def presigned_urls(self, aid: str) -> dict[str, str]:
        """name -> URL for every file of a committed artifact (incl. manifest.json)."""

    @abstractmethod
    def delete(self, aid: str) -> None:
        """Remove an artifact: the manifest first (un-commit), then its files."""

    @abstractmethod
    def list_ids(self) -> list[str]:
        """Ids of committed artifacts, sorted."""

    @abstractmethod
    def discard_staged(self, aid: str) -> int:
        """Remove what earlier (dead) writers staged for `aid`; returns how many items were removed."""

    @abstractmethod
    def sweep_staging(self, older_than_s: float) -> int:
        """Remove staging left by writers that died or lost the store, untouched for `older_than_s`
        seconds (no live writer stages for longer than a job's hard time limit); returns how many
        items were removed."""


class SourceReader(ABC):
    """Read access to a checkpoint: a local directory or an S3 prefix. Names are relative paths."""

    uri: str

    @abstractmethod
    def list(self) -> list[str]:
        """File names under the source, sorted: at least every file directly in it (a checkpoint's
        config, index, weights and side files). Files in subfolders are read by name."""

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file."""

    def local_path(self, name: str) -> Path | None:
        """A local filesystem path for the file when it has one (enables memory mapping)."""
        return None

    def exists(self, name: str) -> bool:
        return name in set(self.list())

    def read_bytes(self, name: str) -> bytes:
        return self.read_range(name, 0, self.size(name))

    def sha256(self, name: str) -> str:
        """sha256 of a file, streamed in chunks (bounded memory)."""
        h = hashlib.sha256()
        total = self.size(name)
        for start in range(0, total, HASH_CHUNK):
            h.update(self.read_range(name, start, min(total, start + HASH_CHUNK)))
        return h.hexdigest()
