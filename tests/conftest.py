"""Suite-wide configuration: markers, GPU skipping, shared fixture plugins."""

from __future__ import annotations

import os

# Triton kernels run on CPU through the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest_plugins = [
    "tests.fixtures.s3",
    "tests.fixtures.checkpoints",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
