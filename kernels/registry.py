"""Kernel registry: an ordered priority list per target, plus third-party kernels from entry points.

`choose_kernel(spec, target)` walks the target's list, skips disabled kernels and those whose
`can_implement` says no, and returns the first that fits with every rejection recorded — or raises
one `NoKernelError` naming them all (vLLM's `choose_mp_linear_kernel` idea).

Third-party kernels register without touching Kiln: a distribution declares
``[project.entry-points."kiln.kernels"] my_kernel = "my_pkg.kernel:MyKernel"`` (a `LinearKernel`
subclass or instance); such kernels are tried ahead of the built-ins on every target and their own
`can_implement` decides where they apply. Adding a built-in kernel = one file + one line below.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from functools import cache
from importlib.metadata import entry_points

from kernels.base import KernelChoice, LinearKernel, LinearSpec, Target
from kernels.errors import KilnError, NoKernelError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kiln.kernels"

# name -> "module:Class" (imported lazily so importing the registry never pulls in Triton).
BUILTIN_KERNELS: dict[str, str] = {
    "fp8_w8a8": "kernels.fp8_w8a8:Fp8W8A8Kernel",
    "marlin_wna16": "kernels.marlin_wna16:MarlinWNA16Kernel",
    "fp8_marlin": "kernels.fp8_marlin:Fp8MarlinKernel",
    "fp8_w8a16": "kernels.fp8_w8a16:Fp8W8A16Kernel",
    "gptq_wna16": "kernels.gptq_wna16:GptqWNA16Kernel",
    "cpu_int4": "kernels.cpu_int4:CpuInt4Kernel",
    "cpu_int8": "kernels.cpu_int8:CpuInt8Kernel",
    "cpu_fp8": "kernels.cpu_fp8:CpuFp8Kernel",
    "dense": "kernels.dense:DenseKernel",
}

# Ordered by preference; each kernel's can_implement filters by scheme and shape.
PRIORITY: dict[Target, tuple[str, ...]] = {
    Target.SM90: ("fp8_w8a8", "marlin_wna16", "gptq_wna16", "fp8_marlin", "fp8_w8a16", "dense"),
    Target.SM89: ("fp8_w8a8", "marlin_wna16", "gptq_wna16", "fp8_marlin", "fp8_w8a16", "dense"),
    Target.SM86: ("marlin_wna16", "gptq_wna16", "fp8_marlin", "fp8_w8a16", "dense"),
    Target.SM80: ("marlin_wna16", "gptq_wna16", "fp8_marlin", "fp8_w8a16", "dense"),
    Target.SM75: ("gptq_wna16", "fp8_w8a16", "dense"),
    Target.CPU: ("cpu_int4", "cpu_int8", "cpu_fp8", "dense"),
}


def _instantiate(obj: object, where: str) -> LinearKernel:
    kernel = obj() if isinstance(obj, type) else obj
    if not isinstance(kernel, LinearKernel):
        raise KilnError(f"{where} is not a kernels.base.LinearKernel (got {type(kernel).__name__})")
    return kernel


@cache
def builtin_kernel(name: str) -> LinearKernel:
    module_name, _, attr = BUILTIN_KERNELS[name].partition(":")
    return _instantiate(getattr(importlib.import_module(module_name), attr), BUILTIN_KERNELS[name])


@cache
def external_kernels() -> tuple[LinearKernel, ...]:
    """Kernels registered by installed distributions under the `kiln.kernels` entry-point group."""
    found: list[LinearKernel] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        kernel = _instantiate(ep.load(), f"entry point {ep.name} = {ep.value}")
        if kernel.name in BUILTIN_KERNELS:
            raise KilnError(f"entry point {ep.value} reuses the built-in kernel name {kernel.name!r}")
        log.info("registered third-party kernel %s from %s", kernel.name, ep.value)
        found.append(kernel)
    return tuple(found)


def get_kernel(name: str) -> LinearKernel:
    """The kernel an artifact names (built-in or third-party); unknown names are a clear error."""
    if name in BUILTIN_KERNELS:
        return builtin_kernel(name)
    for kernel in external_kernels():
        if kernel.name == name:
            return kernel
    known = sorted([*BUILTIN_KERNELS, *(k.name for k in external_kernels())])
    raise KilnError(f"unknown kernel {name!r}; known kernels: {', '.join(known)} (is its package installed?)")


def candidates(target: Target) -> list[LinearKernel]:
    """Third-party kernels first, then the built-in priority list for the target."""
    return [*external_kernels(), *(builtin_kernel(n) for n in PRIORITY[target])]


def choose_kernel(spec: LinearSpec, target: Target | str, disabled: Iterable[str] = ()) -> KernelChoice:
    """First kernel in the target's priority list that can implement `spec`, with every rejection."""
    target = Target(target)
    disabled_set = set(disabled)
    rejected: list[tuple[str, str]] = []
    for kernel in candidates(target):
        if kernel.name in disabled_set:
            rejected.append((kernel.name, "disabled by KILN_DISABLED_KERNELS"))
            continue
        ok, reason = kernel.can_implement(spec, target)
        if ok:
            return KernelChoice(kernel=kernel, rejected=rejected)
        rejected.append((kernel.name, reason))
    raise NoKernelError(spec.name, target.value, rejected)
