"""Validation of artifact ids and object names, so no key can escape its store prefix."""

from __future__ import annotations

import re

from services.storage.errors import StorageError

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_artifact_id(aid: str) -> str:
    """An artifact id is one path component: letters, digits, '.', '_', '-', never '..'."""
    if not isinstance(aid, str) or not _ID_RE.fullmatch(aid) or ".." in aid:
        raise StorageError(f"invalid artifact id {aid!r}: use letters, digits, '.', '_' and '-' only")
    return aid


def check_name(name: str) -> str:
    """A relative POSIX path inside an artifact or source: no '..', no absolute path, no NUL."""
    bad = (
        not isinstance(name, str)
        or not name
        or "\0" in name
        or "\\" in name
        or name.startswith("/")
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise StorageError(f"invalid file name {name!r}: must be a relative path without '..', '\\\\' or NUL")
    return name


def join_prefix(prefix: str, *parts: str) -> str:
    """S3 key from a (possibly empty) prefix and validated parts."""
    cleaned = [p for p in (prefix.strip("/"), *parts) if p]
    return "/".join(cleaned)
