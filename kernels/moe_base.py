"""The contract of mixture-of-experts kernels: one expert group (every expert's gate|up and down
projections of one MoE layer) prepared and run as a unit.

Layout: an expert-group kernel stores, for each tensor its per-expert layout has, ONE stacked tensor
with the experts as the leading dimension: `w13.<suffix>` (E, ...) holds every expert's fused
gate|up (gate rows first, as vLLM's `w13`) and `w2.<suffix>` (E, ...) every expert's down projection.
Expert e's slice is exactly what the per-expert layout would store for that expert alone, so a Marlin
expert group is byte for byte vLLM's `gptq_marlin_moe_repack` (`gptq_marlin_repack` per expert).

Offline (converter): `prepare_expert(w13, w2, spec, target)` turns one expert's canonical weights into
its slices; the converter writes them into the stacked tensors expert by expert (bounded memory).
Runtime: `apply(x, topk_ids, topk_weights, tensors, spec)` runs the whole expert MLP of the layer —
for every token, sum over its k experts of weight * down(act(w13 x)) — and returns (T, H). `act` is
`spec.activation`: silu(gate) * up by default; gpt-oss's clamped "swigluoai" reads gate|up rows
interleaved (gate even, up odd: w13 is stored so, as vLLM stores it); expert biases, when the
layer has them, are added after each GEMM. A layout may pad H and I with zeros (`MoEKernel.padded`):
`apply` then pads the activations and cuts the output back. Expert ids are global; a rank holding
experts [first_expert, first_expert + num_experts) (expert parallel) adds only theirs (the runtime
all-reduces across ranks).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kernels.base import Fp8Weight, IntWeight, LinearSpec, SourceWeight, StoredTensor, stored_act_dtypes
from kernels.targets import Target

SILU = "silu"  # silu(gate) * up; w13 rows: gate then up
# gpt-oss: w13 rows interleaved (gate even, up odd); gate clamped above and up on both sides at the
# spec's `swiglu_limit`, then (up + 1) * gate * sigmoid(SWIGLU_OAI_ALPHA * gate)
SWIGLU_OAI = "swigluoai"
EXPERT_ACTIVATIONS = (SILU, SWIGLU_OAI)
SWIGLU_OAI_ALPHA = 1.702
MoEApply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# twin(e, rows, weights): local expert e's output for the (R, H) rows routed to it, times their
# routing weights (R, 1) fp32 -> (R, H) fp32
ExpertTwin = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
W13, W2 = "w13", "w2"


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer's expert group on one rank. `w13` / `w2` describe ONE expert's projections on
    this rank: w13 n = 2 * I / tp (shards gate, up), k = H; w2 n = H, k = I / tp (row-parallel)."""

    name: str  # runtime name, e.g. "model.layers.3.mlp.experts"
    num_experts: int  # experts stored on this rank
    top_k: int
    w13: LinearSpec
    w2: LinearSpec
    first_expert: int = 0  # global id of this rank's first expert (expert parallel)
    total_experts: int = 0  # experts of the whole layer (0: num_experts)
    activation: str = SILU  # EXPERT_ACTIVATIONS
    swiglu_limit: float = 0.0  # SWIGLU_OAI's clamp
    # Zero padding the layout adds (MoEKernel.padded): H -> w13.k = H + hidden_pad (the activations
    # are padded to it, the output cut back), I -> w2.k = I + intermediate_pad per rank
    hidden_pad: int = 0
    intermediate_pad: int = 0

    def __post_init__(self) -> None:
        if self.total_experts == 0:
            object.__setattr__(self, "total_experts", self.num_experts)
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"{self.name}: expert activation {self.activation!r}, not one of {EXPERT_ACTIVATIONS}"
            )

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of (T, 2I) w13 outputs (biases added) -> (T, I) fp32."""
        if self.activation == SILU:
            return swiglu(gate_up)
        return swiglu_oai(gate_up, self.swiglu_limit)

    @property
    def hidden(self) -> int:
        """The stored hidden size (padded when the layout pads it)."""
        return self.w13.k

    @property
    def intermediate(self) -> int:
        """This rank's stored intermediate size per expert (padded when the layout pads it)."""
        return self.w2.k

    @property
    def model_hidden(self) -> int:
        """The model's hidden size: what `apply` takes and returns."""
        return self.w13.k - self.hidden_pad

    @property
    def model_intermediate(self) -> int:
        return self.w2.k - self.intermediate_pad

    def with_padding(self, hidden_multiple: int, intermediate_multiple: int) -> MoESpec:
        """The spec with H and this rank's I rounded up to the multiples (zero rows and columns)."""
        h, i = self.model_hidden, self.model_intermediate
        hp = -(-h // hidden_multiple) * hidden_multiple
        ip = -(-i // intermediate_multiple) * intermediate_multiple
        if (hp, ip) == (self.hidden, self.intermediate):
            return self
        gate, up = (dataclasses.replace(shard, size=ip) for shard in self.w13.shards)
        w13 = dataclasses.replace(self.w13, n=2 * ip, k=hp, k_full=hp, shards=(gate, up))
        w2 = dataclasses.replace(self.w2, n=hp, k=ip, k_full=self.w2.k_full // i * ip)
        return dataclasses.replace(self, w13=w13, w2=w2, hidden_pad=hp - h, intermediate_pad=ip - i)

    def part(self, prefix: str) -> LinearSpec:
        return self.w13 if prefix == W13 else self.w2

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["w13"], d["w2"] = self.w13.to_json(), self.w2.to_json()
        if self.activation == SILU:  # the defaults: manifests from before the fields read the same
            del d["activation"], d["swiglu_limit"]
        if not self.hidden_pad and not self.intermediate_pad:
            del d["hidden_pad"], d["intermediate_pad"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MoESpec:
        d = dict(d)
        d["w13"], d["w2"] = LinearSpec.from_json(d["w13"]), LinearSpec.from_json(d["w2"])
        return cls(**d)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for (T, 2I) gate|up rows, computed in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_oai(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of (T, 2I) interleaved gate/up rows, computed in fp32."""
    h = gate_up.float()
    gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


class MoEKernel(ABC):
    """An expert-group kernel: owns a stacked per-expert layout (prepare_expert / dequantize_expert)
    and runs the layer's expert MLP (apply). Declares what it is as a `LinearKernel` does."""

    name: ClassVar[str]
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]]
    targets: ClassVar[frozenset[Target]]
    elsewhere: ClassVar[str] = ""
    cpu_act_dtype: ClassVar[torch.dtype] = torch.float32
    based_on: ClassVar[str] = ""  # the linear kernel whose per-expert layout it stacks
    description: ClassVar[str] = ""

    def act_dtypes(self, spec: MoESpec, target: Target) -> frozenset[torch.dtype]:
        """Activation dtypes the group takes (output in the input's dtype), as `LinearKernel.act_dtypes`."""
        return stored_act_dtypes(spec.w13.torch_act_dtype, target)

    def can_implement(self, spec: MoESpec, target: Target) -> tuple[bool, str]:
        """(True, "") or (False, a reason the user can act on)."""
        if target not in self.targets:
            names = "/".join(sorted(t.value for t in self.targets))
            hint = f"; {self.elsewhere}" if self.elsewhere else ""
            return False, f"{self.name} runs on {names} only (got {target.value}){hint}"
        if spec.w13.scheme not in self.schemes or spec.w2.scheme != spec.w13.scheme:
            schemes = "/".join(sorted(self.schemes))
            return False, (
                f"{self.name} takes {schemes} experts, not w13 {spec.w13.scheme!r} / w2 {spec.w2.scheme!r}"
            )
        return self.supports(spec, target)

    def supports(self, spec: MoESpec, target: Target) -> tuple[bool, str]:
        return True, ""

    def padded(self, spec: MoESpec) -> MoESpec:
        """The spec this kernel stores the group as: `spec` itself unless its layout pads H and I
        (`MoESpec.with_padding`); the converter plans and writes with it."""
        return spec

    @abstractmethod
    def stored_tensors(self, spec: MoESpec, target: Target) -> dict[str, StoredTensor]:
        """Stacked tensors of the group on this rank: "w13.<suffix>" / "w2.<suffix>" -> (E, ...)."""

    @abstractmethod
    def prepare_expert(
        self, w13: SourceWeight, w2: SourceWeight, spec: MoESpec, target: Target
    ) -> dict[str, torch.Tensor]:
        """One expert's slices of the stacked tensors (same keys, no leading E dimension)."""

    def needs_group_statistics(self, spec: MoESpec) -> bool:
        """Whether the layout needs values reduced over every local expert before any expert is
        prepared (vLLM's Marlin FP4 MoE prepare picks one NVFP4 scale factor per part for the group)."""
        return False

    def group_statistics(self, w13: SourceWeight, w2: SourceWeight, spec: MoESpec) -> tuple[float, float]:
        """One expert's (w13, w2) shares of those values (the converter takes the max of each)."""
        raise NotImplementedError(f"{self.name} needs no group statistics")

    def with_group_statistics(self, spec: MoESpec, values: tuple[float, float]) -> MoESpec:
        """`spec` once the group's (w13, w2) values are known."""
        return spec

    @abstractmethod
    def dequantize_expert(
        self, tensors: dict[str, torch.Tensor], spec: MoESpec, expert: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `expert`'s (w13 (2I, H), w2 (H, I)) float32 weights."""

    def stored_fp8_weights(
        self, tensors: dict[str, torch.Tensor], spec: MoESpec, expert: int
    ) -> tuple[Fp8Weight | None, Fp8Weight | None]:
        """Local expert `expert`'s (w13, w2) as `LinearKernel.stored_fp8_weight` gives them."""
        return None, None

    def stored_int_weights(
        self, tensors: dict[str, torch.Tensor], spec: MoESpec, expert: int
    ) -> tuple[IntWeight | None, IntWeight | None]:
        """Local expert `expert`'s (w13, w2) as `LinearKernel.stored_int_weight` gives them, for
        verification without dequantizing; (None, None): verified through `dequantize_expert`."""
        return None, None

    def apply(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        spec: MoESpec,
    ) -> torch.Tensor:
        """x (T, H), topk_ids (T, k) global expert ids, topk_weights (T, k) -> (T, H) in x's dtype."""
        return self.bind_apply(tensors, spec)(x, topk_ids, topk_weights)

    @abstractmethod
    def bind_apply(self, tensors: dict[str, torch.Tensor], spec: MoESpec) -> MoEApply:
        """`apply` for one bound group, as the runtime's hot path calls it (tensors resolved once)."""

    def reference(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        spec: MoESpec,
    ) -> torch.Tensor:
        """Pure-torch twin of `apply`: every routed local expert's rows through `expert_twin`, the
        weighted sum in fp32."""
        return routed_sum(x, topk_ids, topk_weights, spec, self.expert_twin(tensors, spec))

    def expert_twin(self, tensors: dict[str, torch.Tensor], spec: MoESpec) -> ExpertTwin:
        """The twin of one local expert's share (`ExpertTwin`): here the dequantized expert (biases
        added) in fp32; a kernel whose `apply` rounds or quantizes on the way mirrors that instead."""
        b13, b2 = tensors.get(f"{W13}.bias"), tensors.get(f"{W2}.bias")

        def twin(e: int, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            w13, w2 = self.dequantize_expert(tensors, spec, e)
            h = rows.float() @ w13.T
            if b13 is not None:
                h = h + b13[e].float()
            y = spec.act(h) @ w2.T
            if b2 is not None:
                y = y + b2[e].float()
            return y * weights

        return twin


def routed_sum(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, spec: MoESpec, twin: ExpertTwin
) -> torch.Tensor:
    """x (T, H) -> (T, H) in x's dtype: for every token, the fp32 sum of `twin` over its local experts."""
    x = F.pad(x, (0, spec.hidden_pad)) if spec.hidden_pad else x
    out = torch.zeros(x.shape[0], spec.hidden, dtype=torch.float32, device=x.device)
    for e, token, slot in routed_experts(topk_ids, spec):
        out.index_add_(0, token, twin(e, x[token], topk_weights[token, slot].float()[:, None]))
    return out[:, : spec.model_hidden].to(x.dtype)


def routed_experts(topk_ids: torch.Tensor, spec: MoESpec) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(local expert, tokens routed to it, their top-k choice index) for every local expert with tokens."""
    for e in range(spec.num_experts):
        token, slot = torch.nonzero(topk_ids == spec.first_expert + e, as_tuple=True)
        if token.numel():
            yield e, token, slot


def expert_slices(tensors: dict[str, torch.Tensor], prefix: str, expert: int) -> dict[str, torch.Tensor]:
    """Expert `expert`'s per-expert tensors of the w13 or w2 part: "w13.qweight"[e] -> "qweight"."""
    head = prefix + "."
    return {name[len(head) :]: t[expert] for name, t in tensors.items() if name.startswith(head)}
