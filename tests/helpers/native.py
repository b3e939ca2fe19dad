"""Running a native library's test on each of its instruction-set bodies."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kernels.cpu_features import isa_level


def each_body(set_level: Callable[[int], int], names: tuple[str, ...], name: str) -> Iterator[str]:
    """Cap the library at body `name` (its index in `names`; `set_level(cap)` returns the body in use)
    for one test, skipped when this CPU does not run it; back at KILN_CPU_ISA's cap
    afterwards."""
    want = names.index(name)
    if set_level(want) != want:
        set_level(isa_level())
        pytest.skip(f"this CPU has no {name}")
    yield name
    set_level(isa_level())
