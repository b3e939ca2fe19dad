"""Suite-wide configuration: markers, GPU skipping, shared fixture plugins, xdist scheduling."""

from __future__ import annotations

import os
from collections.abc import Iterator

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


# Modules whose time is mostly waiting on other processes (a Celery worker killed and redelivered,
# a vLLM host starting, a server restarted): scheduled first, so the waits overlap the compute-bound
# modules on the other xdist worker instead of ending the run alone.
WAITING_MARKERS = ("services", "vllm", "timing")


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs two xdist workers on two cores: each computes on one thread (torch's and the
    # native step's pools, its subprocesses' too), or both workers' OpenMP teams spin on each other.
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A module that sets torch's thread count (to measure at 2 threads, as the peers) leaves the
    worker's count as it found it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)  # after the directories' hooks have added their markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    waiting = {_module(item) for item in items if any(m in item.keywords for m in WAITING_MARKERS)}
    items.sort(key=lambda item: _module(item) not in waiting)  # stable: order kept within
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
