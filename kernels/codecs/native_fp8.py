"""The native FP8 quantizer (kernels/codecs/native/fp8_quant.c), built with the machine's C compiler.

Built by `make install` (`build()`) or on first use (never at import) into
a cache directory, keyed by the source and the flags, so a build is made once per machine image and a
prebuilt one loads without a compiler; `target_clones` in the source picks its AVX-512, AVX2 or
baseline body on the CPU that loads it, so one build serves every x86 CPU. Without a compiler, or
when the build fails, `native_fp8()` is None after one warning and kernels/codecs/fp8.py quantizes
with torch ops (the same bytes, about 3x slower). KILN_NATIVE=0 turns it off; KILN_NATIVE_CACHE moves
the cache (default ~/.cache/kiln/native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "fp8_quant.c"
# -fno-trapping-math lets the compares vectorize (no FP exceptions are read); no FMA contraction:
# torch rounds q * scale before subtracting
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
CACHE_ENV = "KILN_NATIVE_CACHE"
SWITCH_ENV = "KILN_NATIVE"
BUILD_TIMEOUT_S = 120
# each for the rows of a bf16 and of a float32 weight
QUANTIZE = ("kiln_fp8_quantize_bf16", "kiln_fp8_quantize_f32")
ROW_ABSMAX = ("kiln_row_absmax_bf16", "kiln_row_absmax_f32")

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def native_fp8() -> ctypes.CDLL | None:
    """The loaded library, built on the first call; None when it cannot be (warned once)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load_or_warn()
        return _state["lib"]


def _load_or_warn() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    try:
        return _load()
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        log.warning("native FP8 quantizer unavailable (%s); quantizing with torch", str(detail).strip()[:300])
        return None


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler on PATH (cc, gcc or clang)")
    return cc


def built_path() -> Path:
    """Where the build of this source with these flags lies (or will)."""
    key = hashlib.sha256(SOURCE.read_bytes() + repr(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kiln" / "native")
    return cache / f"fp8_quant-{key}.so"


def _load() -> ctypes.CDLL:
    built = built_path()
    if not built.is_file():
        cc, cache = _compiler(), built.parent
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{built.name}.{os.getpid()}.{threading.get_ident()}"
        try:
            subprocess.run(
                [cc, *FLAGS, "-o", str(tmp), str(SOURCE)],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=True,
            )  # fmt: skip
            os.replace(tmp, built)  # concurrent builders each replace it with the same bytes
        finally:
            tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(built))
    rows = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # w, rows, k, row stride
    for name in QUANTIZE:  # ..., inv (rows,), scale (rows,), out (rows, k), measure -> max error bits
        fn = getattr(lib, name)
        fn.argtypes = [*rows, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_uint32
    for name in ROW_ABSMAX:  # ..., amax (rows,) float32
        fn = getattr(lib, name)
        fn.argtypes = [*rows, ctypes.c_void_p]
        fn.restype = None
    log.info("native FP8 quantizer: %s", built)
    return lib


def build() -> str:
    """Build (or find) the library now, as `make install` and the image do: where it is, or why not."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if native_fp8() is None:
        return "native FP8 quantizer not built: torch quantizes"
    return str(built_path())
