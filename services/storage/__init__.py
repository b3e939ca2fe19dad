"""Artifact stores (local directory, S3) and checkpoint sources (local directory, S3 prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.settings import get_settings
from services.storage.base import ArtifactStore, ArtifactWriter, SourceReader
from services.storage.errors import ArtifactExistsError, NotFoundError, StorageError

if TYPE_CHECKING:
    from runtime.settings import RuntimeSettings
    from services.settings import ServiceSettings

__all__ = [
    "ArtifactExistsError",
    "ArtifactStore",
    "ArtifactWriter",
    "NotFoundError",
    "SourceReader",
    "StorageError",
    "open_source",
    "open_store",
]


def open_store(url: str, settings: ServiceSettings | None = None) -> ArtifactStore:
    """`s3://bucket/prefix` -> S3Store; anything else is a local directory (created if missing).
    An S3 store reads its client settings from `settings` (None: the process's settings)."""
    if url.startswith("s3://"):
        from services.storage.s3 import S3Store

        return S3Store(url, settings or get_settings())
    from services.storage.local import LocalStore

    return LocalStore(url.removeprefix("file://"))


def open_source(uri: str, settings: RuntimeSettings | None = None) -> SourceReader:
    """`s3://bucket/prefix` -> S3Source (ranged GETs); anything else is a local checkpoint directory.
    An S3 source reads its client settings from `settings` (None: the process's settings)."""
    if uri.startswith("s3://"):
        from services.storage.s3 import S3Source

        return S3Source(uri, settings or get_settings())
    from services.storage.local import LocalSource

    return LocalSource(uri.removeprefix("file://"))
