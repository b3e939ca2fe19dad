"""Route sorting for the grouped MoE GEMMs (vLLM's moe_align_block_size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoERoutes:
    """Token slots sorted by local expert and padded per expert to BLOCK_M (vLLM's
    moe_align_block_size). A slot is one (token, choice) pair, numbered t * top_k + j.

    sorted_ids    (blocks * BLOCK_M,) int32  slot of each row of the grouped GEMM; `num_slots` pads
    block_experts (blocks,) int32            local expert of each BLOCK_M block, -1: an empty block
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    block_m: int
    num_slots: int  # tokens * top_k; also the padding id (one past the last slot)
    top_k: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    first_expert: int,
    num_experts: int,
    *,
    exact_size: bool | None = None,
) -> MoERoutes:
    """Group the (T, top_k) routes by local expert (experts [first_expert, first_expert + num_experts)
    of this rank; other ids are dropped), each expert's slots in token order and padded to a whole
    number of BLOCK_M blocks. On CUDA (exact_size None or False) there is no host sync: the arrays are
    sized for the worst case (min(slots + E (BLOCK_M - 1), slots BLOCK_M) rows) and the blocks past
    the last expert are -1; on CPU (or exact_size=True) they are cut to the exact size."""
    tokens, top_k = topk_ids.shape
    slots = tokens * top_k
    dev = topk_ids.device
    local = topk_ids.reshape(-1).to(torch.int64) - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # num: not ours
    sorted_e, order = torch.sort(local, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first_sorted = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    if exact_size is None:
        exact_size = dev.type != "cuda"
    if not exact_size:
        rows = min(slots + num_experts * (block_m - 1), slots * block_m)
        rows = -(-rows // block_m) * block_m
    else:
        rows = int(ends[-1]) if num_experts else 0
    e = sorted_e.clamp(max=max(num_experts - 1, 0))
    dest = starts[e] + torch.arange(slots, device=dev) - first_sorted[e]
    dest = torch.where(sorted_e < num_experts, dest, rows)  # other ranks' slots: a discarded cell
    sorted_ids = torch.full((rows + 1,), slots, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return MoERoutes(sorted_ids[:rows], block_experts, block_m, slots, top_k)
