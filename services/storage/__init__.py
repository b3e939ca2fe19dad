"""Artifact stores (local directory, S3) and checkpoint sources (local directory, S3 prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.storage.base import ArtifactStore, ArtifactWriter, SourceReader
from services.storage.errors import ArtifactExistsError, NotFoundError, StorageError

if TYPE_CHECKING:
    from runtime.settings import Settings

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


def _settings(settings: Settings | None) -> Settings:
    if settings is not None:
        return settings
    from runtime.settings import Settings

    return Settings()


def open_store(url: str, settings: Settings | None = None) -> ArtifactStore:
    """`s3://bucket/prefix` -> S3Store; anything else is a local directory (created if missing)."""
    if url.startswith("s3://"):
        from services.storage.s3 import S3Store

        return S3Store(url, _settings(settings))
    from services.storage.local import LocalStore

    return LocalStore(url.removeprefix("file://"))


def open_source(uri: str, settings: Settings | None = None) -> SourceReader:
    """`s3://bucket/prefix` -> S3Source (ranged GETs); anything else is a local checkpoint directory."""
    if uri.startswith("s3://"):
        from services.storage.s3 import S3Source

        return S3Source(uri, _settings(settings))
    from services.storage.local import LocalSource

    return LocalSource(uri.removeprefix("file://"))
