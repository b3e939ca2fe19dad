"""Small helpers shared by the Triton kernels: lazy import, where a kernel may run, launch configs.

Triton is imported only inside functions, so importing a kernel module never needs Triton or a GPU.
A kernel's `apply` runs its Triton kernel on CUDA tensors; on CPU tensors it runs the same kernel
through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before Triton was first imported,
and otherwise falls back to the kernel's pure-torch reference twin.

The interpreter's fp32/fp16 -> e4m3 downcast rounds wrongly (toolchain.md); kernels that cast to
fp8 inside Triton take an ``INTERPRET`` constexpr and round onto the e4m3 grid first (a no-op on GPU).
The interpreter also mishandles bfloat16 (measured here): ``tl.dot`` on bf16 operands returns garbage
(it reads the bits as integers), int -> bf16 casts give NaN, and fp32 -> bf16 casts truncate instead
of rounding to nearest even. Kernels therefore take a ``BF16_INTERP`` constexpr (`bf16_interpreter`):
under it the dot runs on fp32 operands and the fp32 result is rounded to bf16 (RNE) on its bits
before the store. On a GPU the flag is off and the dot runs on bf16 tensor cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from types import ModuleType

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
    return not x.is_cuda and x.dtype == torch.bfloat16


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


def default_config(m: int, n: int, k: int, device: torch.device, *, max_block_k: int = 128) -> GemmConfig:
    """Block sizes by M bucket; split-K fills the GPU when M and N leave too few tiles.

    On the CPU interpreter larger blocks are cheaper (fewer interpreted programs) and split-K
    only adds work, so it uses one K split and wide tiles.
    """
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if device.type != "cuda":
        return GemmConfig(block_m=block_m, block_n=128, block_k=min(128, max_block_k), split_k=1)
    block_n = 64 if m <= 16 else 128
    block_k = min(128 if m <= 64 else 64, max_block_k)
    tiles = -(-m // block_m) * -(-n // block_n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split_k = 1
    while tiles * split_k < 2 * sms and k // (split_k * 2) >= 4 * block_k and split_k < 16:
        split_k *= 2
    num_warps = 4 if block_m * block_n <= 64 * 64 else 8
    return GemmConfig(block_m, block_n, block_k, split_k, num_warps, num_stages=4 if m <= 16 else 3)


def largest_block_dividing(group_size: int, block_k: int) -> int:
    """The largest power-of-two block (>= 16) <= block_k that divides group_size, or block_k if none."""
    b = block_k
    while b >= 16:
        if group_size % b == 0:
            return b
        b //= 2
    return block_k
