"""Fused FP8 expert groups: `fp8_moe_w8a8` (sm89/sm90) and `fp8_moe_w8a16` (sm75 ... sm90).

Layouts are the stacked per-expert layouts of the linear kernels they are based on (expert e's slice
is exactly what that kernel stores for the expert alone, kernels/experts.py):
    fp8_moe_w8a8 = stacked fp8_w8a8:
        w13.weight (E, 2I, H) / w2.weight (E, H, I) float8_e4m3fn, row-major (K-major)
        w13.weight_scale / w2.weight_scale (E, 1) float32 per-tensor or (E, N) per-channel
        Per-tensor gate|up shards are requantized to the expert's max shard scale by fp8_w8a8.prepare
        (vLLM's Fp8MoEMethod: requantize_with_max_scale per expert), so one scale per expert remains.
    fp8_moe_w8a16 = stacked fp8_w8a16:
        weight as above; weight_scale (E, N) float32 per row (per-tensor shard scales expanded over
        their rows, per-channel as is) or (E, ceil(N / bn), ceil(K / bk)) block scales.
Runtime: vLLM's fused_moe schedule (kernels/triton_utils.py `fused_moe_mlp`): route-sort, one grouped
GEMM launch for every expert's gate|up, silu(gate) * up in torch, one grouped GEMM for every expert's
down projection with the routing weight applied per row, the top-k sum in fp32.
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

from dataclasses import replace
from functools import cache
from typing import Any, ClassVar, Literal

import torch

from kernels.base import Target
from kernels.errors import LayoutError
from kernels.experts import FusedExperts, PartLaunch
from kernels.fp8_w8a8 import Fp8W8A8Kernel, quantize_per_token, quantize_per_token_reference
from kernels.fp8_w8a16 import Fp8W8A16Kernel
from kernels.moe_base import MoESpec, swiglu
from kernels.targets import GPU_TARGETS, gpu_targets
from kernels.triton_utils import (
    bf16_interpreter,
    largest_block_dividing,
    launch_options,
    moe_grid,
    moe_helpers,
    with_helpers,
)


class Fp8MoEW8A8Kernel(FusedExperts):
    """`stacked_experts(fp8_w8a8)`'s layout; dynamic per-token FP8 activations, FP8 tensor cores."""

    inner: ClassVar[Fp8W8A8Kernel] = Fp8W8A8Kernel()
    name: ClassVar[str] = "fp8_moe_w8a8"
    layout_version: ClassVar[int] = Fp8W8A8Kernel.layout_version
    schemes: ClassVar[frozenset[str]] = frozenset({"fp8"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(89)
    elsewhere: ClassVar[str] = "sm75/sm80/sm86 have no FP8 tensor cores and use fp8_moe_w8a16"
    based_on: ClassVar[str] = "fp8_w8a8"
    description: ClassVar[str] = (
        "FP8 e4m3 W8A8 experts (per-tensor/channel scales, dynamic per-token activations), fused Triton"
    )
    kind: ClassVar[Literal["dequant", "fp8"]] = "fp8"

    def launch_part(self, p: PartLaunch) -> None:
        t, spec, a, routes, y, weights, cfg, a_div = p
        aq, a_scale = quantize_per_token(a)
        ws = t["weight_scale"]  # (E, 1) or (E, N)
        _w8a8_kernel()[moe_grid(routes, spec.n, cfg.block_n)](
            aq, a_scale, t["weight"], ws, routes.sorted_ids, routes.block_experts,
            weights if weights is not None else a_scale, y,
            spec.n, spec.k, routes.num_slots, a_div, ws[0].numel(),
            PER_CHANNEL=ws[0].numel() > 1, MUL_WEIGHT=weights is not None,
            BLOCK_M=routes.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BF16_INTERP=bf16_interpreter(a), **launch_options(a, cfg),
        )  # fmt: skip

    def reference(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        spec: MoESpec,
    ) -> torch.Tensor:
        """Torch twin of `apply`: both GEMM inputs quantized per token (fp8_w8a8's reference), the
        dequantized experts in fp32, gate|up and silu * up rounded to the act dtype as `apply` does."""
        act = x.dtype
        out = torch.zeros(x.shape[0], spec.hidden, dtype=torch.float32, device=x.device)
        xq = _per_token_dequant(x)
        for e in range(spec.num_experts):
            token, slot = torch.nonzero(topk_ids == spec.first_expert + e, as_tuple=True)
            if token.numel() == 0:
                continue
            w13, w2 = (w.to(x.device) for w in self.dequantize_expert(tensors, spec, e))
            h = swiglu((xq[token] @ w13.T).to(act)).to(act)
            y = (_per_token_dequant(h) @ w2.T) * topk_weights[token, slot].float()[:, None]
            out.index_add_(0, token, y.to(act).float())
        return out.to(act)


def _per_token_dequant(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_per_token_reference(x)
    return q.float() * s[:, None]


class Fp8MoEW8A16Kernel(FusedExperts):
    """`stacked_experts(fp8_w8a16)`'s layout; e4m3 weights decoded in the kernel, bf16/fp16 dot."""

    inner: ClassVar[Fp8W8A16Kernel] = Fp8W8A16Kernel()
    name: ClassVar[str] = "fp8_moe_w8a16"
    layout_version: ClassVar[int] = Fp8W8A16Kernel.layout_version
    schemes: ClassVar[frozenset[str]] = frozenset({"fp8"})
    targets: ClassVar[frozenset[Target]] = GPU_TARGETS
    elsewhere: ClassVar[str] = "the cpu target uses cpu_fp8_experts"
    based_on: ClassVar[str] = "fp8_w8a16"
    description: ClassVar[str] = (
        "FP8 e4m3 weight-only (W8A16) experts, per-row or block scales, fused Triton grouped GEMMs"
    )

    def launch_part(self, p: PartLaunch) -> None:
        t, spec, a, routes, y, weights, cfg, a_div = p
        block = spec.fp8_strategy == "block"
        bn, bk = spec.block_size if block and spec.block_size else (1, spec.k)
        if block:
            cfg = replace(cfg, block_k=largest_block_dividing(bk, cfg.block_k))
            if bk % cfg.block_k:
                raise LayoutError(f"{spec.name}: no K tile divides the FP8 block width {bk}")
        scale = t["weight_scale"]
        _w8a16_kernel()[moe_grid(routes, spec.n, cfg.block_n)](
            a, t["weight"].view(torch.uint8), scale, routes.sorted_ids, routes.block_experts,
            weights if weights is not None else scale, y,
            spec.n, spec.k, routes.num_slots, a_div, scale[0].numel(), bn, bk, -(-spec.k // bk),
            BLOCK_SCALES=block, MUL_WEIGHT=weights is not None,
            BLOCK_M=routes.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BF16_INTERP=bf16_interpreter(a), **launch_options(a, cfg),
        )  # fmt: skip


# The shared @triton.jit helpers (kernels/triton_utils.py), bound by with_helpers() when a kernel is built.
moe_tile: Any = None
e4m3_to_f32: Any = None
store_tile: Any = None


@cache
def _w8a8_kernel() -> Any:
    triton, tl = with_helpers(globals(), moe_helpers())

    @triton.jit
    def fp8_moe_w8a8_kernel(
        XQ, XS, W, WS, SORTED, BLOCK_EXPERT, TOPK_W, Y,
        N, K, num_slots, a_div, ws_expert_stride,
        PER_CHANNEL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        expert, slots, mask_m, offs_n, mask_n = moe_tile(SORTED, BLOCK_EXPERT, num_slots, N, BLOCK_M, BLOCK_N)
        if expert < 0:  # past the last expert's padded rows (CUDA sizes the grid for the worst case)
            return
        e = expert.to(tl.int64)
        W += e * N * K
        WS += e * ws_expert_stride
        rows = (slots // a_div).to(tl.int64)  # w13: the slot's token; w2: the slot's own row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(0, tl.cdiv(K, BLOCK_K)):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(
                XQ + rows[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            b = tl.load(
                W + offs_n[None, :] * K + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0
            )  # (BLOCK_K, BLOCK_N) view of the expert's K-major (N, K) weight
            acc += tl.dot(a, b)
        xs = tl.load(XS + rows, mask=mask_m, other=0.0)
        if PER_CHANNEL:
            acc = acc * xs[:, None] * tl.load(WS + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            acc = acc * xs[:, None] * tl.load(WS)
        if MUL_WEIGHT:
            acc = acc * tl.load(TOPK_W + slots, mask=mask_m, other=0.0)[:, None]
        store_tile(acc, Y, Y, slots.to(tl.int64), offs_n, mask_m, mask_n, N, 0, False, 1, BF16_INTERP)

    return fp8_moe_w8a8_kernel


@cache
def _w8a16_kernel() -> Any:
    triton, tl = with_helpers(globals(), moe_helpers())

    @triton.jit
    def fp8_moe_w8a16_kernel(
        X, W, S, SORTED, BLOCK_EXPERT, TOPK_W, Y,
        N, K, num_slots, a_div, s_expert_stride, block_n, block_k, k_blocks,
        BLOCK_SCALES: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        expert, slots, mask_m, offs_n, mask_n = moe_tile(SORTED, BLOCK_EXPERT, num_slots, N, BLOCK_M, BLOCK_N)
        if expert < 0:  # past the last expert's padded rows (CUDA sizes the grid for the worst case)
            return
        e = expert.to(tl.int64)
        W += e * N * K
        S += e * s_expert_stride
        rows = (slots // a_div).to(tl.int64)  # w13: the slot's token; w2: the slot's own row
        act = X.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(0, tl.cdiv(K, BLOCK_K)):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                X + rows[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            if BF16_INTERP:
                x = x.to(tl.float32)
            b = tl.load(
                W + offs_n[None, :] * K + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0
            ).to(tl.int32)  # (BLOCK_K, BLOCK_N) e4m3 bit patterns of the expert's K-major (N, K) weight
            v = e4m3_to_f32(b)
            if not BF16_INTERP:
                v = v.to(act)  # exact: every e4m3 value is an fp16 and a bf16 value
            if BLOCK_SCALES:
                kb = (it * BLOCK_K) // block_k  # BLOCK_K divides block_k: one scale column per tile
                s = tl.load(S + (offs_n // block_n) * k_blocks + kb, mask=mask_n, other=0.0)
                acc += tl.dot(x, v, out_dtype=tl.float32) * s[None, :]
            else:
                acc += tl.dot(x, v, out_dtype=tl.float32)
        if not BLOCK_SCALES:
            acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(TOPK_W + slots, mask=mask_m, other=0.0)[:, None]
        store_tile(acc, Y, Y, slots.to(tl.int64), offs_n, mask_m, mask_n, N, 0, False, 1, BF16_INTERP)

    return fp8_moe_w8a16_kernel
