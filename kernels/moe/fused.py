"""The fused-MoE schedule (vLLM's fused_experts) and the base of the kernels that run it.

`fused_moe_mlp`: sort the routes by expert (kernels/moe/align.py), ONE grouped GEMM launch over
(BLOCK_M blocks x N tiles) for every expert's gate|up, silu(gate) * up in torch, ONE grouped GEMM for
every expert's down projection that multiplies each row by its routing weight, the sum over the
top-k choices in fp32. `FusedExperts` stores `stacked_experts(inner)`'s layout
(kernels/moe/stacked.py) and runs it by this schedule; a subclass launches one grouped GEMM per
part (`launch_part`) and builds its Triton kernel from `moe_tiles()`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

import torch

from kernels.base import LinearSpec
from kernels.gemm import gemm_tiles
from kernels.jit import (
    bf16_interpreter,
    check_act_dtype,
    interpreter_enabled,
    jit,
    runs_triton,
    triton_builder,
)
from kernels.launch import GemmConfig, TileKind, cuda_block_config, interpreter_config, launch_options
from kernels.moe.align import MoERoutes, moe_align_block_size
from kernels.moe.stacked import StackedExperts
from kernels.moe_base import W2, W13, MoEApply, MoESpec
from kernels.targets import Target

# launch(part, a, routes, y, routed_weights, cfg): one grouped GEMM of part "w13" or "w2" over `routes`,
# rows of `a` read per slot (w13: token = slot // top_k; w2: the slot's own row), written to y[slot].
MoEGemmLaunch = Callable[[str, torch.Tensor, MoERoutes, torch.Tensor, torch.Tensor | None, GemmConfig], None]


def moe_config(rows_per_expert: float, device: torch.device, kind: TileKind) -> GemmConfig:
    """Tiles of a grouped MoE GEMM, by the average rows (token slots) per local expert: the M
    bucket of `cuda_block_config` capped at 64 (each expert's rows are padded to BLOCK_M); no
    split-K. On the CPU interpreter 16-row blocks and wide N / K tiles."""
    m = max(1, min(int(rows_per_expert + 0.5), 64))
    if device.type != "cuda" or interpreter_enabled():
        return interpreter_config(m)
    return cuda_block_config(m, kind)


def fused_moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    spec: MoESpec,
    launch: MoEGemmLaunch,
    kind: TileKind,
    kernel: str,
) -> torch.Tensor:
    """The fused-MoE schedule (module docstring); x (T, H) -> (T, H) in x's dtype."""
    check_act_dtype(x, kernel)
    tokens, top_k = topk_ids.shape
    hidden, inter = spec.hidden, spec.intermediate
    x = x.reshape(tokens, hidden).contiguous()
    cfg = moe_config(tokens * top_k / spec.num_experts, x.device, kind)
    routes = moe_align_block_size(topk_ids, cfg.block_m, spec.first_expert, spec.num_experts)
    if tokens == 0 or routes.num_blocks == 0:
        return x.new_zeros(tokens, hidden)
    # Rows of slots not routed here (other ranks' experts) are never written by the kernels: gate|up
    # rows must stay finite (fp8_moe_w8a8 quantizes every row) and down rows must add nothing.
    alloc = x.new_empty if spec.num_experts == spec.total_experts else x.new_zeros
    gate_up = alloc(routes.num_slots, 2 * inter)
    launch(W13, x, routes, gate_up, None, cfg)
    h = spec.act(gate_up).to(x.dtype)
    down = x.new_zeros(routes.num_slots, hidden)  # a memset: ids out of range add nothing either
    launch(W2, h, routes, down, topk_weights.reshape(-1).float().contiguous(), cfg)
    return down.view(tokens, top_k, hidden).float().sum(1).to(x.dtype)


def moe_grid(routes: MoERoutes, n: int, block_n: int) -> tuple[int, int]:
    """(BLOCK_M blocks, N tiles): consecutive programs share an N tile (the same expert's weights)."""
    return routes.num_blocks, -(-n // block_n)


@triton_builder
def moe_tiles(tl: ModuleType) -> tuple[Any, Any]:
    """(moe_tile, store_slots), the `@triton.jit` frame of a grouped MoE GEMM kernel:
    `moe_tile`: this program's block (grid axis 0) and N tile (axis 1): its local expert (-1: an
    empty block), the slots of its BLOCK_M rows, the rows of the activations they read (slot // a_div)
    with their mask, the output columns with theirs;
    `store_slots`: multiply each row by its slot's routing weight (MUL_WEIGHT), store it at y[slot]."""
    store_tile = gemm_tiles()[1]

    def moe_tile(SORTED, BLOCK_EXPERT, num_slots, a_div, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + pid_m)
        slots = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        rows = (slots // a_div).to(tl.int64)  # w13: the slot's token; w2: the slot's own row
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return expert, slots, rows, slots < num_slots, offs_n, offs_n < N

    def store_slots(
        acc, Y, TOPK_W, slots, offs_n, mask_m, mask_n, N, MUL_WEIGHT: tl.constexpr, BF16_INTERP: tl.constexpr
    ):
        if MUL_WEIGHT:
            acc = acc * tl.load(TOPK_W + slots, mask=mask_m, other=0.0)[:, None]
        store_tile(acc, Y, Y, slots.to(tl.int64), offs_n, mask_m, mask_n, N, 0, False, 1, BF16_INTERP)

    return jit(moe_tile), jit(store_slots)


class FusedExperts(StackedExperts):
    """A stacked layout (`stacked_experts(inner)`'s tensors, declaration, prepare and dequantize)
    run by `fused_moe_mlp`: the subclass launches one grouped GEMM per part (`launch_part`).
    Expert biases are refused (the fused kernels do not add them; the per-expert
    `<inner>_experts` kernel does)."""

    kind: ClassVar[TileKind] = "dequant"  # the block-size family (moe_config)

    def supports(self, spec: MoESpec, target: Target) -> tuple[bool, str]:
        if spec.w13.has_bias or spec.w2.has_bias:
            return False, (
                f"{self.name} has no expert biases (layer {spec.name} has them); "
                f"the per-expert {self.based_on}_experts kernel runs them"
            )
        return super().supports(spec, target)  # the linear kernel's rules for w13 and w2, per expert

    def bind_apply(self, tensors: dict[str, torch.Tensor], spec: MoESpec) -> MoEApply:
        parts = {part: part_tensors(tensors, part) for part in (W13, W2)}
        launch_part, reference, name, kind = self.launch_part, self.reference, self.name, self.kind

        def launch(
            part: str,
            a: torch.Tensor,
            routes: MoERoutes,
            y: torch.Tensor,
            weights: torch.Tensor | None,
            cfg: GemmConfig,
        ) -> None:
            a_div = routes.top_k if part == W13 else 1  # w13 reads the slot's token, w2 the slot's row
            launch_part(PartLaunch(parts[part], spec.part(part), a, routes, y, weights, cfg, a_div))

        def run(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
            if not runs_triton(x):
                return reference(x, topk_ids, topk_weights, tensors, spec)
            return fused_moe_mlp(x, topk_ids, topk_weights, spec, launch, kind, name)

        return run

    def launch_part(self, p: PartLaunch) -> None:
        """One grouped GEMM over `p.routes`: y[slot] = a[slot // a_div] @ W_e.T (times the slot's
        routing weight when `p.weights` is given) for the part's stacked tensors."""
        raise NotImplementedError


class PartLaunch(NamedTuple):
    """What `FusedExperts.launch_part` gets for one grouped GEMM."""

    tensors: dict[str, torch.Tensor]  # the part's stacked tensors, suffix -> (E, ...)
    spec: LinearSpec  # the part's per-expert spec
    a: torch.Tensor  # activations: (T, K) for w13, (slots, K) for w2
    routes: MoERoutes
    y: torch.Tensor  # output rows, one per slot
    weights: torch.Tensor | None  # routing weight per slot, multiplied in when given
    cfg: GemmConfig
    a_div: int  # slot -> row of `a`: top_k for w13 (the slot's token), 1 for w2 (the slot's row)

    def expert_meta(self, cfg: GemmConfig | None = None) -> dict[str, Any]:
        """Keyword arguments every grouped GEMM kernel takes: tiles, the interpreter flag, launch options."""
        c = cfg or self.cfg
        return {
            "MUL_WEIGHT": self.weights is not None,
            "BLOCK_M": self.routes.block_m,
            "BLOCK_N": c.block_n,
            "BLOCK_K": c.block_k,
            "BF16_INTERP": bf16_interpreter(self.a),
            **launch_options(self.a, c),
        }


def part_tensors(tensors: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The stacked tensors of one part, by suffix ("w13.qweight" -> "qweight"), contiguous (the
    kernels step from expert to expert by the size of one expert's slice)."""
    head = part + "."
    return {name[len(head) :]: t.contiguous() for name, t in tensors.items() if name.startswith(head)}
