"""Native libraries built from this repository's C sources with the machine's C compiler.

A library is built by `make install` (`NativeLibrary.build`) or on first use (never at import) into
a cache directory, keyed by its source and flags, so a build is made once per machine image and a
prebuilt one loads without a compiler; `target_clones` in the sources picks their AVX-512, AVX2 or
baseline bodies on the CPU that loads them, so one build serves every x86 CPU. Without a compiler,
or when the build fails, `get()` is None after one warning and the caller takes its torch path.
KILN_NATIVE=0 turns every native library off; KILN_NATIVE_CACHE moves the cache (default
~/.cache/kiln/native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from kernels import cpu_features

log = logging.getLogger(__name__)

CACHE_ENV = "KILN_NATIVE_CACHE"
SWITCH_ENV = "KILN_NATIVE"
BUILD_TIMEOUT_S = 120


class NativeLibrary:
    """One C source built into a shared library; `declare` sets its functions' ctypes signatures."""

    def __init__(
        self,
        what: str,
        source: Path,
        flags: tuple[str, ...],
        declare: Callable[[ctypes.CDLL], None],
        libs: tuple[str, ...] = (),
        headers: tuple[Path, ...] = (),
        isa_function: str | None = None,
    ) -> None:
        self.what = what  # for log lines: "native FP8 quantizer"
        self.source = source
        self.headers = headers  # included by the source (from their folders): part of the build's key
        self.flags = flags
        self.libs = libs
        self.declare = declare
        # the library's `int f(int cap)` capping its bodies: called with KILN_CPU_ISA's level on load
        self.isa_function = isa_function
        self._lock = threading.Lock()
        self._state: dict[str, ctypes.CDLL | None] = {}

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, built on the first call; None when it cannot be (warned once)."""
        with self._lock:
            if "lib" not in self._state:
                self._state["lib"] = self._load_or_warn()
            return self._state["lib"]

    def forget(self) -> None:
        """Load (or build) again on the next `get` (tests)."""
        with self._lock:
            self._state.clear()

    def built_path(self) -> Path:
        """Where the build of this source with these flags lies (or will)."""
        text = b"".join(p.read_bytes() for p in (self.source, *self.headers))
        key = hashlib.sha256(text + repr((self.flags, self.libs)).encode()).hexdigest()[:16]
        cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kiln" / "native")
        return cache / f"{self.source.stem}-{key}.so"

    def build(self) -> str:
        """Build (or find) the library now, as `make install` and the image do: where it is, or why not."""
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        if self.get() is None:
            return f"{self.what} not built: the torch path runs instead"
        return str(self.built_path())

    def _load_or_warn(self) -> ctypes.CDLL | None:
        if os.environ.get(SWITCH_ENV, "1") == "0":
            return None
        try:
            return self._load()
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            log.warning("%s unavailable (%s); using torch", self.what, str(detail).strip()[:300])
            return None

    def _load(self) -> ctypes.CDLL:
        built = self.built_path()
        if not built.is_file():
            cc, cache = _compiler(), built.parent
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / f".{built.name}.{os.getpid()}.{threading.get_ident()}"
            try:
                includes = [f"-I{folder}" for folder in dict.fromkeys(h.parent for h in self.headers)]
                subprocess.run(
                    [cc, *self.flags, *includes, "-o", str(tmp), str(self.source), *self.libs],
                    capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=True,
                )  # fmt: skip
                os.replace(tmp, built)  # concurrent builders each replace it with the same bytes
            finally:
                tmp.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(built))
        self.declare(lib)
        if self.isa_function is not None:
            getattr(lib, self.isa_function)(cpu_features.isa_level())
        log.info("%s: %s", self.what, built)
        return lib


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler on PATH (cc, gcc or clang)")
    return cc
