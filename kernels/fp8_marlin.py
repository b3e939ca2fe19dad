"""fp8_marlin: FP8 e4m3 weights x bf16/fp16 activations (W8A16) on vLLM's FP8-Marlin layout.

For sm80/sm86 (no FP8 tensor cores), and the fallback on sm89/sm90 for block scales. Stored tensors
(per rank, bytes identical to vLLM's prepare_fp8_layer_for_marlin, docs/formats.md §5.4):
    qweight  (K // 16, 4 N) int32   raw e4m3 bytes packed as 8-bit GPTQ ((K / 4, N), byte k % 4 at
                                    bits 8 (k % 4)), then gptq_marlin_repack(num_bits=8)
    scales   (G, N) act dtype       scales cast to the act dtype; per-tensor expanded per shard to
                                    (1, N), channel (1, N), block (K / bk, N) (group_size = bk);
                                    Marlin-permuted; times the exponent bias 2^8 (fp16) / 2^120 (bf16)
    bias     (N,) act dtype         optional, natural column order
The bias exists for Marlin's cheap fp8 -> fp16/bf16 bit conversion (the e4m3 exponent/mantissa bits
shifted into a 16-bit float, which is the true value times 2^-8 / 2^-120). This Triton kernel
instead decodes e4m3 exactly into fp32 (normals by moving the bits into an fp32 pattern with the
exponent rebased, subnormals as m * 2^-9, so no float denormals appear) and divides the bias back
out of the scale vector (an exact power-of-two multiply per column), then computes
w = e4m3 * scale in fp32, rounds w to the act dtype (as Marlin does) and runs the dot.
The weight byte of element (k, n) is found with marlin_wna16's 8-bit closed form.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import Fp8Weight, LinearKernel, LinearSpec, SourceWeight, StoredTensor, Target, with_bias
from kernels.codecs.bitpack import pack_rows, unpack_rows
from kernels.errors import LayoutError
from kernels.fp8_tiles import fp8_tiles
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, operand_tiles
from kernels.jit import act_dtype_reason, jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, default_config, fit_to_groups
from kernels.marlin_layout import (
    MARLIN_SUPPORTED_GROUP_SIZES,
    check_marlin_shape,
    marlin_permute_scales,
    marlin_repack,
    marlin_unpermute_scales,
    marlin_unrepack,
)
from kernels.marlin_tiles import marlin_tiles
from kernels.targets import gpu_targets

EXPONENT_BIAS = {torch.float16: 8, torch.bfloat16: 120}  # 2^(e-1) - 2^3, e = exponent bits of act dtype


class Fp8MarlinKernel(LinearKernel):
    name: ClassVar[str] = "fp8_marlin"
    vllm_kernel: ClassVar[str] = "fp8_marlin"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"fp8"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(80)
    elsewhere: ClassVar[str] = "FP8 on sm75 runs the fp8_w8a16 kernel, on cpu cpu_fp8"
    description: ClassVar[str] = "FP8 e4m3 weight-only (W8A16) on the FP8-Marlin layout, Triton dequant-GEMM"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if reason := act_dtype_reason(spec.act_dtype, self.name, target):
            return False, reason
        group = marlin_group_size(spec)
        if spec.fp8_strategy == "block":
            if spec.block_size is None:
                return False, "block-scaled FP8 layer without block_size in its spec"
            if group not in MARLIN_SUPPORTED_GROUP_SIZES:
                return False, (
                    f"FP8 block width bk={group} is not a Marlin group size "
                    f"{[g for g in MARLIN_SUPPORTED_GROUP_SIZES if g > 0]}; serve the layer dense"
                )
        elif spec.fp8_strategy not in ("tensor", "channel"):
            return False, f"unknown FP8 strategy {spec.fp8_strategy!r}"
        return check_marlin_shape(spec.n, spec.k, spec.k, group, bits=8)

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k, act = spec.n, spec.k, spec.torch_act_dtype
        group = marlin_group_size(spec)
        out = {
            "qweight": StoredTensor((k // 16, 4 * n), torch.int32),
            "scales": StoredTensor((1 if group == -1 else k // group, n), act),
        }
        return with_bias(out, spec, act)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, Fp8Weight, spec)
        n, k = spec.n, spec.k
        act = spec.torch_act_dtype
        codes = weight.weight.contiguous().view(torch.uint8)  # (N, K) raw e4m3 bytes
        q_std = pack_rows(codes.T, 8)  # (K // 4, N) int32 == vLLM's pack_fp8_to_int32 + transpose
        scales = _marlin_scales(weight, spec).to(act)  # (G, N), cast first as vLLM does
        scales = marlin_permute_scales(scales, k, n, marlin_group_size(spec))
        scales = scales * torch.full_like(scales, 2.0) ** EXPONENT_BIAS[act]  # exact power of two
        out = {"qweight": marlin_repack(q_std, 8), "scales": scales.contiguous()}  # (K // 16, 4 N)
        if weight.bias is not None:
            out["bias"] = weight.bias.to(act).contiguous()
        return out

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        n, k = spec.n, spec.k
        codes = unpack_rows(marlin_unrepack(tensors["qweight"].cpu(), 8, k, n), 8, k)  # (K, N) uint8
        w = codes.view(torch.float8_e4m3fn).float()
        scales = tensors["scales"].cpu()
        bias = 2.0 ** -EXPONENT_BIAS[scales.dtype]
        s = marlin_unpermute_scales(scales, k, n, marlin_group_size(spec)).float() * bias  # (G, N)
        g = (
            torch.arange(k) // k
            if marlin_group_size(spec) == -1
            else torch.arange(k) // marlin_group_size(spec)
        )
        return ((w * s[g]).T.contiguous()).to(tensors["qweight"].device)  # (N, K) fp32

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return fp8_marlin_gemm(x, tensors, spec)


def marlin_group_size(spec: LinearSpec) -> int:
    """Marlin group size: the block width bk for block scales, else -1 (one scale row)."""
    if spec.fp8_strategy == "block" and spec.block_size is not None:
        return spec.block_size[1]
    return -1


def _marlin_scales(weight: Fp8Weight, spec: LinearSpec) -> torch.Tensor:
    """Scales before the act-dtype cast and permutation: (1, N) or (K / bk, N)."""
    n, k = spec.n, spec.k
    s = weight.scale.float()
    if weight.strategy == "tensor":
        # One scale for the whole (possibly fused) layer, as online FP8 writes it, covers every row.
        sizes = (n,) if s.numel() == 1 else weight.shard_sizes or tuple(sh.size for sh in spec.shards)
        if len(sizes) != s.numel() or sum(sizes) != n:
            raise LayoutError(f"{spec.name}: {s.numel()} per-tensor scales for shards {sizes} (N={n})")
        return torch.repeat_interleave(s.reshape(-1), torch.tensor(sizes)).reshape(1, n)
    if weight.strategy == "channel":
        return s.reshape(1, n)
    if (
        weight.block_size is None
        or spec.block_size is None
        or tuple(weight.block_size) != tuple(spec.block_size)
    ):
        raise LayoutError(
            f"{spec.name}: block size {weight.block_size} does not match spec {spec.block_size}"
        )
    bn, bk = weight.block_size
    if k % bk:
        raise LayoutError(f"{spec.name}: K={k} is not a multiple of the FP8 block width {bk}")
    return s.T.repeat_interleave(bn, dim=1)[:, :n].contiguous()  # (K / bk, N)


@triton_builder
def fp8_marlin_weights(tl: ModuleType) -> Any:
    """`@triton.jit` fp8_marlin_weights(...): the (BLOCK_K, BLOCK_N) fp32 weights of one K block of
    the FP8-Marlin layout: e4m3 bytes decoded exactly from the Marlin tiles, times their scales with
    the exponent bias divided back out (`unbias`); the linear and the MoE kernels share it."""
    e4m3_to_f32 = fp8_tiles()[0]
    marlin_codes = marlin_tiles()[1]

    def fp8_marlin_weights(
        QW, S, it, offs_k, mask_kn, mask_n, col_n, shift_n, s_col, N, group_size, unbias,
        PER_BLOCK_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        v = e4m3_to_f32(marlin_codes(QW, offs_k, mask_kn, col_n, shift_n, N, 8))  # e4m3 bit patterns
        if PER_BLOCK_SCALE:
            g = (it * BLOCK_K) // group_size
            s = tl.load(S + g * N + s_col, mask=mask_n, other=0.0).to(tl.float32) * unbias
            w = v * s[None, :]
        else:
            g = offs_k // group_size
            s = tl.load(S + g[:, None] * N + s_col[None, :], mask=mask_kn, other=0.0).to(tl.float32)
            w = v * (s * unbias)
        return w

    return jit(fp8_marlin_weights)


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]
    marlin_n_terms = marlin_tiles()[0]
    weights = fp8_marlin_weights()

    def fp8_marlin_kernel(
        X, QW, S, BIAS, Y,
        M, N, K, group_size, unbias,
        GROUPED_SCALES: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        act = X.dtype.element_ty
        col_n, shift_n, s_col, _, _ = marlin_n_terms(offs_n, 8, GROUPED_SCALES)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)
            mask_kn = mask_k[:, None] & mask_n[None, :]
            w = weights(
                QW, S, it, offs_k, mask_kn, mask_n, col_n, shift_n, s_col, N, group_size, unbias,
                PER_BLOCK_SCALE, BLOCK_K,
            )  # fmt: skip
            if not BF16_INTERP:
                w = w.to(act)
            acc += tl.dot(x, w)

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(fp8_marlin_kernel)


def fp8_marlin_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias), reading the FP8-Marlin layout in place; x (..., K) bf16/fp16."""
    x2 = gemm_rows(x, spec.k, "fp8_marlin").contiguous()
    scales = tensors["scales"]
    if scales.dtype != x.dtype:
        raise LayoutError(
            f"fp8_marlin scales carry the {scales.dtype} exponent bias; activations are {x.dtype}"
        )
    m, n, k = x2.shape[0], spec.n, spec.k
    group = k if marlin_group_size(spec) == -1 else marlin_group_size(spec)
    cfg, per_block_scale = fit_to_groups(config or default_config(m, n, k, x.device), group, act_order=False)
    run = GemmLaunch.plan(x, m, n, cfg, tensors)
    return run.launch(
        _kernel(),
        x2, tensors["qweight"], scales, run.bias_or(scales), run.y,
        m, n, k, group, 2.0 ** -EXPONENT_BIAS[x.dtype],
        GROUPED_SCALES=group < k, PER_BLOCK_SCALE=per_block_scale,
    )  # fmt: skip
