"""Synthetic checkpoints, written once per session and shared by the conversion tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from devtools.builders.synthetic import write_checkpoint

# name -> (format, writer options)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq-w4-v1-sym": ("gptq", {}),
    "gptq-w4-v2-asym": ("gptq", {"v2": True, "sym": False}),
    "gptq-w4-v1-asym": ("gptq", {"sym": False}),
    "gptq-w4-actorder": ("gptq", {"act_order": True}),
    "gptq-w8-sym": ("gptq", {"bits": 8}),
    "gptq-w4-mislabeled-v2": ("gptq", {"mislabel": True}),
    "awq-gemm": ("awq", {}),
    "ct-w4a16-sym": ("ct-pack", {}),
    "ct-w4a16-asym": ("ct-pack", {"sym": False}),
    "ct-w4a16-actorder": ("ct-pack", {"act_order": True}),
    "ct-w8a16": ("ct-pack", {"bits": 8}),
    "ct-fp8-channel": ("ct-fp8", {"fp8_strategy": "channel"}),
    "ct-int8": ("ct-int8", {}),
    "ct-nvfp4": ("ct-nvfp4", {}),
    "ct-mxfp4": ("ct-mxfp4", {}),
    "fp8-tensor": ("fp8", {}),
    "fp8-block": ("fp8", {"fp8_strategy": "block"}),
    "bf16": ("dense", {}),
    "bf16-sharded": ("dense", {"sharded": True}),
}


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


_TRUTH: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture(scope="session")
def ckpt(synthetic_dir: Path) -> Callable[[str], Path]:
    """ckpt(name) -> path of the named synthetic checkpoint (written on first use)."""

    def get(name: str) -> Path:
        path = synthetic_dir / name
        if not (path / "config.json").exists():
            fmt, opts = CHECKPOINTS[name]
            _TRUTH[name] = {}
            write_checkpoint(path, fmt, truth=_TRUTH[name], **opts)
        return path

    return get


@pytest.fixture(scope="session")
def truth(ckpt: Callable[[str], Path]) -> Callable[[str], dict[str, torch.Tensor]]:
    """truth(name) -> {checkpoint module: exact (N, K) float32 weight} of a synthetic checkpoint."""

    def get(name: str) -> dict[str, torch.Tensor]:
        ckpt(name)
        return _TRUTH[name]

    return get
