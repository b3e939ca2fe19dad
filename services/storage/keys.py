"""Validation of artifact ids and object names, so no key can escape its store prefix."""

from __future__ import annotations

import re
from pathlib import Path

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


def allowed_roots(root: Path) -> list[Path]:
    """Where files of the checkpoint directory `root` may live once symlinks are resolved: the
    directory itself and, for a Hugging Face hub cache snapshot (`models--x/snapshots/<rev>`, whose
    files are symlinks to `../../blobs/<sha>`), that repository's `blobs` directory."""
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def resolve_inside(root: Path, name: str) -> Path:
    """`root / name` with symlinks resolved, refused (StorageError) when it lies outside `root`.

    `root` must already be resolved. A missing file resolves to its own (inside) path."""
    try:
        path = (root / check_name(name)).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise StorageError(f"{root / name} cannot be resolved ({e}); remove the broken symlink") from e
    if not any(path.is_relative_to(r) for r in allowed_roots(root)):
        raise StorageError(
            f"{root / name} resolves to {path}, outside the checkpoint directory {root}: "
            "symlinks may not point out of it; copy the file into the directory instead"
        )
    return path
