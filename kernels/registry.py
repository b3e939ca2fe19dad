"""Kernel registry: one ordered list of the built-in kernels, plus third-party kernels from entry points.

Each kernel declares the targets it runs on (`LinearKernel.targets`); a target's priority list is
`KERNELS` in order, filtered by those declarations (`PRIORITY`). `choose_kernel(spec, target)` walks
it, skips disabled kernels and those whose `can_implement` says no, and returns the first that fits
with every rejection recorded and whether the layer fell back because of its shape — or raises one
`NoKernelError` naming them all (vLLM's `choose_mp_linear_kernel` idea). `choose_moe_kernel` does the
same for expert groups.

Third-party kernels register without touching Kiln: a distribution declares
``[project.entry-points."kiln.kernels"] my_kernel = "my_pkg.kernel:MyKernel"`` (a `LinearKernel`
subclass or instance); such kernels are tried ahead of the built-ins on the targets they declare.
Adding a built-in kernel = its file + one line in `KERNELS`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from importlib.metadata import entry_points
from typing import TypeVar

from kernels.base import KernelChoice, LinearKernel, LinearSpec, Target
from kernels.errors import KilnError, NoKernelError
from kernels.moe.stacked import stacked_experts
from kernels.moe_base import MoEKernel, MoESpec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kiln.kernels"
# Shapes every kernel takes: a layer whose scheme a kernel ahead of its choice takes at this shape
# fell back because of its own shape (Marlin's N % 64 / K % 128 rules, say), not its scheme.
FRIENDLY_DIM = 4096
FRIENDLY_EXPERT = (4096, 1024)  # (hidden, intermediate)


K = TypeVar("K", LinearKernel, MoEKernel)
S = TypeVar("S", LinearSpec, MoESpec)


# Every built-in kernel ("module:Class"), most preferred first.
KERNELS: tuple[str, ...] = (
    "kernels.fp8_w8a8:Fp8W8A8Kernel",
    "kernels.int8_w8a8:Int8W8A8Kernel",
    "kernels.tile_wna16:TileWNA16Kernel",
    "kernels.marlin_wna16:MarlinWNA16Kernel",
    "kernels.tile_fp4:TileFp4Kernel",
    "kernels.tile_lut4:TileLut4Kernel",
    "kernels.marlin_fp4:MarlinFp4Kernel",
    "kernels.gptq_wna16:GptqWNA16Kernel",
    "kernels.fp8_marlin:Fp8MarlinKernel",
    "kernels.fp8_w8a16:Fp8W8A16Kernel",
    "kernels.cpu_w4a8:CpuW4A8Kernel",
    "kernels.cpu_int4:CpuInt4Kernel",
    "kernels.cpu_w8a8:CpuW8A8Kernel",
    "kernels.cpu_int8:CpuInt8Kernel",
    "kernels.cpu_fp4:CpuFp4Kernel",
    "kernels.cpu_lut4:CpuLut4Kernel",
    "kernels.cpu_fp8:CpuFp8Kernel",
    "kernels.dense:DenseKernel",
)


def _instantiate(obj: object, where: str) -> LinearKernel:
    kernel = obj() if isinstance(obj, type) else obj
    if not isinstance(kernel, LinearKernel):
        raise KilnError(f"{where} is not a kernels.base.LinearKernel (got {type(kernel).__name__})")
    if not isinstance(getattr(kernel, "targets", None), frozenset):
        raise KilnError(f"{where} declares no `targets` (a frozenset of kernels.base.Target it runs on)")
    return kernel


def import_object(path: str) -> object:
    """The object a "module:attribute" path names (built-in registrations are such paths)."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _load(path: str) -> LinearKernel:
    return _instantiate(import_object(path), path)


# name -> kernel, in preference order (importing a kernel module never imports Triton).
BUILTIN_KERNELS: dict[str, LinearKernel] = {k.name: k for k in map(_load, KERNELS)}
# target -> kernel names in preference order, derived from each kernel's declared targets.
PRIORITY: dict[Target, tuple[str, ...]] = {
    t: tuple(name for name, k in BUILTIN_KERNELS.items() if t in k.targets) for t in Target
}


def builtin_kernel(name: str) -> LinearKernel:
    return BUILTIN_KERNELS[name]


def _instantiate_moe(obj: object, where: str) -> MoEKernel:
    kernel = obj() if isinstance(obj, type) else obj
    if not isinstance(kernel, MoEKernel):
        raise KilnError(f"{where} is not a kernels.moe_base.MoEKernel (got {type(kernel).__name__})")
    return kernel


# Expert-group kernels fused into one launch per layer ("module:Class"), most preferred first; they
# go ahead of the derived per-expert kernels (`<linear kernel>_experts`, one per entry of KERNELS).
FUSED_MOE_KERNELS: tuple[str, ...] = (
    "kernels.moe.fp8:Fp8MoEW8A8Kernel",
    "kernels.moe.marlin:MarlinMoEKernel",
    "kernels.moe.fp8_marlin:Fp8MarlinMoEKernel",
    "kernels.moe.fp8:Fp8MoEW8A16Kernel",
)
MOE_KERNELS: dict[str, MoEKernel] = {
    k.name: k
    for k in (
        *(_instantiate_moe(import_object(p), p) for p in FUSED_MOE_KERNELS),
        *map(stacked_experts, BUILTIN_KERNELS.values()),
    )
}
MOE_PRIORITY: dict[Target, tuple[str, ...]] = {
    t: tuple(name for name, k in MOE_KERNELS.items() if t in k.targets) for t in Target
}


def get_moe_kernel(name: str) -> MoEKernel:
    """The expert-group kernel an artifact names; unknown names are a clear error."""
    if name not in MOE_KERNELS:
        raise KilnError(f"unknown expert-group kernel {name!r}; known: {', '.join(MOE_KERNELS)}")
    return MOE_KERNELS[name]


def _friendly_moe(spec: MoESpec) -> MoESpec:
    h, i = FRIENDLY_EXPERT
    w13 = dataclasses.replace(spec.w13, n=2 * i, k=h, k_full=h, shards=())
    w2 = dataclasses.replace(spec.w2, n=h, k=i, k_full=i)
    return dataclasses.replace(spec, w13=w13, w2=w2)


def choose_moe_kernel(
    spec: MoESpec, target: Target, disabled: Iterable[str] = (), *, kiln_layouts: bool = False
) -> KernelChoice[MoEKernel]:
    """First expert-group kernel for `target` that takes `spec`, with every rejection recorded (a
    disabled linear kernel disables the expert kernels built on it; Kiln-only layouts count only
    with `kiln_layouts`)."""
    order = [MOE_KERNELS[name] for name in MOE_PRIORITY[target]]
    return _choose(order, spec, _friendly_moe(spec), target, set(disabled), kiln_layouts)


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
    """Third-party kernels that declare `target` first, then the built-in priority list for it."""
    return [
        *(k for k in external_kernels() if target in k.targets),
        *(BUILTIN_KERNELS[n] for n in PRIORITY[target]),
    ]


def _friendly_linear(spec: LinearSpec) -> LinearSpec:
    ratio = spec.k_full // spec.k if spec.k else 1
    return dataclasses.replace(spec, n=FRIENDLY_DIM, k=FRIENDLY_DIM, k_full=FRIENDLY_DIM * ratio, shards=())


def choose_kernel(
    spec: LinearSpec, target: Target, disabled: Iterable[str] = (), *, kiln_layouts: bool = False
) -> KernelChoice[LinearKernel]:
    """First kernel in the target's priority list that can implement `spec`, with every rejection;
    kernels of Kiln-only layouts (`LinearKernel.kiln_layout`) count only with `kiln_layouts`."""
    return _choose(candidates(target), spec, _friendly_linear(spec), target, set(disabled), kiln_layouts)


def is_kiln_layout(kernel: LinearKernel | MoEKernel) -> bool:
    """The kernel (or the linear kernel an expert-group kernel stacks) reads a Kiln-only layout."""
    inner = getattr(kernel, "inner", kernel)
    return bool(getattr(inner, "kiln_layout", False))


def _first_fit(
    order: Sequence[K],
    spec: S,
    target: Target,
    disabled: set[str],
    kiln_layouts: bool,
    fits: Callable[[K, S], tuple[bool, str]],
) -> tuple[int, list[tuple[str, str]]]:
    """Index in `order` of the first kernel that takes `spec` (-1: none), and the rejections before it."""
    rejected: list[tuple[str, str]] = []
    for i, kernel in enumerate(order):
        if kernel.name in disabled or getattr(kernel, "based_on", None) in disabled:
            rejected.append((kernel.name, "disabled by KILN_DISABLED_KERNELS"))
            continue
        if not kiln_layouts and is_kiln_layout(kernel):
            continue  # not asked for: no rejection recorded (artifacts stay as they were)
        ok, reason = fits(kernel, spec)
        if ok:
            return i, rejected
        rejected.append((kernel.name, reason))
    return -1, rejected


def _choose(
    order: Sequence[K], spec: S, friendly: S, target: Target, disabled: set[str], kiln_layouts: bool
) -> KernelChoice[K]:
    def fits(kernel: K, s: S) -> tuple[bool, str]:
        return kernel.can_implement(s, target)  # type: ignore[arg-type]

    chosen, rejected = _first_fit(order, spec, target, disabled, kiln_layouts, fits)
    if chosen < 0:
        raise NoKernelError(spec.name, target.value, rejected)
    preferred, _ = _first_fit(order, friendly, target, disabled, kiln_layouts, fits)
    return KernelChoice(order[chosen], rejected, shape_fallback=0 <= preferred < chosen)
