"""Peak resident memory of this process, as the benchmarks and memory tests report it.

`getrusage(RUSAGE_SELF).ru_maxrss` survives `execve` on Linux: a child started by fork + exec
inherits the parent's peak at fork time, so a large test or benchmark process makes every child it
starts look as large as itself. The kernel's per-address-space high-water mark (`VmHWM` in
/proc/self/status) starts afresh at exec; it is used where it exists.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def peak_rss_bytes() -> int:
    """Highest resident set size of this process since it was exec'd, in bytes."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (0 where /proc is missing)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
