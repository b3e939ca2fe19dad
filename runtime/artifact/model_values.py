"""A manifest's model, checked from the manifest alone before any file is mapped: every value of its
model config (type, finiteness, range: `ModelConfig.from_hf`), the rotary frequencies they give, and
the number of decoder layers against the layers the manifest lists (a config claiming 10^7 layers is
refused here, not while building 10^7 modules)."""

from __future__ import annotations

import re

from runtime.artifact.manifest import MANIFEST_NAME, Manifest
from runtime.model_layout import ModelConfig, ModelConfigError
from runtime.rope import check_rope

HF_CONFIG = f"{MANIFEST_NAME} hf_config"
_DECODER_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")


def checked_model_config(manifest: Manifest) -> ModelConfig:
    cfg = ModelConfig.from_hf(manifest.hf_config, manifest.architecture, where=HF_CONFIG)
    check_rope(cfg)
    check_layer_count(manifest, cfg)
    return cfg


def check_layer_count(manifest: Manifest, cfg: ModelConfig) -> None:
    """The decoder layers the manifest's linear layers and expert groups belong to are exactly
    0 .. num_hidden_layers - 1."""
    listed: set[int] = set()
    for name in [*manifest.layers, *manifest.expert_groups]:
        match = _DECODER_LAYER.match(name)
        if match is not None:
            listed.add(int(match.group(1)))
    if listed != set(range(cfg.num_layers)):
        held = f"{len(listed)} decoder layer(s), {_ranges(sorted(listed))}" if listed else "no decoder layer"
        raise ModelConfigError(
            f"{HF_CONFIG}: num_hidden_layers = {cfg.num_layers}, but the manifest's layers belong to "
            f"{held}; the manifest is corrupt or was altered — pull the artifact again or re-convert it"
        )


def _ranges(indices: list[int], most: int = 4) -> str:
    """`0..11, 13, 15..17` (the first `most` runs)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = [f"{a}..{b}" if b > a else str(a) for a, b in runs[:most]]
    return ", ".join(shown) + (", …" if len(runs) > most else "")
