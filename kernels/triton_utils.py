"""Small helpers shared by the Triton kernels: lazy import, where a kernel may run, launch configs.

Triton is imported only inside functions, so importing a kernel module never needs Triton or a GPU.
A kernel's `apply` runs its Triton kernel on CUDA tensors; on CPU tensors it runs the same kernel
through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before Triton was first imported,
and otherwise falls back to the kernel's pure-torch reference twin.

The interpreter's fp32/fp16 -> e4m3 downcast rounds wrongly (docs/formats.md §17.1); kernels that cast to
fp8 inside Triton take an ``INTERPRET`` constexpr and round onto the e4m3 grid first (a no-op on GPU).
The interpreter also mishandles bfloat16 (measured here): ``tl.dot`` on bf16 operands returns garbage
(it reads the bits as integers), int -> bf16 casts give NaN, and fp32 -> bf16 casts truncate instead
of rounding to nearest even. Kernels therefore take a ``BF16_INTERP`` constexpr (`bf16_interpreter`):
under it the dot runs on fp32 operands and the fp32 result is rounded to bf16 (RNE) on its bits
before the store. On a GPU the flag is off and the dot runs on bf16 tensor cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cache
from types import ModuleType
from typing import Any, Literal

import torch

from kernels.errors import UnsupportedError

ACT_DTYPES = ("bfloat16", "float16")


def interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def import_triton() -> tuple[ModuleType, ModuleType]:
    """(triton, triton.language), or an actionable error when Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - triton is a dev dependency
        raise UnsupportedError(
            "the GPU kernels need Triton: pip install 'kiln[triton]' (triton==3.7.1)"
        ) from exc
    return triton, tl


def runs_triton(x: torch.Tensor) -> bool:
    """Whether `apply` should launch the Triton kernel for this input (else: the torch reference)."""
    if x.is_cuda:
        return True
    return x.device.type == "cpu" and interpreter_enabled() and triton_installed()


def bf16_interpreter(x: torch.Tensor) -> bool:
    """bfloat16 activations under the interpreter: enable the BF16_INTERP workarounds (module docstring)."""
    return interpreter_enabled() and x.dtype == torch.bfloat16


def check_act_dtype(x: torch.Tensor, kernel: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedError(f"{kernel} takes bfloat16 or float16 activations, got {x.dtype}")


def act_dtype_reason(act_dtype: str, kernel: str) -> str:
    """'' when the activation dtype is one the Triton kernels take, else the refusal reason."""
    if act_dtype in ACT_DTYPES:
        return ""
    return f"{kernel} runs bfloat16 or float16 activations, not {act_dtype}; use the dense or a cpu kernel"


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of a dequant-GEMM (no autotuning: fixed per M bucket)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(
    m: int, n: int, k: int, device: torch.device, *, kind: Literal["dequant", "fp8"] = "dequant"
) -> GemmConfig:
    """Block sizes by M bucket (no autotuning, `cuda_block_config`); split-K fills the GPU when
    M and N leave fewer than two tiles per SM.

    "dequant" kernels gather an int32 word per weight element, so their tiles cost 4 bytes per
    element per pipeline stage: the sizes keep 3 stages under the 99 KB of shared memory of
    sm86/sm89 (checked by compiling for sm80/sm90: bench/gpu_check.py --compile-only). Kernels
    that gather scales per element too (act-order, odd groups) drop to 2 stages (`fit_to_groups`).
    "fp8" (fp8_w8a8) loads 1-byte tiles. On the CPU interpreter wide tiles and no split-K are cheapest.
    """
    if device.type != "cuda" or interpreter_enabled():
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        return GemmConfig(block_m=block_m, block_n=128, block_k=128, split_k=1)
    cfg = cuda_block_config(m, kind)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split_k = 1
    while tiles * split_k < 2 * sms and k // (split_k * 2) >= 4 * cfg.block_k and split_k < 16:
        split_k *= 2
    return replace(cfg, split_k=split_k)


def cuda_block_config(m: int, kind: Literal["dequant", "fp8"] = "dequant") -> GemmConfig:
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


def launch_options(x: torch.Tensor, cfg: GemmConfig) -> dict[str, int]:
    """num_warps / num_stages for a CUDA launch (the interpreter takes none)."""
    if x.is_cuda and not interpreter_enabled():
        return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return {}


def gemm_output(m: int, n: int, x: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """The kernel's output buffer: act dtype, or a zeroed fp32 buffer that K splits atomically add into."""
    if cfg.split_k > 1:
        return torch.zeros(m, n, device=x.device, dtype=torch.float32)
    return torch.empty(m, n, device=x.device, dtype=x.dtype)


def finish_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cast a split-K fp32 buffer back to the act dtype (a no-op otherwise)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)


@dataclass
class GemmLaunch:
    """What every GEMM wrapper here does around its own kernel call: the output buffer, the grid
    over (M, N) tiles and K splits, the tile constexprs and launch options, and the final cast."""

    x: torch.Tensor  # the caller's activations (..., K)
    n: int
    cfg: GemmConfig
    y: torch.Tensor  # (M, N) output buffer (fp32 under split-K)
    grid: tuple[int, int]

    @classmethod
    def plan(cls, x: torch.Tensor, m: int, n: int, cfg: GemmConfig) -> GemmLaunch:
        triton, _ = import_triton()
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
        return cls(x, n, cfg, gemm_output(m, n, x, cfg), grid)

    def meta(self) -> dict[str, Any]:
        """Keyword arguments every GEMM kernel takes: tile sizes, split-K, the interpreter flag."""
        c = self.cfg
        return {
            "BLOCK_M": c.block_m,
            "BLOCK_N": c.block_n,
            "BLOCK_K": c.block_k,
            "SPLIT_K": c.split_k,
            "BF16_INTERP": bf16_interpreter(self.x),
            **launch_options(self.x, c),
        }

    def result(self) -> torch.Tensor:
        """(..., N) in the activations' dtype."""
        return finish_output(self.y, self.x).reshape(*self.x.shape[:-1], self.n)


def gemm_rows(x: torch.Tensor, k: int, kernel: str) -> torch.Tensor:
    """The activations as (M, K) rows, after checking their dtype for `kernel`."""
    check_act_dtype(x, kernel)
    return x.reshape(-1, k)


def empty_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """The (..., N) result of a GEMM over no rows."""
    return x.new_empty(*x.shape[:-1], n)


def with_epilogue(module_globals: dict[str, Any]) -> tuple[ModuleType, ModuleType]:
    """`import_triton()`, with the shared `@triton.jit` GEMM helpers (`tile_offsets`, `k_range`,
    `store_tile`) bound in a kernel module's globals (not a closure: Triton's interpreter resolves
    callees in the kernel's globals)."""
    module_globals.update(gemm_helpers())
    return import_triton()


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def largest_block_dividing(group_size: int, block_k: int) -> int:
    """The largest power-of-two block (>= 16) <= block_k that divides group_size, or block_k if none."""
    b = block_k
    while b >= 16:
        if group_size % b == 0:
            return b
        b //= 2
    return block_k


@cache
def gemm_helpers() -> dict[str, Any]:
    """The `@triton.jit` helpers every GEMM kernel here shares:
    `tile_offsets`: this program's output rows / columns and their masks (grid axis 0 = M x N tiles);
    `k_range`: the K iterations of this program's split (grid axis 1 = K splits);
    `store_tile`: add the bias once (first K split), then store the fp32 tile in Y's dtype, or
    atomically add it under split-K."""
    global tl  # Triton's interpreter looks `tl` up in a called helper's module globals
    triton, tl = import_triton()

    @triton.jit
    def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_m, offs_n, offs_m < M, offs_n < N

    @triton.jit
    def k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_k = tl.program_id(1)
        k_iters = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_iters, SPLIT_K)
        return pid_k * per_split, tl.minimum(k_iters, (pid_k + 1) * per_split)

    @triton.jit
    def store_tile(
        acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        y_ptrs = Y + offs_m[:, None] * N + offs_n[None, :]
        mask_mn = mask_m[:, None] & mask_n[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
        if SPLIT_K == 1:
            if BF16_INTERP:  # round to nearest even by hand: the interpreter's bf16 cast truncates
                bits = acc.to(tl.int32, bitcast=True)
                acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_mn)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask_mn)

    return {"tile_offsets": tile_offsets, "k_range": k_range, "store_tile": store_tile}
