"""The building blocks every architecture's layers share: a linear layer through its manifest
kernel, an RMSNorm, and the per-forward context (KV cache, rope tables, decode positions)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels.base import LinearKernel, LinearSpec
from runtime.kv_cache import KVCache


class KernelLinear(nn.Module):
    """y = x @ W.T (+ bias) through the kernel the manifest names; tensors bound at load."""

    def __init__(self, name: str, *, all_reduce: bool = False) -> None:
        super().__init__()
        self.name = name
        self.all_reduce = all_reduce  # row-parallel layer under TP > 1
        self.kernel: LinearKernel | None = None
        self.spec: LinearSpec | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def bind(self, kernel: LinearKernel, spec: LinearSpec, tensors: dict[str, torch.Tensor]) -> None:
        self.kernel, self.spec, self.tensors = kernel, spec, tensors
        for suffix, t in tensors.items():
            self.register_buffer(suffix, t, persistent=False)
        # A closure with every tensor, shape and option resolved once (no lookups per call).
        self._apply = kernel.bind_apply(tensors, spec)
        if not self.all_reduce:  # `forward` is then the bound closure itself: one call less per use
            self.forward = self._apply  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._apply(x)
        if self.all_reduce:
            torch.distributed.all_reduce(y)
        return y

    def shard_sizes(self) -> list[int]:
        assert self.spec is not None, f"{self.name} is not bound"
        return [s.size for s in self.spec.shards] or [self.spec.n]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


@dataclass
class ForwardContext:
    """Per-forward state shared by every layer (built once per step, not per layer)."""

    cache: KVCache
    cos: torch.Tensor  # (B, 1, T, head_dim): cos | cos
    sin: torch.Tensor  # (B, 1, T, head_dim): -sin | sin
    act_dtype: torch.dtype = torch.float32
    attn_dtype: torch.dtype = torch.float32  # decode attention (the residual dtype)
    prefill_slot: int | None = None
    slots: torch.Tensor | None = None  # (B,) decode: cache slot of each sequence
    positions: torch.Tensor | None = None  # (B,) decode: position of the new token
    read_slots: slice | torch.Tensor | None = None  # a slice when the slots are contiguous (no gather)
    read_len: int = 0
    mask: torch.Tensor | None = None  # (B, 1, 1, read_len) bool, None when B == 1
    single: tuple[int, int] | None = None  # decode with B == 1: (slot, position)
    # (Q, keys) bool masks by sliding window (None: causal only), made by the first layer that asks
    _visible: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def visible(self, window: int | None, keys: int, device: torch.device) -> torch.Tensor:
        """(Q, keys) bool: key s visible from the query at position p when s <= p and p - s < window.
        Queries: positions 0..keys-1 at prefill, each sequence's new token at decode. One mask per
        window per forward, shared by every layer with that window."""
        mask = self._visible.get(window)
        if mask is None:
            if self.prefill_slot is not None:
                p = torch.arange(keys, device=device)
            elif self.single is not None:
                p = torch.tensor([self.single[1]], device=device)
            else:
                assert self.positions is not None
                p = self.positions.to(device)
            s = torch.arange(keys, device=device)[None, :]
            mask = s <= p[:, None]
            if window is not None:
                mask &= p[:, None] - s < window
            self._visible[window] = mask
        return mask
