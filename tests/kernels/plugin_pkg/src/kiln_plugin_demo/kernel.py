"""A third-party kernel: integer weights on cpu, stored dequantized in fp32 (like Kiln's dense fallback).

Stored tensors:
    weight_fp32  (N, K) float32   the dequantized weight
"""

from __future__ import annotations

import torch

from kernels.base import IntWeight, LinearKernel, LinearSpec, SourceWeight, StoredTensor, Target
from kernels.errors import LayoutError


class DemoFp32IntKernel(LinearKernel):
    name = "demo_fp32_int"
    layout_version = 1
    schemes = frozenset({"int"})
    targets = frozenset({Target.CPU})
    description = "test plugin: int weights dequantized to fp32 on cpu"

    def can_implement(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if target is not Target.CPU or spec.scheme != "int":
            return False, "demo_fp32_int takes int layers on cpu only"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        return {"weight_fp32": StoredTensor((spec.n, spec.k), torch.float32)}

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        if not isinstance(weight, IntWeight):
            raise LayoutError(f"demo_fp32_int: layer {spec.name} needs an IntWeight")
        return {"weight_fp32": weight.dequantize()}

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return tensors["weight_fp32"]

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), tensors["weight_fp32"]).to(x.dtype)


class ClashingNameKernel(DemoFp32IntKernel):
    """Reuses a built-in name: the registry must refuse it (registered only by a test's own metadata)."""

    name = "dense"
