"""gptq_wna16: int2/4/5/6/8 weight-only GEMM on the GPTQ-standard layout (Triton), every GPU target.

The sm75 path, and the fallback for shapes Marlin refuses (N % 64, K % 128, odd group sizes).

Stored tensors (per rank; b = stored bits: the layer's, 8 for 5/6-bit codes; pf = 32 // b;
G = number of scale groups):
    qweight  (K // pf, N) int32     codes packed along K, standard order (docs/formats.md §1.1); 5/6-bit
                                    codes (GGUF Q5_* / Q6_K) one per byte, symmetric ones at the 8-bit
                                    midpoint (bitpack.code_shift): exact, run as 8-bit codes
    scales   (G, N)       act dtype dequant multipliers
    qzeros   (G, N // pf) int32     asymmetric only: TRUE zero points (GPTQ v2 semantics), packed along N
    mins     (G, N)       act dtype float-minimum layers only (GGUF Q4_1 / Q4_K), instead of qzeros
    g_idx    (K,)         int32     act-order only: scale group of every input channel (original order)
    bias     (N,)         act dtype optional
    w[n, k] = (code[k, n] - zero[g, n]) * scales[g, n], g = g_idx[k] or k // group_size,
    symmetric zero = 2 ** (bits - 1) (uint4b8 / uint8b128 codes);
    float minimum: w[n, k] = code[k, n] * scales[g, n] + mins[g, n] (codes packed as for a symmetric
    layer; scales and mins rounded to the act dtype, so such a layer is exact only when they fit it).
With act-order the scales hold every group g_idx can name (all groups of the full K when the layer
is row-parallel, as vLLM keeps them).

Float-minimum layers run their own Triton kernel (`_float_min_kernel`; the integer-zero kernel is
untouched): with one group per K block, x @ (q s + m) = (x @ q) s + rowsum(x) m in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import (
    DecodedLayoutKernel,
    IntWeight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)
from kernels.codecs.bitpack import (
    BYTE_STORED_BITS,
    from_stored_codes,
    pack_cols,
    pack_rows,
    packed_length,
    stored_bits,
    to_stored_codes,
    unpack_cols,
    unpack_rows,
)
from kernels.errors import LayoutError
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, grouped_dot_tile, operand_tiles
from kernels.jit import act_dtype_reason, jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, default_config, fit_to_groups
from kernels.targets import GPU_TARGETS

SUPPORTED_BITS = (2, 4, 8, *BYTE_STORED_BITS)


class GptqWNA16Kernel(DecodedLayoutKernel):
    name: ClassVar[str] = "gptq_wna16"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"int"})
    targets: ClassVar[frozenset[Target]] = GPU_TARGETS
    elsewhere: ClassVar[str] = "the cpu target uses cpu_int4 / cpu_int8"
    description: ClassVar[str] = "int2/4/5/6/8 weight-only, GPTQ-standard layout, Triton dequant-GEMM"
    takes_float_zeros: ClassVar[bool] = True

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.bits == 3:
            return False, (
                "3-bit GPTQ packing (fields straddle int32 words) is not supported by gptq_wna16; "
                "requantize the checkpoint to 4-bit or serve it unquantized (dense)"
            )
        if spec.bits not in SUPPORTED_BITS:
            return False, f"gptq_wna16 supports {SUPPORTED_BITS} bits, layer has {spec.bits}"
        if reason := act_dtype_reason(spec.act_dtype, self.name, target):
            return False, reason
        pf = 32 // stored_bits(spec.bits)
        if spec.k % pf:
            return False, f"K per rank = {spec.k} is not a multiple of {pf} ({spec.bits}-bit codes per int32)"
        if not spec.symmetric and not spec.float_zeros and spec.n % pf:
            return False, f"N per rank = {spec.n} is not a multiple of {pf}: zero points pack {pf} per int32"
        if spec.group_size not in (-1, 0) and not spec.act_order and spec.k % spec.group_size:
            return False, f"K per rank = {spec.k} is not a multiple of group_size {spec.group_size}"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k, act, groups = spec.n, spec.k, spec.torch_act_dtype, spec.scale_groups
        out = {
            "qweight": StoredTensor((packed_length(k, stored_bits(spec.bits)), n), torch.int32),
            "scales": StoredTensor((groups, n), act),
        }
        if spec.float_zeros:
            out["mins"] = StoredTensor((groups, n), act)
        elif not spec.symmetric:
            out["qzeros"] = StoredTensor((groups, packed_length(n, stored_bits(spec.bits))), torch.int32)
        if spec.act_order:
            out["g_idx"] = StoredTensor((k,), torch.int32)
        return with_bias(out, spec, act)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, IntWeight, spec, group_map=True)
        if (weight.mins is not None) != spec.float_zeros:
            raise LayoutError(
                f"{spec.name}: weight has {'a' if weight.mins is not None else 'no'} float minimum, "
                f"spec says float_zeros={spec.float_zeros}"
            )
        act = spec.torch_act_dtype
        out: dict[str, torch.Tensor] = {
            "qweight": pack_rows(
                to_stored_codes(weight.codes.T, spec.bits, spec.midpoint_zero), stored_bits(spec.bits)
            ),
            "scales": weight.scales.to(act).contiguous(),  # (G, N)
        }
        if weight.zeros is not None:
            out["qzeros"] = pack_cols(weight.zeros, stored_bits(spec.bits))  # (G, N // pf) int32
        if weight.mins is not None:
            out["mins"] = weight.mins.to(act).contiguous()  # (G, N)
        if spec.act_order:
            out["g_idx"] = weight.group_index().to(torch.int32).contiguous()  # (K,)
        if weight.bias is not None:
            out["bias"] = weight.bias.to(act).contiguous()  # (N,)
        return out

    def stored_int_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight:
        wide = stored_bits(spec.bits)
        codes = from_stored_codes(
            unpack_rows(tensors["qweight"].cpu(), wide, spec.k), spec.bits, spec.midpoint_zero
        )
        zeros = None
        if "qzeros" in tensors:
            zeros = unpack_cols(tensors["qzeros"].cpu(), wide, spec.n).to(torch.uint8)  # (G, N)
        g_idx = tensors["g_idx"].cpu() if "g_idx" in tensors else None
        scales = tensors["scales"].cpu()
        mins = tensors["mins"].cpu() if "mins" in tensors else None  # (G, N), float-minimum layers
        # codes: an (N, K) view
        return IntWeight(codes.T, scales, spec.bits, spec.group_size, zeros, g_idx, mins=mins)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        if "mins" in tensors:
            return gptq_wna16_float_min_gemm(x, tensors, spec)
        return gptq_wna16_gemm(x, tensors, spec)


@triton_builder
def _codes_tile(tl: ModuleType) -> Any:
    def codes_tile(QW, offs_k, offs_n, mask_k, mask_n, N, BITS: tl.constexpr):
        """(BLOCK_K, BLOCK_N) unsigned codes of the packed tile: 32 // BITS codes per int32 along K."""
        PF: tl.constexpr = 32 // BITS
        mask_kn = mask_k[:, None] & mask_n[None, :]
        words = tl.load(QW + (offs_k // PF)[:, None] * N + offs_n[None, :], mask=mask_kn, other=0)
        return (words >> ((offs_k % PF) * BITS)[:, None]) & ((1 << BITS) - 1)

    return jit(codes_tile)


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]
    grouped_dot = grouped_dot_tile()
    codes_tile = _codes_tile()

    def gptq_wna16_kernel(
        X, QW, S, QZ, GIDX, BIAS, Y,
        M, N, K, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr,
        PER_BLOCK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        PF: tl.constexpr = 32 // BITS
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        zp_col = offs_n // PF
        zp_shift = (offs_n % PF) * BITS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)
            q = codes_tile(QW, offs_k, offs_n, mask_k, mask_n, N, BITS)
            acc = grouped_dot(
                acc, x, q, S, QZ, GIDX, it, offs_k, mask_k, mask_n, offs_n, zp_col, zp_shift, N // PF, N,
                group_size, BITS, HAS_ZP, ACT_ORDER, PER_BLOCK_SCALE, BLOCK_K, BF16_INTERP,
            )  # fmt: skip

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(gptq_wna16_kernel)


def gptq_wna16_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with the Triton kernel; x (..., K) bf16/fp16 -> (..., N) in x's dtype."""
    go = _Launch.of(x, tensors, spec, config)
    scales = tensors["scales"]
    qzeros = tensors.get("qzeros", scales)  # placeholder pointer when symmetric
    return go.run.launch(
        _kernel(),
        go.x2, tensors["qweight"], scales, qzeros, go.g_idx, go.run.bias_or(scales), go.run.y,
        go.m, go.n, go.k, go.group,
        BITS=stored_bits(spec.bits), HAS_ZP="qzeros" in tensors, ACT_ORDER=go.act_order,
        PER_BLOCK_SCALE=go.per_block_scale,
    )  # fmt: skip


@dataclass(frozen=True)
class _Launch:
    """What both GEMMs of this layout launch with: the rows, the group and the fitted config."""

    x2: torch.Tensor
    m: int
    n: int
    k: int
    group: int
    act_order: bool
    per_block_scale: bool
    g_idx: torch.Tensor
    run: GemmLaunch

    @classmethod
    def of(
        cls, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None
    ) -> _Launch:
        x2 = gemm_rows(x, spec.k, "gptq_wna16").contiguous()
        m, n, k = x2.shape[0], spec.n, spec.k
        act_order = "g_idx" in tensors
        group = k if spec.group_size in (-1, 0) else spec.group_size
        cfg, per_block = fit_to_groups(
            config or default_config(m, n, k, x.device), group, act_order=act_order
        )
        g_idx = tensors.get("g_idx", tensors["scales"])  # placeholder pointer without act-order
        return cls(x2, m, n, k, group, act_order, per_block, g_idx, GemmLaunch.plan(x, m, n, cfg, tensors))


@triton_builder
def _float_min_kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]
    codes_tile = _codes_tile()

    def float_min_dot(
        acc, x, q, S, MINS, GIDX, it, offs_k, mask_k, mask_n, offs_n, N, group_size,
        ACT_ORDER: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        if PER_BLOCK_SCALE:  # one group row per K block: x @ (q s + m) = (x @ q) s + rowsum(x) m
            g = (it * BLOCK_K) // group_size
            s = tl.load(S + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            m = tl.load(MINS + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            w = q.to(tl.float32)
            if not BF16_INTERP:
                w = w.to(x.dtype)  # integers below 256: exact in bf16/fp16
            x_sum = tl.sum(x.to(tl.float32), axis=1)  # (BLOCK_M,), masked K columns are 0
            acc += tl.dot(x, w) * s[None, :] + x_sum[:, None] * m[None, :]
        else:
            mask_kn = mask_k[:, None] & mask_n[None, :]
            if ACT_ORDER:
                g = tl.load(GIDX + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // group_size
            s = tl.load(S + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0).to(tl.float32)
            m = tl.load(MINS + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s + m
            if not BF16_INTERP:
                w = w.to(x.dtype)
            acc += tl.dot(x, w)
        return acc

    float_min_dot = jit(float_min_dot)

    def gptq_wna16_float_min_kernel(
        X, QW, S, MINS, GIDX, BIAS, Y,
        M, N, K, group_size,
        BITS: tl.constexpr, ACT_ORDER: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)
            q = codes_tile(QW, offs_k, offs_n, mask_k, mask_n, N, BITS)
            acc = float_min_dot(
                acc, x, q, S, MINS, GIDX, it, offs_k, mask_k, mask_n, offs_n, N, group_size,
                ACT_ORDER, PER_BLOCK_SCALE, BLOCK_K, BF16_INTERP,
            )  # fmt: skip

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(gptq_wna16_float_min_kernel)


def gptq_wna16_float_min_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias) for a float-minimum layer (w = q * s + m); x (..., K) bf16/fp16 -> (..., N)."""
    go = _Launch.of(x, tensors, spec, config)
    scales = tensors["scales"]
    return go.run.launch(
        _float_min_kernel(),
        go.x2, tensors["qweight"], scales, tensors["mins"], go.g_idx, go.run.bias_or(scales), go.run.y,
        go.m, go.n, go.k, go.group,
        BITS=stored_bits(spec.bits), ACT_ORDER=go.act_order, PER_BLOCK_SCALE=go.per_block_scale,
    )  # fmt: skip
