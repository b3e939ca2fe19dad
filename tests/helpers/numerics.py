"""Error measures the kernel tests compare against their named tolerances."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp32 (Frobenius norms)."""
    e = expected.float()
    return float((actual.float() - e).norm() / e.norm().clamp_min(1e-30))
