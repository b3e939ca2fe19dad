"""The artifact's `config.json`: the source's, with its quantization config replaced by Kiln's.

The rank files hold kernel-ready tensors, not the source's quantized format, so the source's
`quantization_config` (GPTQ, AWQ, compressed-tensors, FP8) would describe weights that are no longer
there. Any host reading the Hugging Face config (vLLM, transformers) instead finds

    "quantization_config": {"quant_method": "kiln", "artifact_id": "ka-…", "target": "sm80",
                            "source_format": "compressed-tensors"}

vLLM with Kiln's plugin resolves this to the plugin's quantization config; vLLM without it refuses
the artifact ("Unknown quantization method: kiln") instead of misreading the weights. The manifest
keeps the source's config unchanged in `hf_config` (the source quantization in `source.quantization`).
"""

from __future__ import annotations

import json
from typing import Any

KILN_QUANT_METHOD = "kiln"
# Where Hugging Face configs carry a quantization config (compressed-tensors' older key included).
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")


def artifact_hf_config(source: dict[str, Any], *, artifact_id: str, target: str, source_format: str) -> bytes:
    """config.json bytes for an artifact converted from a checkpoint whose config is `source`."""
    out = {k: v for k, v in source.items() if k not in QUANT_CONFIG_KEYS}
    text = out.get("text_config")
    if isinstance(text, dict) and any(k in text for k in QUANT_CONFIG_KEYS):
        out["text_config"] = {k: v for k, v in text.items() if k not in QUANT_CONFIG_KEYS}
    out["quantization_config"] = {
        "quant_method": KILN_QUANT_METHOD,
        "artifact_id": artifact_id,
        "target": target,
        "source_format": source_format,
    }
    return (json.dumps(out, indent=2, sort_keys=False) + "\n").encode()


def is_kiln_quant_config(quant_config: object) -> bool:
    return isinstance(quant_config, dict) and quant_config.get("quant_method") == KILN_QUANT_METHOD
