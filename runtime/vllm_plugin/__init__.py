"""Kiln's vLLM plugin: `vllm serve ARTIFACT --load-format kiln` serves a Kiln artifact with vLLM.

Registered on vLLM's `vllm.general_plugins` entry point (pyproject.toml), which vLLM calls in every
process it starts; `register` is re-entrant. It registers

- the quantization config `kiln` (`quant_config.KilnQuantConfig`): an artifact's config.json names
  it (runtime/artifact/hf_config.py), so vLLM builds its model with Kiln's per-layer methods, whose
  parameters have the artifact's final layout;
- the model loader `kiln` (`model_loader.KilnModelLoader`): checks the artifact against this vLLM,
  this machine and this TP rank before any weight is read, then binds the rank file's tensors to
  those parameters (views of the mapping on CPU, one host-to-device copy on GPU);
- the pull of an `s3://` artifact before vLLM reads its config (`remote.register`).

Nothing else in Kiln imports vLLM; this package is imported only by vLLM.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Entry point of `vllm.general_plugins` (safe to call more than once, from any thread)."""
    global _registered
    with _lock:
        if _registered:
            return
        from runtime.vllm_plugin.compat import warn_if_untested

        warn_if_untested()  # an untested vLLM is refused when a Kiln artifact loads, not here:
        # vLLM calls this in every process, also for models that are not Kiln's
        from vllm.model_executor.layers.quantization import register_quantization_config
        from vllm.model_executor.model_loader import register_model_loader

        from runtime.artifact.hf_config import KILN_QUANT_METHOD
        from runtime.vllm_plugin.model_loader import KilnModelLoader
        from runtime.vllm_plugin.quant_config import KilnQuantConfig
        from runtime.vllm_plugin.remote import register as register_remote_artifacts

        register_quantization_config(KILN_QUANT_METHOD)(KilnQuantConfig)
        register_model_loader(KILN_QUANT_METHOD)(KilnModelLoader)
        register_remote_artifacts()
        _registered = True
