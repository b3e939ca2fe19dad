"""The pull cache's own files (`<name>.part`, `<name>.part.progress`, `*.tmp`), opened so that nothing
planted at their paths is followed or reused.

Anyone who can write into the cache directory can leave a symlink or a hard link where a pull is
about to write. A new file is therefore always created fresh: whatever is at the path is unlinked
(which removes a link, never its target) and the file is created with O_CREAT | O_EXCL |
O_NOFOLLOW, so the open fails rather than follow or reuse anything that reappears in between. A
file kept from an interrupted pull is reused only when it is a regular file with one link, opened
without following a symlink.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_HASH_BLOCK = 8 << 20


def create_fresh(path: Path, mode: int = 0o644) -> int:
    """A descriptor (read-write) of a new, empty regular file at `path`."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_RDWR | _CREATE, mode)


def write_fresh(path: Path, data: bytes) -> None:
    fd = create_fresh(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data`, written to a fresh `<path>.tmp` first and renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    write_fresh(tmp, data)
    os.replace(tmp, path)


def open_own_file(path: Path, flags: int) -> int | None:
    """A descriptor of the file at `path` when it is a regular file with a single link (not a
    symlink: O_NOFOLLOW); None when there is none or it is anything else."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        return None
    return fd


def read_own_file(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of the file at `path` (see `open_own_file`), or None when it is not one, or larger
    than `max_bytes`."""
    fd = open_own_file(path, os.O_RDONLY)
    if fd is None:
        return None
    try:
        blocks, total = [], 0
        while block := os.read(fd, 1 << 20):
            blocks.append(block)
            total += len(block)
            if total > max_bytes:
                return None
        return b"".join(blocks)
    finally:
        os.close(fd)


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` (not followed) is still the file `fd` refers to."""
    try:
        at_path = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino)


def sha256_fd(fd: int) -> str:
    """sha256 of the whole file behind `fd`, read with pread (the offset is left alone)."""
    h = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, _HASH_BLOCK, offset):
        h.update(block)
        offset += len(block)
    return h.hexdigest()
