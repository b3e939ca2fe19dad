"""fp8_marlin_moe: FP8 e4m3 weight-only experts on vLLM's FP8-Marlin MoE layout, one fused launch per GEMM.

Targets sm80/sm86, where vLLM 0.32 runs every FP8 MoE layer on Marlin (no FP8 tensor cores; on
sm89/sm90 it takes fp8_moe_w8a8's path for per-tensor / per-channel scales and the plain Triton
layout for block scales, which `fp8_moe_w8a16` holds). The stored layout IS
`stacked_experts(fp8_marlin)`'s: expert e's slice of every tensor is exactly what fp8_marlin stores
for that expert alone (kernels/fp8_marlin.py), i.e. vLLM's `prepare_fp8_moe_layer_for_marlin`:
    w13.qweight (E, H // 16, 4 * 2I) int32      w2.qweight (E, I // 16, 4 * H) int32
    w13.scales  (E, G13, 2I) act dtype          w2.scales  (E, G2, H) act dtype
        (per-tensor / per-channel: G = 1; block: G = K / bk; Marlin-permuted, times the exponent bias)
Runtime (`apply`, CUDA or interpreter tensors): the fused schedule of kernels/moe/fused.py, each block
decoding its expert's e4m3 bytes from the Marlin tiles in place (fp8_marlin's decode: exact into
fp32, the bias divided back out of the scales) and running a bf16/fp16 dot. Without the interpreter
on CPU tensors `apply` runs the pure-torch twin `reference`. Expert biases are refused (has_bias).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

from kernels.errors import LayoutError
from kernels.fp8_marlin import EXPONENT_BIAS, Fp8MarlinKernel, fp8_marlin_weights, marlin_group_size
from kernels.jit import jit, triton_builder
from kernels.launch import fit_to_groups
from kernels.marlin_tiles import marlin_tiles
from kernels.moe.fused import FusedExperts, PartLaunch, moe_grid, moe_tiles
from kernels.targets import Target


class Fp8MarlinMoEKernel(FusedExperts):
    """`stacked_experts(fp8_marlin)`'s layout, run by two fused grouped-GEMM launches."""

    inner: ClassVar[Fp8MarlinKernel] = Fp8MarlinKernel()
    name: ClassVar[str] = "fp8_marlin_moe"
    targets: ClassVar[frozenset[Target]] = frozenset({Target.SM80, Target.SM86})
    elsewhere: ClassVar[str] = (
        "sm89/sm90 use fp8_moe_w8a8 (per-tensor / per-channel) or fp8_moe_w8a16 (block), as vLLM does"
    )
    description: ClassVar[str] = (
        "FP8 e4m3 weight-only experts on the FP8-Marlin MoE layout (vLLM bytes), fused Triton grouped GEMMs"
    )

    def launch_part(self, p: PartLaunch) -> None:
        t, spec, routes = p.tensors, p.spec, p.routes
        qweight, scales = t["qweight"], t["scales"]
        if scales.dtype != p.a.dtype:
            raise LayoutError(
                f"{self.name} scales of {spec.name} carry the {scales.dtype} exponent bias; activations "
                f"are {p.a.dtype}"
            )
        group = spec.k if marlin_group_size(spec) == -1 else marlin_group_size(spec)
        cfg, per_block_scale = fit_to_groups(p.cfg, group, act_order=False)
        _kernel()[moe_grid(routes, spec.n, cfg.block_n)](
            p.a, qweight, scales, routes.sorted_ids, routes.block_experts,
            p.weights if p.weights is not None else scales, p.y,
            spec.n, spec.k, group, 2.0 ** -EXPONENT_BIAS[p.a.dtype], routes.num_slots, p.a_div,
            qweight[0].numel(), scales[0].numel(),  # one expert's slice of each
            GROUPED_SCALES=group < spec.k, PER_BLOCK_SCALE=per_block_scale, **p.expert_meta(cfg),
        )  # fmt: skip


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    moe_tile, store_slots = moe_tiles()
    marlin_n_terms = marlin_tiles()[0]
    weights = fp8_marlin_weights()

    def fp8_marlin_moe_kernel(
        X, QW, S, SORTED, BLOCK_EXPERT, TOPK_W, Y,
        N, K, group_size, unbias, num_slots, a_div, qw_expert_stride, s_expert_stride,
        GROUPED_SCALES: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr,
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
        act = X.dtype.element_ty
        col_n, shift_n, s_col, _, _ = marlin_n_terms(offs_n, 8, GROUPED_SCALES)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(0, tl.cdiv(K, BLOCK_K)):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                X + rows[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            if BF16_INTERP:
                x = x.to(tl.float32)
            mask_kn = mask_k[:, None] & mask_n[None, :]
            w = weights(
                QW, S, it, offs_k, mask_kn, mask_n, col_n, shift_n, s_col, N, group_size, unbias,
                PER_BLOCK_SCALE, BLOCK_K,
            )  # fmt: skip
            if not BF16_INTERP:
                w = w.to(act)
            acc += tl.dot(x, w)
        store_slots(acc, Y, TOPK_W, slots, offs_n, mask_m, mask_n, N, MUL_WEIGHT, BF16_INTERP)

    return jit(fp8_marlin_moe_kernel)
