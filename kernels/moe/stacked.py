"""Expert groups stored in a linear kernel's own layout, stacked per expert, run expert by expert.

`stacked_experts(inner)` turns any `LinearKernel` into an expert-group kernel named
`<inner>_experts`: expert e's w13 / w2 slices are exactly what `inner.prepare` writes for that
expert's fused gate|up and down projections, stacked along a leading expert dimension:

    w13.<suffix>  (E, *inner's shape for (N = 2 I, K = H))
    w2.<suffix>   (E, *inner's shape for (N = H, K = I))

so `marlin_wna16_experts` holds vLLM's Marlin MoE bytes and `cpu_int4_experts` torch's int4 pack per
expert. `apply` runs each routed expert through `inner`'s own (bound) kernels: at decode only the
experts the tokens picked, at prefill one batched call per expert over the tokens routed to it
(tokens grouped by a stable sort, no Python loop over tokens). The weighted sum is accumulated in
fp32. These are the CPU expert kernels and the GPU fallback where no fused kernel applies; the fused
kernels (kernels/moe/fused.py) store the same layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kernels.base import Fp8Weight, IntWeight, LinearKernel, LinearSpec, SourceWeight, StoredTensor
from kernels.moe_base import SWIGLU_OAI, W2, W13, ExpertTwin, MoEApply, MoEKernel, MoESpec, expert_slices
from kernels.targets import Target


class StackedExperts(MoEKernel):
    """Base of the expert-group kernels that stack `inner`'s layout. A subclass names `inner` (and its
    own `name`, `elsewhere`, `description`); what the layout and its targets are comes from `inner`."""

    inner: ClassVar[LinearKernel]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inner = cls.__dict__.get("inner")
        if inner is None:
            return
        derived = {
            "layout_version": inner.layout_version,
            "schemes": inner.schemes,
            "targets": inner.targets,
            "cpu_act_dtype": inner.cpu_act_dtype,
            "based_on": inner.name,
        }
        for attr, value in derived.items():
            if attr not in cls.__dict__:
                setattr(cls, attr, value)

    def padded(self, spec: MoESpec) -> MoESpec:
        multiples = self.inner.gpt_oss_expert_padding
        if spec.activation != SWIGLU_OAI or multiples is None:
            return spec
        return spec.with_padding(*multiples)

    def supports(self, spec: MoESpec, target: Target) -> tuple[bool, str]:
        spec = self.padded(spec)
        for part, linear in ((W13, spec.w13), (W2, spec.w2)):
            ok, reason = self.inner.can_implement(linear, target)
            if not ok:
                return False, f"{part}: {reason}"
        return True, ""

    def stored_tensors(self, spec: MoESpec, target: Target) -> dict[str, StoredTensor]:
        out: dict[str, StoredTensor] = {}
        for part in (W13, W2):
            for suffix, t in self.inner.stored_tensors(spec.part(part), target).items():
                out[f"{part}.{suffix}"] = StoredTensor((spec.num_experts, *t.shape), t.dtype)
        return out

    def prepare_expert(
        self, w13: SourceWeight, w2: SourceWeight, spec: MoESpec, target: Target
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part, weight in ((W13, w13), (W2, w2)):
            linear = spec.part(part)
            prepared = self.inner.prepare(weight, linear, target)
            for suffix in self.inner.stored_tensors(linear, target):
                value = prepared.get(suffix)
                if value is None:  # a tensor some experts need and others not: stack its neutral value
                    value = self.inner.neutral_tensor(suffix, linear)
                out[f"{part}.{suffix}"] = value
        return out

    def needs_group_statistics(self, spec: MoESpec) -> bool:
        return self.inner.needs_group_statistic(spec.w13) or self.inner.needs_group_statistic(spec.w2)

    def group_statistics(self, w13: SourceWeight, w2: SourceWeight, spec: MoESpec) -> tuple[float, float]:
        inner = self.inner

        def one(weight: SourceWeight, linear: LinearSpec) -> float:
            return inner.group_statistic(weight, linear) if inner.needs_group_statistic(linear) else 0.0

        return one(w13, spec.w13), one(w2, spec.w2)

    def with_group_statistics(self, spec: MoESpec, values: tuple[float, float]) -> MoESpec:
        w13 = self.inner.with_group_statistic(spec.w13, values[0])
        return dataclasses.replace(spec, w13=w13, w2=self.inner.with_group_statistic(spec.w2, values[1]))

    def dequantize_expert(
        self, tensors: dict[str, torch.Tensor], spec: MoESpec, expert: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.inner.dequantize(expert_slices(tensors, W13, expert), spec.w13),
            self.inner.dequantize(expert_slices(tensors, W2, expert), spec.w2),
        )

    def stored_fp8_weights(
        self, tensors: dict[str, torch.Tensor], spec: MoESpec, expert: int
    ) -> tuple[Fp8Weight | None, Fp8Weight | None]:
        return (
            self.inner.stored_fp8_weight(expert_slices(tensors, W13, expert), spec.w13),
            self.inner.stored_fp8_weight(expert_slices(tensors, W2, expert), spec.w2),
        )

    def stored_int_weights(
        self, tensors: dict[str, torch.Tensor], spec: MoESpec, expert: int
    ) -> tuple[IntWeight | None, IntWeight | None]:
        return (
            self.inner.stored_int_weight(expert_slices(tensors, W13, expert), spec.w13),
            self.inner.stored_int_weight(expert_slices(tensors, W2, expert), spec.w2),
        )

    def expert_twin(self, tensors: dict[str, torch.Tensor], spec: MoESpec) -> ExpertTwin:
        """Every routed expert through `inner`'s own twin (a W8A8 inner kernel's quantizes activations
        as its kernel does), its output rounded to the act dtype as `inner.apply` rounds it."""
        inner = self.inner

        def twin(e: int, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            h = inner.reference(rows, expert_slices(tensors, W13, e), spec.w13)
            y = inner.reference(spec.act(h).to(rows.dtype), expert_slices(tensors, W2, e), spec.w2)
            return y.float() * weights

        return twin

    def bind_apply(self, tensors: dict[str, torch.Tensor], spec: MoESpec) -> MoEApply:
        inner = self.inner
        experts = range(spec.num_experts)
        gate_up = [inner.bind_apply(expert_slices(tensors, W13, e), spec.w13) for e in experts]
        down = [inner.bind_apply(expert_slices(tensors, W2, e), spec.w2) for e in experts]
        first, num, hidden, act = spec.first_expert, spec.num_experts, spec.hidden, spec.act
        pad, model_hidden = spec.hidden_pad, spec.model_hidden

        def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            return down[e](act(gate_up[e](rows)).to(rows.dtype)).float()

        def run(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
            if pad:  # the layout's zero columns of H: activations padded, the output cut back
                return padded_run(F.pad(x, (0, pad)), topk_ids, topk_weights)[:, :model_hidden]
            return padded_run(x, topk_ids, topk_weights)

        def padded_run(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
            tokens, k = topk_ids.shape
            local = (topk_ids - first).reshape(-1)
            weights = topk_weights.reshape(-1).float()
            out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
            if tokens == 1:  # decode: the k picked experts, one row each
                for slot, e in enumerate(local.tolist()):
                    if 0 <= e < num:
                        out.add_(expert_mlp(e, x) * weights[slot])
                return out.to(x.dtype)
            valid = (local >= 0) & (local < num)
            slots = torch.nonzero(valid).squeeze(1)
            order = slots[torch.argsort(local[slots], stable=True)]  # (token, slot) pairs grouped by expert
            counts = torch.bincount(local[order], minlength=num).tolist()
            start = 0
            for e, count in enumerate(counts):
                if not count:
                    continue
                picked = order[start : start + count]
                start += count
                rows = picked // k
                out.index_add_(0, rows, expert_mlp(e, x[rows]) * weights[picked][:, None])
            return out.to(x.dtype)

        return run


def stacked_experts(inner: LinearKernel) -> MoEKernel:
    """The expert-group kernel storing `inner`'s layout per expert (see the module docstring)."""
    attrs: dict[str, Any] = {
        "inner": inner,
        "name": f"{inner.name}_experts",
        "elsewhere": inner.elsewhere,
        "description": f"experts stacked in {inner.name}'s layout, run expert by expert",
    }
    cls = type(f"{type(inner).__name__}Experts", (StackedExperts,), attrs)
    return cls()
