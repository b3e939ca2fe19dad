"""Suite-wide configuration: markers, GPU skipping, shared fixture plugins."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run on CPU through the interpreter; it must be set before triton
# is imported. On a CUDA machine the real backend is used (set TRITON_INTERPRET=1 to force it).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest_plugins = [
    "tests.fixtures.s3",
    "tests.fixtures.checkpoints",
    "tests.fixtures.moe",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
