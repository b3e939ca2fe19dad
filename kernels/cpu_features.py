"""The running CPU's instruction-set features, read from /proc/cpuinfo when first asked (never at
import), for kernels that pick a path by what the CPU multiplies natively.

`KILN_CPU_ISA` caps what Kiln uses (auto | avx2 | scalar): `avx2` runs as an AVX2-only x86 CPU would
(no AVX-512, VNNI, AMX or native bf16: fp32 activations, the AVX2 bodies of the native libraries), so
one machine checks the other kind's path and its speed. torch's own kernels read their cap from the
environment before torch starts: `isa_environment` gives a child process all of it.
"""

from __future__ import annotations

import functools
import os

from kernels.errors import KilnError

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# int8 dot products: AVX-512 VNNI, AVX-VNNI (256-bit, Alder Lake and later), AMX
INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")

ISA_ENV = "KILN_CPU_ISA"
# The caps, in the native libraries' order (kiln_set_isa / kiln_w4a8_level take the index); "auto": none.
ISA_CAPS = ("scalar", "avx2", "avx512")
# what a cap leaves out of the CPU's flags: every extension above it
_ABOVE_CAP = {
    "scalar": ("avx", "fma", "f16c", "amx", "vaes", "vpclmulqdq", "gfni"),
    "avx2": ("avx512", "avx_vnni", "amx"),
}
# torch's and oneDNN's own caps for the same level (read once, when torch starts)
_TORCH_ENV = {
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def isa_cap() -> str:
    """The cap `KILN_CPU_ISA` sets: "auto" (the CPU's own), "avx2" or "scalar"."""
    cap = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if cap not in ("auto", *ISA_CAPS):
        raise KilnError(f"{ISA_ENV}={cap!r} is not one of auto, {', '.join(ISA_CAPS)}")
    return cap


def isa_level() -> int:
    """The cap as the native libraries' level index (the widest, avx512, where there is none)."""
    cap = isa_cap()
    return len(ISA_CAPS) - 1 if cap == "auto" else ISA_CAPS.index(cap)


def isa_environment(cap: str) -> dict[str, str]:
    """The variables that run a new process at `cap` ("auto": none), torch's kernels included."""
    if cap == "auto":
        return {}
    if cap not in _TORCH_ENV:
        raise KilnError(f"no CPU cap {cap!r}: one of auto, {', '.join(_TORCH_ENV)}")
    return {ISA_ENV: cap, **_TORCH_ENV[cap]}


@functools.cache
def machine_flags() -> frozenset[str]:
    """The `flags` of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The flags Kiln may use: the machine's, less what `KILN_CPU_ISA` leaves out."""
    cap = isa_cap()
    if cap not in _ABOVE_CAP:
        return machine_flags()
    return frozenset(f for f in machine_flags() if not f.startswith(_ABOVE_CAP[cap]))


def has_native_bf16() -> bool:
    """bf16 dot products (else oneDNN emulates bf16 and fp32 is faster)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def has_int8_dot_products() -> bool:
    """int8 dot products (else oneDNN's int8 GEMM is a slow emulation: `torch._int_mm` at M=512 ran
    22x slower than an fp32 GEMM on the same integers on an AVX2-only EPYC)."""
    return any(flag in cpu_flags() for flag in INT8_DOT_PRODUCT_FLAGS)
