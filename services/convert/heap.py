"""Hand freed heap back to the OS between units and between a unit's phases (glibc only; elsewhere a
no-op).

A conversion frees multi-MB tensors unit after unit; glibc raises its mmap threshold as they are
freed, so later ones come from heap arenas it keeps (one per thread that decoded or packed a block):
RSS then grows by each layer's temporaries although nothing is held (measured with
bench/convert.py --gguf-only: SmolLM2's GGUF peaked 848 MB above its start without this, 340 MB with
it after every unit). Trimming after reading + decoding and after the layout prep keeps one phase's
leftovers out of the next one's peak."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is None:
        log.debug("malloc_trim is not available (not glibc): freed heap stays with the process")
    return trim


def release_freed_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
