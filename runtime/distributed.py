"""torch.distributed helpers for tensor parallelism: gloo on CPU, NCCL on CUDA.

Every rank runs the same engine on the same requests; the model all-reduces after its
row-parallel layers and the engine broadcasts rank 0's sampled tokens (runtime/engine.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_tensor_parallel(
    rank: int,
    world_size: int,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: str = "cpu",
    timeout: timedelta | None = None,
) -> None:
    """Join the process group (a no-op for world_size 1). Address and port default to
    MASTER_ADDR / MASTER_PORT from the environment (as torchrun sets them), then 127.0.0.1:29500.
    `timeout`: of the rendezvous and of every collective (None: torch's default)."""
    if world_size == 1 or dist.is_initialized():
        return
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = master_port or int(os.environ.get("MASTER_PORT", "29500"))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size, timeout=timeout
    )


def shutdown_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
