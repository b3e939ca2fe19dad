"""The running CPU's instruction-set features, read from /proc/cpuinfo when first asked (never at
import), for kernels that pick a path by what the CPU multiplies natively."""

from __future__ import annotations

import functools

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# int8 dot products: AVX-512 VNNI, AVX-VNNI (256-bit, Alder Lake and later), AMX
INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """bf16 dot products (else oneDNN emulates bf16 and fp32 is faster)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def has_int8_dot_products() -> bool:
    """int8 dot products (else oneDNN's int8 GEMM is a slow emulation: `torch._int_mm` at M=512 ran
    22x slower than an fp32 GEMM on the same integers on an AVX2-only EPYC)."""
    return any(flag in cpu_flags() for flag in INT8_DOT_PRODUCT_FLAGS)
