"""gpt-oss checkpoints store each MoE layer's experts stacked; the converter reads them per expert.

A gpt-oss checkpoint holds, per MoE layer `P = model.layers.L.mlp.experts`, one tensor per kind for
all E experts, gate and up rows interleaved (gate j at 2j, up j at 2j + 1):

    bf16 (transformers' GptOssExperts, x @ W):    P.gate_up_proj (E, H, 2I)   P.down_proj (E, I, H)
    MXFP4 (OpenAI's release, W @ x rows):         P.gate_up_proj_blocks (E, 2I, H/32, 16) uint8
                                                  P.gate_up_proj_scales (E, 2I, H/32) uint8 (E8M0)
                                                  P.down_proj_blocks (E, H, I/32, 16), .._scales
    both:                                         P.gate_up_proj_bias (E, 2I)  P.down_proj_bias (E, H)

`StackedExpertsCheckpoint` presents them as the per-expert modules every other checkpoint has,
`P.{e}.gate_proj | up_proj | down_proj`, with tensors `weight` (N, K) (bf16) or `blocks` (N, K/32, 16)
and `scales` (N, K/32) (MXFP4), and `bias` (N,): what the formats decode and the expert-group unit
reads, expert by expert. Reading one expert reads its contiguous slice of each stacked tensor once
(one positioned read or ranged GET), never the whole stack. The expert-group unit interleaves gate
and up again when it fuses w13 (gpt-oss's activation reads them so, and vLLM's Marlin bytes keep
them so).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError
from services.convert.safetensors_io import DTYPES, TensorInfo

EXPERTS = ".mlp.experts."
GATE_UP, DOWN = "gate_up_proj", "down_proj"
# per-expert tensor suffix -> the stacked tensor's suffix after `gate_up_proj` / `down_proj`
STACKED_SUFFIXES = {"weight": "", "blocks": "_blocks", "scales": "_scales", "bias": "_bias"}
PART_OF = {"gate_proj": GATE_UP, "up_proj": GATE_UP, "down_proj": DOWN}


@dataclass(frozen=True)
class ExpertTensor:
    """Where one per-expert tensor comes from: expert `expert`'s slice of `stacked`."""

    stacked: str  # e.g. model.layers.0.mlp.experts.gate_up_proj_blocks
    expert: int
    part: str  # gate_proj | up_proj | down_proj
    suffix: str  # weight | blocks | scales | bias


def _per_expert_shape(suffix: str, part: str, stacked_shape: tuple[int, ...]) -> tuple[int, ...]:
    one = stacked_shape[1:]
    if suffix == "weight":  # x @ W: (K, N') -> (N, K)
        k, n = one
        return (n // 2 if part != "down_proj" else n, k)
    if part == "down_proj":
        return one
    return (one[0] // 2, *one[1:])


@dataclass
class StackedExpertsCheckpoint(Checkpoint):
    """A checkpoint whose stacked expert tensors read as per-expert ones (module docstring)."""

    experts: dict[str, ExpertTensor] = field(default_factory=dict)
    stacked: dict[str, TensorInfo] = field(default_factory=dict)  # out of `tensors`, read through the view

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        real = [n for n in names if n not in self.experts]
        out = super().read(real) if real else {}
        slices: dict[tuple[str, int], torch.Tensor] = {}
        for name in names:
            if name in self.experts:
                out[name] = self._expert_tensor(self.experts[name], slices)
        return {n: out[n] for n in names}

    def _expert_tensor(self, t: ExpertTensor, slices: dict[tuple[str, int], torch.Tensor]) -> torch.Tensor:
        whole = slices.get((t.stacked, t.expert))
        if whole is None:
            whole = slices[(t.stacked, t.expert)] = self._read_expert(t.stacked, t.expert)
        if t.suffix == "weight":  # (K, N') x @ W -> rows of W
            whole = whole.T
        if t.part == "gate_proj":
            whole = whole[0::2]
        elif t.part == "up_proj":
            whole = whole[1::2]
        return whole.contiguous()

    def _read_expert(self, stacked: str, expert: int) -> torch.Tensor:
        info = self.stacked[stacked]
        per = info.nbytes // info.shape[0]
        raw = self.read_raw(stacked, expert * per, (expert + 1) * per)
        return raw.view(DTYPES[info.dtype]).reshape(info.shape[1:])

    def info(self, name: str) -> TensorInfo:
        return self.stacked[name] if name in self.stacked else super().info(name)


def stacked_expert_tensors(tensors: dict[str, TensorInfo]) -> list[str]:
    """The stacked expert tensors among a checkpoint's (none: an ordinary checkpoint)."""
    return [
        n
        for n in tensors
        if EXPERTS in n and n.rsplit(".", 1)[-1].startswith((GATE_UP, DOWN)) and len(tensors[n].shape) >= 2
    ]


def per_expert_view(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt` itself, or a `StackedExpertsCheckpoint` when it stacks its experts: the stacked tensors
    replaced in the index by the per-expert ones they hold (the same bytes in all)."""
    stacked = stacked_expert_tensors(ckpt.tensors)
    if not stacked:
        return ckpt
    tensors = dict(ckpt.tensors)
    experts: dict[str, ExpertTensor] = {}
    for name in stacked:
        info = tensors.pop(name)
        prefix, last = name.rsplit(".", 1)
        kind = GATE_UP if last.startswith(GATE_UP) else DOWN
        suffix = next((s for s, tail in STACKED_SUFFIXES.items() if last == kind + tail), None)
        if suffix is None:
            known = ", ".join(kind + tail for tail in STACKED_SUFFIXES.values())
            raise ConversionError(f"stacked expert tensor {name}: unknown kind {last!r} (known: {known})")
        itemsize = DTYPES[info.dtype].itemsize
        for e in range(info.shape[0]):
            for part in (p for p, of in PART_OF.items() if of == kind):
                shape = _per_expert_shape(suffix, part, info.shape)
                virtual = f"{prefix}.{e}.{part}.{suffix}"
                nbytes = math.prod(shape) * itemsize
                tensors[virtual] = TensorInfo(virtual, info.file, info.dtype, shape, 0, nbytes)
                experts[virtual] = ExpertTensor(name, e, part, suffix)
    return StackedExpertsCheckpoint(
        source=ckpt.source, config=ckpt.config, tensors=tensors, weight_files=ckpt.weight_files,
        side_configs=ckpt.side_configs, experts=experts, stacked={n: ckpt.tensors[n] for n in stacked},
    )  # fmt: skip
