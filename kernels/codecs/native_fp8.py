"""The native FP8 quantizer (kernels/codecs/native/fp8_quant.c), built with the machine's C compiler
(kernels/native_build.py). Without it, `native_fp8()` is None after one warning and
kernels/codecs/fp8.py quantizes with torch ops (the same bytes, about 3x slower)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kernels.native_build import NativeLibrary

SOURCE = Path(__file__).with_name("native") / "fp8_quant.c"
# -fno-trapping-math lets the compares vectorize (no FP exceptions are read); no FMA contraction:
# torch rounds q * scale before subtracting
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
# each for the rows of a bf16 and of a float32 weight
QUANTIZE = ("kiln_fp8_quantize_bf16", "kiln_fp8_quantize_f32")
ROW_ABSMAX = ("kiln_row_absmax_bf16", "kiln_row_absmax_f32")


def _declare(lib: ctypes.CDLL) -> None:
    rows = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # w, rows, k, row stride
    for name in QUANTIZE:  # ..., inv (rows,), scale (rows,), out (rows, k), measure -> max error bits
        fn = getattr(lib, name)
        fn.argtypes = [*rows, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_uint32
    for name in ROW_ABSMAX:  # ..., amax (rows,) float32
        fn = getattr(lib, name)
        fn.argtypes = [*rows, ctypes.c_void_p]
        fn.restype = None


LIBRARY = NativeLibrary("native FP8 quantizer", SOURCE, FLAGS, _declare)


def native_fp8() -> ctypes.CDLL | None:
    """The loaded library, built on the first call; None when it cannot be (warned once)."""
    return LIBRARY.get()


def build() -> str:
    """Build (or find) the library now, as `make install` and the image do: where it is, or why not."""
    return LIBRARY.build()
