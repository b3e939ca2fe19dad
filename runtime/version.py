"""The installed Kiln version (recorded in manifests, answered by `kiln serve`'s /version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kiln_version() -> str:
    try:
        return version("kiln")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"
