"""torch.distributed helpers for tensor parallelism: gloo on CPU, NCCL on CUDA.

Every rank runs the same engine on the same requests; the model all-reduces after its
row-parallel layers and the engine broadcasts rank 0's sampled tokens (runtime/engine.py).

The ranks of one `kiln serve` run on one machine and nothing else may join them: they meet through
a FileStore in a private directory (`private_rendezvous`, mode 0700) instead of a TCP store (which
listens on every interface and authenticates no one), and gloo / NCCL open their sockets on the
loopback interface unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

LOOPBACK_IFNAME = "lo"
STORE_NAME = "store"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def private_rendezvous() -> Path:
    """A fresh directory only this user can enter, for the ranks' FileStore."""
    return Path(tempfile.mkdtemp(prefix="kiln-tp-"))  # mkdtemp: mode 0700


def remove_rendezvous(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def init_tensor_parallel(
    rank: int,
    world_size: int,
    *,
    rendezvous: Path,
    device: str = "cpu",
    timeout: timedelta | None = None,
) -> None:
    """Join the process group through the FileStore in `rendezvous` (a no-op for world_size 1).
    `timeout`: of the rendezvous and of every collective (None: torch's default)."""
    if world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(str(rendezvous / STORE_NAME), world_size)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


def shutdown_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
