"""marlin_fp4: FP4 (E2M1) weights x bf16/fp16 activations (W4A16) on vLLM 0.32's Marlin FP4 layout.

NVFP4 (an E4M3 scale per 16 inputs, an fp32 global multiplier) and MXFP4 (an E8M0 scale per 32), on
sm80/sm86/sm89/sm90 (FP4 checkpoints calibrated for FP4 activations run W4A16 here, as on vLLM's
Marlin path). Stored tensors, per rank, byte for byte what vLLM's `prepare_fp4_layer_for_marlin`
leaves on the layer for the same weight with params_dtype = the act dtype (docs/formats.md §18.5):
    qweight       (K // 16, 2 N) int32   the codes as 4-bit GPTQ words (8 along K, low nibble first:
                                         the packed checkpoint bytes viewed as int32, transposed),
                                         then gptq_marlin_repack(num_bits=4) (`marlin_repack`)
    scales        (K // group, N)        block scales, Marlin's grouped permutation, then columns
                                         [0, 2, 1, 3] of every 4 swapped (the 2 x 2 transpose):
                  nvfp4: float8_e4m3fn   bytes that are not E4M3 but "S0E5M3": bits 14..7 of the
                                         fp16 s * sf * 2^7, zeroed where that is below 2
                  mxfp4: uint8           the E8M0 bytes as they are (vLLM: float8_e8m0fnu, a dtype
                                         Kiln's artifacts do not have; the same bytes)
    global_scale  (1,) float32           nvfp4 only: g * 2^(bias - 7) / sf (vLLM holds it 0-d)
    bias          (N,) act dtype         optional, natural column order (vLLM permutes its own with
                                         marlin_permute_bias; Kiln's plugin adds it after the GEMM)
bias = 2^(e - 1) - 2 for an act dtype with e exponent bits (bf16 126, fp16 14): the S0E5M3 byte
shifted into an fp16 is s * sf * 2^7, so s * g = fp16(byte << 7) * global_scale * 2^-bias.
sf is vLLM's power of two that lifts the largest block scale into [224, 448] (bf16 only; 1 for
fp16), so that fewer small scales fall below the flush; the global divides it back out.
Shapes are Marlin's thread-tile families N % 64 / K % 128 or N % 128 / K % 64, which vLLM runs
unpadded (it pads other shapes; Kiln stores no padding, so it refuses them).

The Triton kernel reads the layout in place: codes by marlin_wna16's 4-bit closed form, E2M1 built
as fp32 bits, scale bytes gathered per element at the swapped grouped column; an S0E5M3 byte becomes
fp32 bits with the 2^-bias folded into the exponent, so w = E2M1 * s * sf * 2^(7 - bias) has at most
6 significant bits and stays a normal number of the act dtype: it is exact there, and the dot
accumulates in fp32; the global multiplies the accumulator.

Never run on a GPU (no device was available while writing it): only the CPU layout code and the
Triton interpreter have run it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import (
    FP4_GROUP_SIZE,
    DecodedLayoutKernel,
    Fp4Weight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)
from kernels.codecs.bitpack import pack_rows, unpack_rows
from kernels.errors import LayoutError
from kernels.fp4_tiles import fp4_gpu_reason, fp4_tiles
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, operand_tiles
from kernels.jit import jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, default_config
from kernels.marlin_layout import (
    marlin_permute_scales,
    marlin_repack,
    marlin_unpermute_scales,
    marlin_unrepack,
)
from kernels.marlin_tiles import marlin_tiles
from kernels.targets import gpu_targets

# 2^(e - 1) - 2^(2 - 1): fp16 / bf16 exponent bias minus E2M1's, for e exponent bits of the act dtype
EXPONENT_BIAS = {torch.float16: 14, torch.bfloat16: 126}
SCALE_SHIFT = 7  # a processed NVFP4 scale is s * sf * 2^7
FLUSH_BELOW = 2.0  # processed scales below this are stored as 0 (their fp16 would be below 2^1)
E4M3_MAX = 448.0
# (N, K) multiples Marlin runs unpadded: either thread-tile family
TILE_FAMILIES = ((64, 128), (128, 64))


class MarlinFp4Kernel(DecodedLayoutKernel):
    name: ClassVar[str] = "marlin_fp4"
    vllm_kernel: ClassVar[str] = "fp4_marlin"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"fp4"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(80)
    elsewhere: ClassVar[str] = "cpu uses cpu_fp4"
    description: ClassVar[str] = "NVFP4 / MXFP4 weight-only (W4A16) on the Marlin FP4 layout, Triton GEMM"
    gpt_oss_expert_padding: ClassVar[tuple[int, int] | None] = (256, 128)  # vLLM's MARLIN backend

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if reason := fp4_gpu_reason(spec, self.name, target):
            return False, reason
        if not any(spec.n % tn == 0 and spec.k % tk == 0 for tn, tk in TILE_FAMILIES):
            return False, (
                f"N={spec.n}, K={spec.k} on this rank fit neither Marlin tile family (N % 64 and K % 128, "
                "or N % 128 and K % 64); vLLM would zero-pad the layer, Kiln stores it unpadded: use a TP "
                "size that keeps both multiples or target cpu_fp4"
            )
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k = spec.n, spec.k
        nvfp4 = spec.fp4_format == "nvfp4"
        out = {
            "qweight": StoredTensor((k // 16, 2 * n), torch.int32),
            "scales": StoredTensor((k // _group(spec), n), torch.float8_e4m3fn if nvfp4 else torch.uint8),
        }
        if nvfp4:
            out["global_scale"] = StoredTensor((1,), torch.float32)
        return with_bias(out, spec, spec.torch_act_dtype)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        return self.prepare_scaled(weight, spec, spec.group_scale_factor or None)

    def needs_group_statistic(self, spec: LinearSpec) -> bool:
        """NVFP4 in bf16: vLLM's MoE prepare lifts every expert's block scales by ONE sf, chosen from
        the largest block scale of all the group's experts (per part)."""
        return spec.fp4_format == "nvfp4" and spec.torch_act_dtype != torch.float16

    def group_statistic(self, weight: SourceWeight, spec: LinearSpec) -> float:
        assert isinstance(weight, Fp4Weight)
        return float(weight.scales.float().max()) if weight.scales.numel() else 0.0

    def with_group_statistic(self, spec: LinearSpec, value: float) -> LinearSpec:
        sf = nvfp4_scale_factor(torch.tensor([value]), spec.torch_act_dtype)
        return dataclasses.replace(spec, group_scale_factor=sf)

    def prepare_scaled(
        self, weight: SourceWeight, spec: LinearSpec, scale_factor: float | None
    ) -> dict[str, torch.Tensor]:
        """`prepare` with NVFP4's sf given (an expert group shares one over all its experts, as
        vLLM's MoE prepare computes it), or None: this layer's own (`nvfp4_scale_factor`)."""
        weight = self.prepare_input(weight, Fp4Weight, spec)
        n, k, act = spec.n, spec.k, spec.torch_act_dtype
        q_std = pack_rows(weight.codes.T, 4)  # (K // 8, N) int32
        out = {"qweight": marlin_repack(q_std, 4)}  # (K // 16, 2 N) int32
        blocks = weight.scales.T  # (K // group, N)
        if weight.fmt == "mxfp4":
            out["scales"] = swap_scale_pairs(marlin_permute_scales(blocks, k, n, _group(spec)))
        else:
            s = blocks.float()
            if bool((s < 0).any()):
                raise LayoutError(f"{spec.name}: negative NVFP4 block scales (Marlin's S0E5M3 has no sign)")
            sf = nvfp4_scale_factor(s, act) if scale_factor is None else scale_factor
            processed = swap_scale_pairs(marlin_permute_scales(s, k, n, _group(spec)))
            out["scales"] = s0e5m3_bytes(processed, sf).view(torch.float8_e4m3fn)
            out["global_scale"] = marlin_global_scale(_layer_global(weight, spec), act, sf)
        if weight.bias is not None:
            out["bias"] = weight.bias.to(act)
        return {name: t.contiguous() for name, t in out.items()}

    def stored_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Fp4Weight:
        """The weight the stored tensors hold: the codes, and the block scales as the layout keeps
        them (NVFP4: the fp16 s * sf * 2^7 with the global g * 2^-7 / sf, whose product is s * g)."""
        n, k = spec.n, spec.k
        codes = unpack_rows(marlin_unrepack(tensors["qweight"].cpu(), 4, k, n), 4, k)  # (K, N) uint8
        raw = tensors["scales"].cpu().view(torch.uint8)
        raw = marlin_unpermute_scales(swap_scale_pairs(raw), k, n, _group(spec))  # (K // group, N)
        if spec.fp4_format == "mxfp4":
            return Fp4Weight(codes.T, raw.T, "mxfp4")
        scales = (raw.to(torch.int16) << SCALE_SHIFT).view(torch.float16)  # s * sf * 2^7
        g = tensors["global_scale"].cpu().float() * 2.0 ** -EXPONENT_BIAS[spec.torch_act_dtype]
        return Fp4Weight(codes.T, scales.T, "nvfp4", g)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return marlin_fp4_gemm(x, tensors, spec)


def _group(spec: LinearSpec) -> int:
    assert spec.fp4_format is not None
    return FP4_GROUP_SIZE[spec.fp4_format]


def _layer_global(weight: Fp4Weight, spec: LinearSpec) -> torch.Tensor:
    """The (1,) fp32 global multiplier of the whole layer; shards must agree (Marlin holds one)."""
    if weight.global_scale is None:
        raise LayoutError(f"{spec.name}: NVFP4 weight without a global scale")
    g = weight.global_scale.float().reshape(-1)
    if bool((g != g[0]).any()):
        raise LayoutError(
            f"{spec.name}: the shards of this fused NVFP4 layer carry different global scales "
            f"{g.tolist()}; Marlin FP4 holds one per layer (vLLM would silently apply one to every shard: "
            "the smallest multiplier for compressed-tensors, the largest for ModelOpt). Re-quantize with "
            "a shared global scale or target cpu_fp4, which keeps one per shard"
        )
    return g[:1].contiguous()


def swap_scale_pairs(s: torch.Tensor) -> torch.Tensor:
    """(G, N) -> (G, N): columns [0, 2, 1, 3] of every 4 (Marlin's FP8-style dequant order); its own
    inverse."""
    g, n = s.shape
    return s.reshape(g, n // 4, 2, 2).transpose(2, 3).reshape(g, n)


def nvfp4_scale_factor(scales: torch.Tensor, act: torch.dtype) -> float:
    """vLLM's sf for bf16: the largest power of two that keeps the largest positive block scale
    times it <= 448 (1 when that scale is already above 224, or none is positive); 1 for fp16."""
    top = float(scales.float().max()) if scales.numel() else 0.0
    sf = 1.0
    if act == torch.float16 or not top > 0:
        return sf
    while top * sf * 2 <= E4M3_MAX:
        sf *= 2
    return sf


def group_scale_factor(scales: Iterable[torch.Tensor], act: torch.dtype) -> float:
    """The one sf of an expert group (vLLM's MoE prepare: over every local expert's block scales of
    one part, w13 or w2), for `prepare_scaled`."""
    tops = [s.float().max() for s in scales if s.numel()]
    return nvfp4_scale_factor(torch.stack(tops) if tops else torch.zeros(0), act)


def s0e5m3_bytes(scales: torch.Tensor, sf: float) -> torch.Tensor:
    """(G, N) non-negative block scales -> (G, N) uint8: bits 14..7 of fp16(s * sf * 2^7) (exponent
    and 3 mantissa bits; the sign is 0), 0 where that is below FLUSH_BELOW. Exact: an E4M3 value
    times a power of two stays within fp16 (s * sf <= 448)."""
    half = (scales.float() * (sf * 2.0**SCALE_SHIFT)).to(torch.float16)
    half = torch.where(half < FLUSH_BELOW, torch.zeros_like(half), half)
    return ((half.view(torch.int16) >> SCALE_SHIFT) & 0xFF).to(torch.uint8)


def marlin_global_scale(g: torch.Tensor, act: torch.dtype, sf: float) -> torch.Tensor:
    """(1,) fp32 global multiplier -> the stored (1,) fp32 g * 2^(bias - 7) / sf (vLLM's fp32 ops)."""
    return (g.float() * 2.0 ** (EXPONENT_BIAS[act] - SCALE_SHIFT)) / sf


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]
    marlin_n_terms, marlin_codes, _ = marlin_tiles()
    e2m1_fp32 = fp4_tiles()[0]

    def marlin_fp4_kernel(
        X, QW, S, GS, BIAS, Y,
        M, N, K, scale_bits_offset,
        GROUP: tl.constexpr, NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        act = X.dtype.element_ty
        col_n, shift_n, s_col, _, _ = marlin_n_terms(offs_n, 4, True)
        t = s_col % 4
        s_col = s_col - t + 2 * (t % 2) + t // 2  # the [0, 2, 1, 3] swap
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)
            mask_kn = mask_k[:, None] & mask_n[None, :]
            q = marlin_codes(QW, offs_k, mask_kn, col_n, shift_n, N, 4)
            s_addr = (offs_k // GROUP)[:, None] * N + s_col[None, :]
            b = tl.load(S + s_addr, mask=mask_kn, other=0).to(tl.int32)
            if NVFP4:  # S0E5M3 byte -> fp32 bits of fp16(byte << 7) * 2^-bias
                s_bits = tl.where(b == 0, 0, (b + scale_bits_offset) << 20)
            else:  # E8M0 byte -> 2^(byte - 127) (byte 0: the fp32 subnormal 2^-127)
                s_bits = tl.where(b == 0, 0x00400000, b << 23)
            w = e2m1_fp32(q) * s_bits.to(tl.float32, bitcast=True)
            if not BF16_INTERP:
                w = w.to(act)
            acc += tl.dot(x, w)
        if NVFP4:
            acc = acc * tl.load(GS)
        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(marlin_fp4_kernel)


def marlin_fp4_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias), reading the Marlin FP4 layout in place; x (..., K) in the act dtype."""
    x2 = gemm_rows(x, spec.k, "marlin_fp4").contiguous()
    if x.dtype != spec.torch_act_dtype:
        raise LayoutError(
            f"marlin_fp4 scales of {spec.name} carry the {spec.act_dtype} exponent bias; activations are "
            f"{x.dtype}"
        )
    m, n, k = x2.shape[0], spec.n, spec.k
    nvfp4 = spec.fp4_format == "nvfp4"
    scales = tensors["scales"].view(torch.uint8)
    # fp32 exponent of fp16(byte << 7) * 2^-bias, rebased: (byte + 8 (112 - bias)) << 20
    offset = 8 * (127 - 15 - EXPONENT_BIAS[x.dtype])
    cfg = config or default_config(m, n, k, x.device)
    run = GemmLaunch.plan(x, m, n, cfg, tensors)
    return run.launch(
        _kernel(),
        x2, tensors["qweight"], scales, tensors["global_scale"] if nvfp4 else scales,
        run.bias_or(scales), run.y,
        m, n, k, offset,
        GROUP=_group(spec), NVFP4=nvfp4,
    )  # fmt: skip
