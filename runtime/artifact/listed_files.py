"""The small files an artifact carries besides its rank files (tokenizer files, chat template,
generation_config.json), read only when the manifest lists them, and then checked against it.

A file the manifest does not list is never read, whatever lies in the directory: an artifact is
what its manifest says. A listed file is read whole (they are small: MAX_LISTED_FILE_BYTES), and its
size and sha256 are checked against the manifest on every load, so the bytes used are the bytes
verified — a chat template or a generation config edited in place is refused, not rendered.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from kernels.errors import KilnError
from runtime.artifact.manifest import FileEntry, Manifest, artifact_file

# The largest tokenizer.json files (vocabularies of ≈250k tokens) are ≈30 MB.
MAX_LISTED_FILE_BYTES = 128 << 20
ARTIFACT_FIX = "pull the artifact again or re-convert it"


class ListedFileError(KilnError):
    """A file the manifest lists (tokenizer, chat template, generation config) is missing, altered or
    malformed."""


class ListedFiles:
    """The files every rank shares (`rank: null` in the manifest) of one artifact directory."""

    def __init__(self, artifact_dir: Path, manifest: Manifest) -> None:
        self.artifact_dir = Path(artifact_dir)
        self.entries: dict[str, FileEntry] = {f.name: f for f in manifest.shared_files()}

    def listed(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> bytes | None:
        """The bytes of `name` when the manifest lists it (None when it does not), checked against
        the manifest's size and sha256."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        path = artifact_file(self.artifact_dir, name)
        if entry.size > MAX_LISTED_FILE_BYTES:
            raise ListedFileError(
                f"{path}: the manifest gives it {entry.size} bytes, over the {MAX_LISTED_FILE_BYTES}-byte "
                "limit of a tokenizer or config file (runtime/artifact/listed_files.py); " + ARTIFACT_FIX
            )
        try:
            data = _read_regular_file(path, MAX_LISTED_FILE_BYTES)
        except FileNotFoundError as e:
            raise ListedFileError(f"{path} is missing (the manifest lists it); {ARTIFACT_FIX}") from e
        except OSError as e:
            raise ListedFileError(f"{path}: cannot be read ({e.strerror or e}); {ARTIFACT_FIX}") from e
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry.size or digest != entry.sha256:
            raise ListedFileError(
                f"{path}: {len(data)} bytes with sha256 {digest}, the manifest lists {entry.size} bytes "
                f"with sha256 {entry.sha256}: the file was altered; {ARTIFACT_FIX}"
            )
        return data

    def text(self, name: str) -> str | None:
        data = self.read(name)
        if data is None:
            return None
        try:
            return data.decode()
        except UnicodeDecodeError as e:
            raise ListedFileError(f"{self.artifact_dir / name}: not UTF-8 text ({e}); {ARTIFACT_FIX}") from e

    def json_object(self, name: str) -> dict[str, Any] | None:
        """The JSON object in `name` (None when unlisted); ListedFileError when it is not one."""
        text = self.text(name)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ListedFileError(
                f"{self.artifact_dir / name}: not valid JSON ({str(e)[:200]}); {ARTIFACT_FIX}"
            ) from e
        if not isinstance(value, dict):
            raise ListedFileError(
                f"{self.artifact_dir / name}: expected a JSON object, got {type(value).__name__}; "
                + ARTIFACT_FIX
            )
        return value

    def copy_into(self, directory: Path) -> None:
        """Write every listed shared file, checked, into `directory` (for libraries that read a
        directory themselves: they then see only what the manifest lists)."""
        for name in self.entries:
            data = self.read(name)
            assert data is not None
            (directory / name).write_bytes(data)


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    """Up to `max_bytes` + 1 bytes of `path`, which must be a regular file (a FIFO or a device in
    its place would block or never end): opened without blocking, checked before reading."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(max_bytes + 1)
    finally:
        os.close(fd)
