"""Fused FP8 expert groups: `fp8_moe_w8a8` (sm89/sm90) and `fp8_moe_w8a16` (sm75 ... sm90; on sm80/sm86
vLLM runs FP8 experts on Marlin, which kernels/moe/fp8_marlin.py holds).

Layouts are the stacked per-expert layouts of the linear kernels they are based on (expert e's slice
is exactly what that kernel stores for the expert alone, kernels/moe/stacked.py):
    fp8_moe_w8a8 = stacked fp8_w8a8:
        w13.weight (E, 2I, H) / w2.weight (E, H, I) float8_e4m3fn, row-major (K-major)
        w13.weight_scale / w2.weight_scale (E, 1) float32 per-tensor or (E, N) per-channel
        Per-tensor gate|up shards are requantized to the expert's max shard scale by fp8_w8a8.prepare
        (vLLM's Fp8MoEMethod: requantize_with_max_scale per expert), so one scale per expert remains.
    fp8_moe_w8a16 = stacked fp8_w8a16:
        weight as above; weight_scale (E, N) float32 per row (per-tensor shard scales expanded over
        their rows, per-channel as is) or (E, ceil(N / bn), ceil(K / bk)) block scales.
Runtime: the fused schedule of kernels/moe/fused.py.
* w8a8: the GEMM inputs (x, then the silu * up activations) are quantized per token (row) to e4m3 by
  fp8_w8a8's dynamic per-token kernel; each block runs an FP8 tensor-core dot against its expert's
  weight and scales the fp32 accumulator by token scale x weight scale. `reference` mirrors both
  activation quantizations in torch.
* w8a16: e4m3 weights decoded exactly from their bits (no FP8 hardware needed), bf16/fp16 dot; per-row
  scales multiply the accumulator once, block scales each K block's partial dot. `reference` is the
  base twin (dequantized fp32 experts).
Without the interpreter on CPU tensors `apply` runs `reference`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.fp8_tiles import fp8_tiles
from kernels.fp8_w8a8 import Fp8W8A8Kernel, quantize_per_token, quantize_per_token_reference
from kernels.fp8_w8a16 import Fp8W8A16Kernel, fit_to_fp8_blocks
from kernels.jit import jit, triton_builder
from kernels.launch import TileKind
from kernels.moe.fused import FusedExperts, PartLaunch, moe_grid, moe_tiles
from kernels.moe_base import ExpertTwin, MoESpec


class Fp8MoEW8A8Kernel(FusedExperts):
    """`stacked_experts(fp8_w8a8)`'s layout; dynamic per-token FP8 activations, FP8 tensor cores."""

    inner: ClassVar[Fp8W8A8Kernel] = Fp8W8A8Kernel()
    name: ClassVar[str] = "fp8_moe_w8a8"
    elsewhere: ClassVar[str] = "sm80/sm86 have no FP8 tensor cores and use fp8_marlin_moe, sm75 fp8_moe_w8a16"
    description: ClassVar[str] = (
        "FP8 e4m3 W8A8 experts (per-tensor/channel scales, dynamic per-token activations), fused Triton"
    )
    kind: ClassVar[TileKind] = "fp8"

    def launch_part(self, p: PartLaunch) -> None:
        spec, routes = p.spec, p.routes
        aq, a_scale = quantize_per_token(p.a)
        ws = p.tensors["weight_scale"]  # (E, 1) or (E, N)
        _w8a8_kernel()[moe_grid(routes, spec.n, p.cfg.block_n)](
            aq, a_scale, p.tensors["weight"], ws, routes.sorted_ids, routes.block_experts,
            p.weights if p.weights is not None else a_scale, p.y,
            spec.n, spec.k, routes.num_slots, p.a_div, ws[0].numel(),
            PER_CHANNEL=ws[0].numel() > 1, **p.expert_meta(),
        )  # fmt: skip

    def expert_twin(self, tensors: dict[str, torch.Tensor], spec: MoESpec) -> ExpertTwin:
        """Both GEMM inputs quantized per token (fp8_w8a8's reference), the dequantized expert in fp32,
        gate|up, the activation and the weighted output rounded to the act dtype as `apply` does."""

        def twin(e: int, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            act = rows.dtype
            w13, w2 = (w.to(rows.device) for w in self.dequantize_expert(tensors, spec, e))
            h = spec.act((_per_token_dequant(rows) @ w13.T).to(act)).to(act)
            return ((_per_token_dequant(h) @ w2.T) * weights).to(act).float()

        return twin


def _per_token_dequant(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_per_token_reference(x)
    return q.float() * s[:, None]


class Fp8MoEW8A16Kernel(FusedExperts):
    """`stacked_experts(fp8_w8a16)`'s layout; e4m3 weights decoded in the kernel, bf16/fp16 dot."""

    inner: ClassVar[Fp8W8A16Kernel] = Fp8W8A16Kernel()
    name: ClassVar[str] = "fp8_moe_w8a16"
    elsewhere: ClassVar[str] = "the cpu target uses cpu_fp8_experts"
    description: ClassVar[str] = (
        "FP8 e4m3 weight-only (W8A16) experts, per-row or block scales, fused Triton grouped GEMMs"
    )

    def launch_part(self, p: PartLaunch) -> None:
        spec, routes = p.spec, p.routes
        cfg, block, (bn, bk) = fit_to_fp8_blocks(p.cfg, spec)
        scale = p.tensors["weight_scale"]
        _w8a16_kernel()[moe_grid(routes, spec.n, cfg.block_n)](
            p.a, p.tensors["weight"].view(torch.uint8), scale, routes.sorted_ids, routes.block_experts,
            p.weights if p.weights is not None else scale, p.y,
            spec.n, spec.k, routes.num_slots, p.a_div, scale[0].numel(), bn, bk, -(-spec.k // bk),
            BLOCK_SCALES=block, **p.expert_meta(cfg),
        )  # fmt: skip


@triton_builder
def _w8a8_kernel(tl: ModuleType) -> Any:
    moe_tile, store_slots = moe_tiles()
    token_scaled = fp8_tiles()[2]

    def fp8_moe_w8a8_kernel(
        XQ, XS, W, WS, SORTED, BLOCK_EXPERT, TOPK_W, Y,
        N, K, num_slots, a_div, ws_expert_stride,
        PER_CHANNEL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        expert, slots, rows, mask_m, offs_n, mask_n = moe_tile(
            SORTED, BLOCK_EXPERT, num_slots, a_div, N, BLOCK_M, BLOCK_N
        )
        if expert < 0:  # past the last expert's padded rows (CUDA sizes the grid for the worst case)
            return
        e = expert.to(tl.int64)
        acc = token_scaled(
            XQ, XS, W + e * N * K, WS + e * ws_expert_stride, rows, mask_m, offs_n, mask_n,
            0, tl.cdiv(K, BLOCK_K), K, BLOCK_M, BLOCK_N, BLOCK_K, PER_CHANNEL, False,
        )  # fmt: skip
        store_slots(acc, Y, TOPK_W, slots, offs_n, mask_m, mask_n, N, MUL_WEIGHT, BF16_INTERP)

    return jit(fp8_moe_w8a8_kernel)


@triton_builder
def _w8a16_kernel(tl: ModuleType) -> Any:
    moe_tile, store_slots = moe_tiles()
    e4m3_gemm = fp8_tiles()[1]

    def fp8_moe_w8a16_kernel(
        X, W, S, SORTED, BLOCK_EXPERT, TOPK_W, Y,
        N, K, num_slots, a_div, s_expert_stride, block_n, block_k, k_blocks,
        BLOCK_SCALES: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        expert, slots, rows, mask_m, offs_n, mask_n = moe_tile(
            SORTED, BLOCK_EXPERT, num_slots, a_div, N, BLOCK_M, BLOCK_N
        )
        if expert < 0:
            return
        e = expert.to(tl.int64)
        acc = e4m3_gemm(
            X, W + e * N * K, S + e * s_expert_stride, rows, mask_m, offs_n, mask_n,
            0, tl.cdiv(K, BLOCK_K), K, block_n, block_k, k_blocks,
            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_SCALES, BF16_INTERP,
        )  # fmt: skip
        store_slots(acc, Y, TOPK_W, slots, offs_n, mask_m, mask_n, N, MUL_WEIGHT, BF16_INTERP)

    return jit(fp8_moe_w8a16_kernel)
