"""gptq_wna16: int2/4/8 weight-only GEMM on the GPTQ-standard layout (Triton), every GPU target.

The sm75 path, and the fallback for shapes Marlin refuses (N % 64, K % 128, odd group sizes).

Stored tensors (per rank; pf = 32 // bits; G = number of scale groups):
    qweight  (K // pf, N) int32     codes packed along K, standard order (docs/formats.md §1.1)
    scales   (G, N)       act dtype dequant multipliers
    qzeros   (G, N // pf) int32     asymmetric only: TRUE zero points (GPTQ v2 semantics), packed along N
    g_idx    (K,)         int32     act-order only: scale group of every input channel (original order)
    bias     (N,)         act dtype optional
    w[n, k] = (code[k, n] - zero[g, n]) * scales[g, n], g = g_idx[k] or k // group_size,
    symmetric zero = 2 ** (bits - 1) (uint4b8 / uint8b128 codes).
With act-order the scales hold every group g_idx can name (all groups of the full K when the layer
is row-parallel, as vLLM keeps them).
"""

from __future__ import annotations

from functools import cache
from typing import Any, ClassVar

import torch

from kernels.base import IntWeight, LinearKernel, LinearSpec, SourceWeight, StoredTensor, Target, with_bias
from kernels.codecs.bitpack import pack_cols, pack_rows, packed_length, unpack_cols, unpack_rows
from kernels.errors import LayoutError
from kernels.targets import GPU_TARGETS
from kernels.triton_utils import (
    GemmConfig,
    GemmLaunch,
    act_dtype_reason,
    default_config,
    empty_rows,
    fit_to_groups,
    gemm_rows,
    runs_triton,
    with_epilogue,
)

SUPPORTED_BITS = (2, 4, 8)


class GptqWNA16Kernel(LinearKernel):
    name: ClassVar[str] = "gptq_wna16"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"int"})
    targets: ClassVar[frozenset[Target]] = GPU_TARGETS
    elsewhere: ClassVar[str] = "the cpu target uses cpu_int4 / cpu_int8"
    description: ClassVar[str] = "int2/4/8 weight-only, GPTQ-standard layout, Triton dequant-GEMM"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.bits == 3:
            return False, (
                "3-bit GPTQ packing (fields straddle int32 words) is not supported by gptq_wna16; "
                "requantize the checkpoint to 4-bit or serve it unquantized (dense)"
            )
        if spec.bits not in SUPPORTED_BITS:
            return False, f"gptq_wna16 supports {SUPPORTED_BITS} bits, layer has {spec.bits}"
        if reason := act_dtype_reason(spec.act_dtype, self.name):
            return False, reason
        if not target.has_bf16 and spec.act_dtype == "bfloat16":
            return False, (
                f"{target.value} has no bfloat16 tensor cores: gptq_wna16 there needs act_dtype float16, "
                f"got {spec.act_dtype} (convert with --dtype float16)"
            )
        pf = 32 // spec.bits
        if spec.k % pf:
            return False, f"K per rank = {spec.k} is not a multiple of {pf} ({spec.bits}-bit codes per int32)"
        if not spec.symmetric and spec.n % pf:
            return False, f"N per rank = {spec.n} is not a multiple of {pf}: zero points pack {pf} per int32"
        if spec.group_size not in (-1, 0) and not spec.act_order and spec.k % spec.group_size:
            return False, f"K per rank = {spec.k} is not a multiple of group_size {spec.group_size}"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k, act, groups = spec.n, spec.k, spec.torch_act_dtype, spec.scale_groups
        out = {
            "qweight": StoredTensor((packed_length(k, spec.bits), n), torch.int32),
            "scales": StoredTensor((groups, n), act),
        }
        if not spec.symmetric:
            out["qzeros"] = StoredTensor((groups, packed_length(n, spec.bits)), torch.int32)
        if spec.act_order:
            out["g_idx"] = StoredTensor((k,), torch.int32)
        return with_bias(out, spec, act)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        if not isinstance(weight, IntWeight):
            raise LayoutError(f"{spec.name}: gptq_wna16 prepares IntWeight, got {type(weight).__name__}")
        _check_weight(weight, spec)
        act = spec.torch_act_dtype
        out: dict[str, torch.Tensor] = {
            "qweight": pack_rows(weight.codes.T, spec.bits),  # (K // pf, N) int32
            "scales": weight.scales.to(act).contiguous(),  # (G, N)
        }
        if weight.zeros is not None:
            out["qzeros"] = pack_cols(weight.zeros, spec.bits)  # (G, N // pf) int32
        if spec.act_order:
            out["g_idx"] = weight.group_index().to(torch.int32).contiguous()  # (K,)
        if weight.bias is not None:
            out["bias"] = weight.bias.to(act).contiguous()  # (N,)
        return out

    def stored_int_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight:
        codes = unpack_rows(tensors["qweight"].cpu(), spec.bits, spec.k).to(torch.uint8)  # (K, N)
        zeros = None
        if "qzeros" in tensors:
            zeros = unpack_cols(tensors["qzeros"].cpu(), spec.bits, spec.n).to(torch.uint8)  # (G, N)
        g_idx = tensors["g_idx"].cpu() if "g_idx" in tensors else None
        scales = tensors["scales"].cpu()
        return IntWeight(codes.T, scales, spec.bits, spec.group_size, zeros, g_idx)  # codes: an (N, K) view

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.stored_int_weight(tensors, spec).dequantize().to(tensors["qweight"].device)  # (N, K)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return gptq_wna16_gemm(x, tensors, spec)


def _check_weight(weight: IntWeight, spec: LinearSpec) -> None:
    n, k = weight.codes.shape
    if (n, k) != (spec.n, spec.k):
        raise LayoutError(f"{spec.name}: codes are {(n, k)}, spec says (N, K) = {(spec.n, spec.k)}")
    if weight.bits != spec.bits:
        raise LayoutError(f"{spec.name}: weight has {weight.bits} bits, spec says {spec.bits}")
    if weight.symmetric != spec.symmetric:
        raise LayoutError(f"{spec.name}: weight symmetric={weight.symmetric}, spec says {spec.symmetric}")
    if weight.g_idx is not None and not spec.act_order:
        trivial = weight.group_index()
        expected = (
            torch.zeros(k, dtype=torch.long)
            if spec.group_size in (-1, 0)
            else torch.arange(k) // spec.group_size
        )
        if not torch.equal(trivial, expected):
            raise LayoutError(f"{spec.name}: weight has an act-order g_idx but spec.act_order is False")


def gptq_wna16_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with the Triton kernel; x (..., K) bf16/fp16 -> (..., N) in x's dtype."""
    x2 = gemm_rows(x, spec.k, "gptq_wna16").contiguous()
    m, n, k = x2.shape[0], spec.n, spec.k
    if m == 0:
        return empty_rows(x, n)
    act_order = "g_idx" in tensors
    group = k if spec.group_size in (-1, 0) else spec.group_size
    cfg, per_block_scale = fit_to_groups(
        config or default_config(m, n, k, x.device), group, act_order=act_order
    )
    scales = tensors["scales"]
    qzeros = tensors.get("qzeros", scales)  # placeholder pointer when symmetric
    g_idx = tensors.get("g_idx", scales)
    bias = tensors.get("bias")
    run = GemmLaunch.plan(x, m, n, cfg)
    _kernel()[run.grid](
        x2, tensors["qweight"], scales, qzeros, g_idx, bias if bias is not None else scales, run.y,
        m, n, k, group,
        BITS=spec.bits, HAS_ZP="qzeros" in tensors, ACT_ORDER=act_order,
        PER_BLOCK_SCALE=per_block_scale, HAS_BIAS=bias is not None, **run.meta(),
    )  # fmt: skip
    return run.result()


# The shared @triton.jit helpers (kernels/triton_utils.py), bound by with_epilogue() when a kernel is built.
tile_offsets: Any = None
k_range: Any = None
store_tile: Any = None


@cache
def _kernel() -> Any:
    triton, tl = with_epilogue(globals())

    @triton.jit
    def gptq_wna16_kernel(
        X, QW, S, QZ, GIDX, BIAS, Y,
        M, N, K, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr,
        PER_BLOCK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        PF: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        pid_k = tl.program_id(1)
        offs_m, offs_n, mask_m, mask_n = tile_offsets(M, N, BLOCK_M, BLOCK_N)
        act = X.dtype.element_ty

        if HAS_ZP:
            zp_col = offs_n // PF
            zp_shift = (offs_n % PF) * BITS
        k_begin, k_end = k_range(K, BLOCK_K, SPLIT_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                X + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            if BF16_INTERP:
                x = x.to(tl.float32)
            mask_kn = mask_k[:, None] & mask_n[None, :]
            words = tl.load(QW + (offs_k // PF)[:, None] * N + offs_n[None, :], mask=mask_kn, other=0)
            q = (words >> ((offs_k % PF) * BITS)[:, None]) & MASK  # (BLOCK_K, BLOCK_N) codes
            if PER_BLOCK_SCALE:
                g = (it * BLOCK_K) // group_size
                s = tl.load(S + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                if HAS_ZP:
                    zw = tl.load(QZ + g * (N // PF) + zp_col, mask=mask_n, other=0)
                    z = (zw >> zp_shift) & MASK
                    w = (q - z[None, :]).to(tl.float32)
                else:
                    w = (q - (1 << (BITS - 1))).to(tl.float32)
                if not BF16_INTERP:
                    w = w.to(act)  # integers below 256: exact in bf16/fp16
                acc += tl.dot(x, w) * s[None, :]
            else:
                if ACT_ORDER:
                    g = tl.load(GIDX + offs_k, mask=mask_k, other=0)
                else:
                    g = offs_k // group_size
                s = tl.load(S + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0).to(tl.float32)
                if HAS_ZP:
                    zw = tl.load(QZ + g[:, None] * (N // PF) + zp_col[None, :], mask=mask_kn, other=0)
                    z = (zw >> zp_shift[None, :]) & MASK
                    w = (q - z).to(tl.float32) * s
                else:
                    w = (q - (1 << (BITS - 1))).to(tl.float32) * s
                if not BF16_INTERP:
                    w = w.to(act)
                acc += tl.dot(x, w)

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return gptq_wna16_kernel
