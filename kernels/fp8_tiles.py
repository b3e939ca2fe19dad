"""`@triton.jit` pieces of the FP8 and 1-byte-operand GEMMs (fp8_w8a16, fp8_marlin, fp8_w8a8,
int8_w8a8 and their fused expert groups), over rows `rows` of X and the K iterations [k_begin, k_end).

`e4m3_to_f32`: exact e4m3 decode of int32 bit patterns (normals rebase the exponent bias 7 -> 127,
subnormals m * 2^-9), for GPUs without FP8 conversion instructions;
`e4m3_gemm`: the fp32 tile x @ e4m3(W).T of a K-major (N, K) e4m3 weight, every e4m3 value exact in
fp16 and bf16; block scales (BLOCK_K divides block_k) scale each K step's dot, per-row scales the result;
`token_scaled_gemm`: the fp32 tile (XQ @ W.T) * XS[row] * WS of 1-byte operands, int8 (exact int32
accumulator) or e4m3 (fp32), WS per output channel (PER_CHANNEL) or one (its epilogue,
`token_scaled_epilogue`, shared with the GEMMs that quantize their activations in the prologue).

`token_quant_tiles` (the per-token activation quantization, one definition for the quantization
kernels and the GEMMs that quantize in their prologue):
`token_scale`: a row's scale from its max |x|: e4m3 max(amax / 448, 1 / (448 * 512)) (vLLM's
dynamic per-token FP8), int8 max(amax, min_amax) / divisor (kernels/codecs/int8.py);
`token_quantize`: fp32 values -> e4m3 (clamped to ±448) or int8 (rounded half to even, clamped to
[-128, qmax]) codes, IEEE divisions as torch's.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kernels.gemm import operand_tiles
from kernels.jit import jit, triton_builder


@triton_builder
def fp8_tiles(tl: ModuleType) -> tuple[Any, Any, Any, Any]:
    """(e4m3_to_f32, e4m3_gemm, token_scaled_gemm, token_scaled_epilogue), see the module docstring."""
    x_tile, kmajor_tile = operand_tiles()

    def e4m3_to_f32(b):
        em = b & 0x7F
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        mag = tl.where(em < 8, (em & 7).to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 0x80) != 0, -mag, mag)

    e4m3_to_f32 = jit(e4m3_to_f32)  # e4m3_gemm calls the compiled one

    def e4m3_gemm(
        X, W, S, rows, mask_m, offs_n, mask_n, k_begin, k_end, K, block_n, block_k, k_blocks,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_SCALES: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, rows, mask_m, it, K, BLOCK_K, BF16_INTERP)
            v = e4m3_to_f32(kmajor_tile(W, offs_n, mask_n, offs_k, mask_k, K).to(tl.int32))
            if not BF16_INTERP:
                v = v.to(x.dtype)
            if BLOCK_SCALES:
                kb = (it * BLOCK_K) // block_k
                s = tl.load(S + (offs_n // block_n) * k_blocks + kb, mask=mask_n, other=0.0)
                acc += tl.dot(x, v, out_dtype=tl.float32) * s[None, :]
            else:
                acc += tl.dot(x, v, out_dtype=tl.float32)
        if not BLOCK_SCALES:
            acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
        return acc

    def token_scaled_epilogue(acc, row_scale, WS, offs_n, mask_n, PER_CHANNEL: tl.constexpr):
        """The fp32 tile acc * row_scale[row] * WS (per output channel, or one)."""
        acc = acc.to(tl.float32) * row_scale[:, None]
        if PER_CHANNEL:
            acc = acc * tl.load(WS + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            acc = acc * tl.load(WS)
        return acc

    token_scaled_epilogue = jit(token_scaled_epilogue)

    def token_scaled_gemm(
        XQ, XS, W, WS, rows, mask_m, offs_n, mask_n, k_begin, k_end, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PER_CHANNEL: tl.constexpr, INT8: tl.constexpr,
    ):  # fmt: skip
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)  # exact: |127 * 128| * K < 2^31
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            a, offs_k, mask_k = x_tile(XQ, rows, mask_m, it, K, BLOCK_K, False)
            acc += tl.dot(a, kmajor_tile(W, offs_n, mask_n, offs_k, mask_k, K))
        return token_scaled_epilogue(
            acc, tl.load(XS + rows, mask=mask_m, other=0.0), WS, offs_n, mask_n, PER_CHANNEL
        )

    return e4m3_to_f32, jit(e4m3_gemm), jit(token_scaled_gemm), token_scaled_epilogue


@triton_builder
def token_quant_tiles(tl: ModuleType) -> tuple[Any, Any]:
    """(token_scale, token_quantize), see the module docstring."""

    def token_scale(amax, min_amax, divisor, INT8: tl.constexpr):
        # div_rn: IEEE division like torch's (Triton's `/` is the approximate div.full.f32 on GPU)
        if INT8:
            scale = tl.div_rn(tl.maximum(amax, min_amax), divisor)
        else:
            scale = tl.maximum(tl.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
        return scale

    def token_quantize(x, scale, qmax, INT8: tl.constexpr, INTERPRET: tl.constexpr):
        # one return at the end: Triton compiles the code after a return inside `if`
        if INT8:
            v = (tl.div_rn(x, scale) + 12582912.0) - 12582912.0  # + 1.5 * 2^23: round half to even
            q = tl.minimum(tl.maximum(v, -128.0), qmax).to(tl.int8)
        else:
            v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
            if INTERPRET:
                # The interpreter's e4m3 downcast rounds wrongly: snap onto the e4m3 grid first
                # (RNE on the fp32 bits for normals, multiples of 2^-9 below 2^-6); exact on GPU anyway.
                bits = v.to(tl.int32, bitcast=True)
                lsb = (bits >> 20) & 1
                normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
                sub = ((tl.abs(v) * 512.0 + 12582912.0) - 12582912.0) / 512.0
                sign = bits & -2147483648  # copy the sign bit: keeps -0 for negatives that round to 0
                sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
                v = tl.where(tl.abs(v) < 0.015625, sub, normal)
            q = v.to(tl.float8e4nv)
        return q

    return jit(token_scale), jit(token_quantize)
