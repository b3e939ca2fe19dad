"""Triton, lazily: its import, whether a kernel runs it or the interpreter, `jit`, activation dtypes.

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

Kernels are written inside a builder (`triton_builder`: built once, on first use; `tl` and the
`@triton.jit` helpers they call are the builder's locals) and compiled with `jit`.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from functools import cache, wraps
from types import ModuleType
from typing import Any, TypeVar

import torch

from kernels.errors import UnsupportedError
from kernels.targets import Target

ACT_DTYPES = ("bfloat16", "float16")
B = TypeVar("B")


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


def triton_builder(build: Callable[[ModuleType], B]) -> Callable[[], B]:
    """A kernel builder (module docstring): `build(tl)` defines `@triton.jit` kernels or pieces with
    Triton's language module and returns them. It runs on the first call only (importing the module
    that declares it imports no Triton), later calls return what it built."""

    @cache
    @wraps(build)
    def built() -> B:
        return build(import_triton()[1])

    return built


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit(fn)` for a function defined in a builder. Triton's interpreter re-executes a
    kernel's source in its globals alone (and patches the `tl` it finds there), so `tl` and the
    builder's locals it reads (the helpers it calls) are joined to a copy of its module's globals;
    the module itself is left untouched."""
    triton, tl = import_triton()
    cells = (cell.cell_contents for cell in fn.__closure__ or ())
    scope = {**fn.__globals__, "tl": tl, **dict(zip(fn.__code__.co_freevars, cells, strict=True))}
    bound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__qualname__, bound.__annotations__ = fn.__qualname__, fn.__annotations__
    return triton.jit(bound)


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


def act_dtype_reason(act_dtype: str, kernel: str, target: Target) -> str:
    """'' when the activation dtype is one the Triton kernels take on `target` (bfloat16 needs bf16
    tensor cores), else the refusal reason."""
    if act_dtype in ACT_DTYPES:
        if act_dtype == "bfloat16" and not target.has_bf16:
            return (
                f"{target.value} has no bfloat16 tensor cores: {kernel} there needs act_dtype float16, "
                f"got {act_dtype}"
            )
        return ""
    return f"{kernel} runs bfloat16 or float16 activations, not {act_dtype}; use the dense or a cpu kernel"
