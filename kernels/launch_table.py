"""Launch configs of the decode-shaped Triton kernels, in one table: per (kernel, M bucket, shape
class, arch). `tuned_config` picks the most specific entry for a call and fills split-K by occupancy
where an entry leaves it open (split_k == 0).

An entry with `arch=0` holds on every GPU; a measured one names its compute capability (80, 90, ...).
`bench/gpu_check.py --sweep` times the candidates of `SWEEP` on the GPU it runs on and prints the
winners as entries of this table; until a device run records them here, the arch-0 priors below
(sized from the tile's bytes and registers, never timed) are what every GPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from kernels.jit import interpreter_enabled
from kernels.launch import GemmConfig, interpreter_config, sm_count

ShapeClass = Literal["any", "square", "wide_k", "wide_n"]
M_BUCKETS = (1, 16, 64, 1 << 30)  # a call of M rows takes the first bucket >= M


@dataclass(frozen=True)
class LaunchEntry:
    kernel: str
    m_max: int  # bucket: calls with M <= m_max (and above the previous bucket)
    config: GemmConfig  # split_k == 0: chosen by occupancy (`occupancy_split_k`)
    shape: ShapeClass = "any"
    arch: int = 0  # compute capability; 0 = every GPU


def _prior(kernel: str) -> tuple[LaunchEntry, ...]:
    """Untimed priors of a weight-only tile kernel: a GEMV program (BLOCK_M 1: multiply-and-reduce on
    the CUDA cores, the weight read once) at M = 1, 16-row tensor-core tiles to M = 16, then GEMM tiles."""
    return (
        LaunchEntry(kernel, 1, GemmConfig(1, 64, 128, split_k=0, num_warps=4, num_stages=3)),
        LaunchEntry(kernel, 16, GemmConfig(16, 64, 128, split_k=0, num_warps=4, num_stages=3)),
        LaunchEntry(kernel, 64, GemmConfig(64, 128, 64, split_k=0, num_warps=8, num_stages=3)),
        LaunchEntry(kernel, 1 << 30, GemmConfig(128, 128, 64, split_k=1, num_warps=8, num_stages=3)),
    )


LAUNCH_TABLE: tuple[LaunchEntry, ...] = (*_prior("tile_wna16"), *_prior("tile_fp4"))

# Candidates `bench/gpu_check.py --sweep` times per M bucket (split-K by occupancy and forced).
SWEEP: dict[int, tuple[GemmConfig, ...]] = {
    1: tuple(
        GemmConfig(1, bn, bk, split_k=sk, num_warps=w, num_stages=3)
        for bn in (32, 64, 128)
        for bk in (64, 128, 256)
        for sk in (0, 4, 16)
        for w in (2, 4)
    ),
    16: tuple(
        GemmConfig(16, bn, bk, split_k=sk, num_warps=w, num_stages=st)
        for bn in (32, 64, 128)
        for bk in (64, 128)
        for sk in (0, 4)
        for w in (4,)
        for st in (2, 3, 4)
    ),
}


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


def shape_class(n: int, k: int) -> ShapeClass:
    if k >= 2 * n:
        return "wide_k"
    if n >= 2 * k:
        return "wide_n"
    return "square"


def lookup(kernel: str, m: int, n: int, k: int, arch: int) -> GemmConfig:
    """The table's config for a call: same kernel and M bucket, the most specific arch and shape."""
    bucket, shape = m_bucket(m), shape_class(n, k)
    rows = [e for e in LAUNCH_TABLE if e.kernel == kernel and e.m_max == bucket]
    rows = [e for e in rows if e.arch in (0, arch) and e.shape in ("any", shape)]
    if not rows:
        raise KeyError(f"no launch config for {kernel} at M={m} in kernels/launch_table.py")
    return max(rows, key=lambda e: (e.arch != 0, e.shape != "any")).config


def occupancy_split_k(cfg: GemmConfig, m: int, n: int, k: int, sms: int) -> int:
    """K splits (a power of two, <= 16) until the grid holds two programs per SM, each split keeping
    at least two K blocks."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split_k = 1
    while tiles * split_k < 2 * sms and k // (split_k * 2) >= 2 * cfg.block_k and split_k < 16:
        split_k *= 2
    return split_k


def tuned_config(kernel: str, m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Launch config of one call on `device` (the interpreter's on CPU)."""
    if device.type != "cuda" or interpreter_enabled():
        cfg = interpreter_config(m)
        return replace(cfg, block_m=1) if m == 1 else cfg
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    cfg = lookup(kernel, m, n, k, major * 10 + minor)
    if cfg.split_k == 0:
        cfg = replace(cfg, split_k=occupancy_split_k(cfg, m, n, k, sm_count(index)))
    return cfg


def bound_configs(
    kernel: str, n: int, k: int, fit: Callable[[GemmConfig], GemmConfig]
) -> Callable[[int, torch.device], GemmConfig]:
    """A bound layer's launch configs: `fit(tuned_config(...))` resolved once per (M, device)."""
    cache: dict[tuple[int, torch.device], GemmConfig] = {}

    def config(m: int, device: torch.device) -> GemmConfig:
        cfg = cache.get((m, device))
        if cfg is None:
            cfg = cache[(m, device)] = fit(tuned_config(kernel, m, n, k, device))
        return cfg

    return config
