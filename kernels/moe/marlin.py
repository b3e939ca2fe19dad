"""marlin_moe_wna16: int4/int8 weight-only experts on vLLM's Marlin MoE layout, one fused launch per GEMM.

Targets sm80/sm86/sm89/sm90. The stored layout IS `stacked_experts(marlin_wna16)`'s: expert e's slice
of every tensor is exactly what marlin_wna16 stores for that expert alone (kernels/marlin_wna16.py),
so the group is byte for byte vLLM's gptq_marlin_moe_repack / marlin_moe_permute_scales (and the
Marlin zero points per expert):
    w13.qweight (E, H // 16, 2I * bits // 2) int32   w2.qweight (E, I // 16, H * bits // 2) int32
    w13.scales  (E, G13, 2I) act dtype               w2.scales  (E, G2, H) act dtype
    w13.zeros / w2.zeros (E, G, N * bits // 32) int32    4-bit asymmetric only
    w13.g_idx / w13.perm (E, H) int32, w2.g_idx / w2.perm (E, I) int32    act-order only, per expert
Every expert passes marlin_wna16's rules for its w13 (N = 2I, K = H) and w2 (N = H, K = I)
(check_marlin_shape: N % 64, K % 128, group sizes -1/32/64/128, 4/8-bit, zero points 4-bit only).

Runtime (`apply`, CUDA or interpreter tensors): the fused schedule of kernels/moe/fused.py, each
block reading its expert's Marlin tiles in place with marlin_wna16's closed-form index map
(kernels/marlin_tiles.py). Act-order: each K block of activations is gathered through the block's
expert `perm` inside the kernel (no permuted copy of the activations). Expert parallel: ids outside
this rank's [first_expert, first_expert + num_experts) are not routed here and add nothing.
Without the interpreter on CPU tensors `apply` runs the pure-torch twin `reference`. Expert biases
are refused (has_bias): the fused kernels do not add them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

from kernels.jit import jit, triton_builder
from kernels.launch import fit_to_groups
from kernels.marlin_tiles import marlin_tiles
from kernels.marlin_wna16 import MarlinWNA16Kernel, grouped_scales
from kernels.moe.fused import FusedExperts, PartLaunch, moe_grid, moe_tiles


class MarlinMoEKernel(FusedExperts):
    """`stacked_experts(marlin_wna16)`'s layout, run by two fused grouped-GEMM launches."""

    inner: ClassVar[MarlinWNA16Kernel] = MarlinWNA16Kernel()
    name: ClassVar[str] = "marlin_moe_wna16"
    elsewhere: ClassVar[str] = "sm75 uses gptq_wna16_experts, cpu uses cpu_int4_experts / cpu_int8_experts"
    description: ClassVar[str] = (
        "int4/int8 weight-only experts on the Marlin MoE layout (vLLM bytes), fused Triton grouped GEMMs"
    )

    def launch_part(self, p: PartLaunch) -> None:
        t, spec, a, routes = p.tensors, p.spec, p.a, p.routes
        qweight, scales, zeros, perm = t["qweight"], t["scales"], t.get("zeros"), t.get("perm")
        act_order = perm is not None
        group = spec.k if spec.group_size in (-1, 0) else spec.group_size
        cfg, per_block_scale = fit_to_groups(p.cfg, group, act_order=act_order)
        zp = zeros if zeros is not None else qweight
        _kernel()[moe_grid(routes, spec.n, cfg.block_n)](
            a, qweight, scales, zp, t["g_idx"] if act_order else scales, perm if act_order else scales,
            routes.sorted_ids, routes.block_experts, p.weights if p.weights is not None else scales, p.y,
            spec.n, spec.k, group, routes.num_slots, p.a_div,
            qweight[0].numel(), scales[0].numel(), zp[0].numel(),  # one expert's slice of each
            BITS=spec.bits, HAS_ZP=zeros is not None, ACT_ORDER=act_order,
            GROUPED_SCALES=grouped_scales(spec), PER_BLOCK_SCALE=per_block_scale, **p.expert_meta(cfg),
        )  # fmt: skip


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    moe_tile, store_slots = moe_tiles()
    marlin_n_terms, _, marlin_dot = marlin_tiles()

    def marlin_moe_kernel(
        X, QW, S, ZP, GIDX, PERM, SORTED, BLOCK_EXPERT, TOPK_W, Y,
        N, K, group_size, num_slots, a_div, qw_expert_stride, s_expert_stride, zp_expert_stride,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr, GROUPED_SCALES: tl.constexpr,
        PER_BLOCK_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        expert, slots, rows, mask_m, offs_n, mask_n = moe_tile(
            SORTED, BLOCK_EXPERT, num_slots, a_div, N, BLOCK_M, BLOCK_N
        )
        if expert < 0:  # past the last expert's padded rows (CUDA sizes the grid for the worst case)
            return
        e = expert.to(tl.int64)
        QW += e * qw_expert_stride
        S += e * s_expert_stride
        ZP += e * zp_expert_stride
        GIDX += e * K
        PERM += e * K
        col_n, shift_n, s_col, zp_col, zp_shift = marlin_n_terms(offs_n, BITS, GROUPED_SCALES)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(0, tl.cdiv(K, BLOCK_K)):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            if ACT_ORDER:  # sorted row k of the expert's weight is input channel perm[k]
                cols = tl.load(PERM + offs_k, mask=mask_k, other=0)
            else:
                cols = offs_k
            x = tl.load(
                X + rows[:, None] * K + cols[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            if BF16_INTERP:
                x = x.to(tl.float32)
            acc = marlin_dot(
                acc, x, QW, S, ZP, GIDX, it, offs_k, mask_k, mask_n, col_n, shift_n, s_col, zp_col, zp_shift,
                N, group_size, BITS, HAS_ZP, ACT_ORDER, PER_BLOCK_SCALE, BLOCK_K, BF16_INTERP,
            )  # fmt: skip
        store_slots(acc, Y, TOPK_W, slots, offs_n, mask_m, mask_n, N, MUL_WEIGHT, BF16_INTERP)

    return jit(marlin_moe_kernel)
