"""Launch parameters of the Triton GEMMs: tiles, warps and stages by M bucket, split-K, no autotuning."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Literal

import torch

from kernels.jit import interpreter_enabled

TileKind = Literal["dequant", "fp8"]


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of a dequant-GEMM (no autotuning: fixed per M bucket)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int, device: torch.device, *, kind: TileKind = "dequant") -> GemmConfig:
    """Block sizes by M bucket (no autotuning, `cuda_block_config`); split-K fills the GPU when
    M and N leave fewer than two tiles per SM.

    "dequant" kernels gather an int32 word per weight element, so their tiles cost 4 bytes per
    element per pipeline stage: the sizes keep 3 stages under the 99 KB of shared memory of
    sm86/sm89 (checked by compiling for sm80/sm90: bench/gpu_check.py --compile-only). Kernels
    that gather scales per element too (act-order, odd groups) drop to 2 stages (`fit_to_groups`).
    "fp8" (fp8_w8a8) loads 1-byte tiles. On the CPU interpreter wide tiles and no split-K are cheapest.
    """
    if device.type != "cuda" or interpreter_enabled():
        return interpreter_config(m)
    cfg = cuda_block_config(m, kind)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split_k = 1
    while tiles * split_k < 2 * sms and k // (split_k * 2) >= 4 * cfg.block_k and split_k < 16:
        split_k *= 2
    return replace(cfg, split_k=split_k)


def interpreter_config(m: int) -> GemmConfig:
    """Tiles on the CPU interpreter: the M bucket, wide N / K tiles, no split-K."""
    return GemmConfig(block_m=16 if m <= 16 else 32 if m <= 32 else 64, block_n=128, block_k=128)


def cuda_block_config(m: int, kind: TileKind = "dequant") -> GemmConfig:
    """Tile sizes, warps and stages by M bucket on CUDA (split-K is decided by `default_config`)."""
    if kind == "fp8":
        if m <= 16:
            return GemmConfig(16, 64, 128, num_warps=4, num_stages=4)
        if m <= 64:
            return GemmConfig(64, 128, 128, num_warps=8, num_stages=4)
        return GemmConfig(128, 128, 64, num_warps=8, num_stages=4)
    if m <= 16:
        return GemmConfig(16, 64, 128, num_warps=4, num_stages=3)
    if m <= 32:
        return GemmConfig(32, 64, 64, num_warps=4, num_stages=3)
    if m <= 64:
        return GemmConfig(64, 128, 64, num_warps=8, num_stages=3)
    return GemmConfig(128, 128, 32, num_warps=8, num_stages=3)


def fit_to_groups(cfg: GemmConfig, group_size: int, *, act_order: bool) -> tuple[GemmConfig, bool]:
    """(config, per_block_scale): shrink BLOCK_K to divide the group so each K block reads one scale
    row (applied to the dot's result); otherwise (act-order, odd groups) scales are gathered per
    element, which doubles the bytes per stage, so the pipeline is capped at 2 stages."""
    if not act_order:
        cfg = replace(cfg, block_k=largest_block_dividing(group_size, cfg.block_k))
        if group_size % cfg.block_k == 0:
            return cfg, True
    return replace(cfg, num_stages=min(cfg.num_stages, 2)), False


def largest_block_dividing(group_size: int, block_k: int) -> int:
    """The largest power-of-two block (>= 16) <= block_k that divides group_size, or block_k if none."""
    b = block_k
    while b >= 16:
        if group_size % b == 0:
            return b
        b //= 2
    return block_k


def launch_options(x: torch.Tensor, cfg: GemmConfig) -> dict[str, int]:
    """num_warps / num_stages for a CUDA launch (the interpreter takes none)."""
    if x.is_cuda and not interpreter_enabled():
        return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return {}


@cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
