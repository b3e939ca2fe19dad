"""Storage errors (KilnError family)."""

from __future__ import annotations

from kernels.errors import KilnError


class StorageError(KilnError):
    """An artifact store or checkpoint source failed or was given an invalid key."""


class ArtifactExistsError(StorageError):
    """Another writer committed the same artifact id first; the committed artifact is kept."""


class NotFoundError(StorageError):
    """The artifact, object or file does not exist."""
