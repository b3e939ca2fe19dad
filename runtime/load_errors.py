"""The error an artifact that does not match its manifest or its model raises while it is opened."""

from __future__ import annotations

from kernels.errors import KilnError

ARTIFACT_FIX = "the artifact is corrupt: delete it from the cache and pull it again, or re-convert"


class LoadError(KilnError):
    """The artifact's files do not match its manifest or the model it describes."""
