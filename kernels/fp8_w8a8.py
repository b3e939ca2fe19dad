"""fp8_w8a8: FP8 e4m3 weights x dynamically per-token-quantized FP8 activations (sm89 / sm90).

Stored tensors (per rank):
    weight        (N, K) float8_e4m3fn  row-major, i.e. K-major as FP8 tensor cores want it
                                        (`weight.t()` is the column-major (K, N) operand of _scaled_mm)
    weight_scale  (1,) float32 per-tensor (fused shards requantized to the max shard scale, vLLM's
                  requantize_with_max_scale) or (N,) float32 per-channel; multipliers
    bias          (N,) act dtype, optional
Runtime: every token row t of x is quantized as scale_t = max(amax_t / 448, 1 / (448 * 512)),
q_t = e4m3(clamp(x_t / scale_t, ±448)) (vLLM's dynamic per-token kernel), then
y = (q @ weight.T) * scale_t * weight_scale (+ bias), accumulated in fp32. Up to FUSED_QUANT_MAX_M
rows the GEMM quantizes in its own prologue (`token_quant_gemm_kernel`), above that a per-token
kernel runs first; both write the same bytes (kernels/fp8_tiles.py `token_quant_tiles`).

Two GEMM backends: the Triton kernel (`fp8_w8a8_gemm`, what `apply` runs) and `torch._scaled_mm`
(`scaled_mm_gemm`, row-wise scales); bench/gpu_check.py measures both on the GPU.
`reference` mirrors the activation quantization in torch, so apply and its twin differ only by
accumulation order; the error against unquantized activations is bounded separately (tests).
int8_w8a8 shares all but the weight codes and the activation rounding: the class (`TokenScaledKernel`),
the per-token launch (`quantize_rows`, `row_amax_tile`) and the GEMM (`token_scaled_gemm`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import (
    Fp8Weight,
    LinearKernel,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    token_quantized_reference,
    with_bias,
)
from kernels.codecs.exact import exact_div
from kernels.codecs.fp8 import E4M3_MAX, requantize_to_max_scale
from kernels.codecs.int8 import INT8_MAX, MIN_AMAX, SCALE_DIVISOR
from kernels.errors import LayoutError
from kernels.fp8_tiles import fp8_tiles, token_quant_tiles
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, operand_tiles
from kernels.jit import act_dtype_reason, import_triton, interpreter_enabled, jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, default_config
from kernels.targets import gpu_targets

MIN_TOKEN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # vLLM's min_scaling_factor for dynamic per-token quant
FP8 = torch.float8_e4m3fn
# Rows up to which the GEMM quantizes its activations itself: every program of a row re-reads the
# row's K activations for its max |x|, cheap against the weight at decode sizes, not at prefill.
FUSED_QUANT_MAX_M = 16
# (min_amax, divisor, qmax) of the prologue's quantization: e4m3 (token_scale ignores the first)
# and int8 (kernels/codecs/int8.py)
FP8_QUANT_ARGS = (0.0, E4M3_MAX, E4M3_MAX)
INT8_QUANT_ARGS = (MIN_AMAX, SCALE_DIVISOR, float(INT8_MAX))


class TokenScaledKernel(LinearKernel):
    """A W8A8 kernel on 1-byte operands (fp8_w8a8, int8_w8a8): the (N, K) `weight_dtype` weight,
    `weight_scale` (1,) per-tensor or (N,) per-channel fp32 multipliers, the bias in the act dtype;
    activations quantized per token by `quantize` (Triton) in `apply` and by `quantize_reference`
    (torch, the same bytes) in the twin; the GEMM is `token_scaled_gemm`. A subclass states its
    weights' rules in `supports` before this class's and quantizes the weight (`quantized_weight`)."""

    weight_dtype: ClassVar[torch.dtype]

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if reason := act_dtype_reason(spec.act_dtype, self.name, target):
            return False, reason
        if spec.k % 16 or spec.n % 16:
            return False, f"{self.name} needs N and K per rank multiples of 16, got N={spec.n}, K={spec.k}"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        scales = 1 if spec.fp8_strategy == "tensor" else spec.n
        out = {
            "weight": StoredTensor((spec.n, spec.k), self.weight_dtype),
            "weight_scale": StoredTensor((scales,), torch.float32),
        }
        return with_bias(out, spec, spec.torch_act_dtype)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        qweight, scale = self.quantized_weight(weight, spec)
        out = {"weight": qweight, "weight_scale": scale}
        if weight.bias is not None:
            out["bias"] = weight.bias.to(spec.torch_act_dtype).contiguous()
        return out

    def stored_fp8_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Fp8Weight | None:
        w = tensors["weight"]
        if w.dtype != torch.float8_e4m3fn or spec.fp8_strategy not in ("tensor", "channel"):
            return None
        return Fp8Weight(w, tensors["weight_scale"], spec.fp8_strategy)

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        w = tensors["weight"]
        return (w.cpu().float() * tensors["weight_scale"].cpu().float().reshape(-1, 1)).to(w.device)  # (N, K)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return token_scaled_gemm(x, self.quantize, tensors, spec, kernel=self.name)

    def reference(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Torch twin: the same per-token activation quantization, dequantized weight, fp32 matmul."""
        return token_quantized_reference(self, self.quantize_reference, x, tensors, spec)

    @abstractmethod
    def quantized_weight(self, weight: SourceWeight, spec: LinearSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored (weight (N, K) `weight_dtype`, weight_scale (1,) or (N,) fp32) of a layer."""

    @abstractmethod
    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, K) activations -> (q (M, K) 1-byte, scale (M,) fp32) by the Triton kernel `apply` runs."""

    @abstractmethod
    def quantize_reference(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize` in torch, byte for byte (the twin's)."""


class Fp8W8A8Kernel(TokenScaledKernel):
    name: ClassVar[str] = "fp8_w8a8"
    vllm_kernel: ClassVar[str] = "cutlass_scaled_mm"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"fp8"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(89)  # FP8 tensor cores
    elsewhere: ClassVar[str] = "sm80/sm86 have no FP8 tensor cores and use fp8_marlin (W8A16)"
    description: ClassVar[str] = (
        "FP8 e4m3 W8A8, per-tensor/channel weight scales, dynamic per-token activations"
    )
    weight_dtype: ClassVar[torch.dtype] = FP8

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.fp8_strategy not in ("tensor", "channel"):
            return False, (
                f"fp8_w8a8 takes per-tensor or per-channel weight scales, not {spec.fp8_strategy!r}; "
                "block-scaled FP8 goes to fp8_marlin or fp8_w8a16"
            )
        return super().supports(spec, target)

    def quantized_weight(self, weight: SourceWeight, spec: LinearSpec) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.prepare_input(weight, Fp8Weight, spec)
        if weight.strategy == "tensor":
            fused = weight.scale.numel() > 1
            w = requantize_to_max_scale(weight) if fused else weight
            return w.weight.contiguous(), w.scale.float().reshape(1)
        if weight.strategy == "channel":
            return weight.weight.contiguous(), weight.scale.float().reshape(spec.n)
        raise LayoutError(f"{spec.name}: fp8_w8a8 cannot take {weight.strategy!r} scales (use fp8_marlin)")

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_token(x2)

    def quantize_reference(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_token_reference(x2)


def quantize_per_token_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (q (M, K) e4m3, scale (M,) fp32), vLLM's dynamic per-token semantics, in torch."""
    xf = x2.float()
    amax = xf.abs().amax(dim=1)
    scale = exact_div(amax, E4M3_MAX).clamp(min=MIN_TOKEN_SCALE)
    q = (xf / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token quantization (one program per row); same bytes as the reference."""
    return quantize_rows(x2, FP8, _quant_kernel(), INTERPRET=interpreter_enabled())


def quantize_rows(
    x2: torch.Tensor, dtype: torch.dtype, kernel: Any, *args: Any, **constexprs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a per-token quantization kernel, one program per row of x2 (M, K):
    kernel[(M,)](X, Q, S, K, *args, BLOCK=..., **constexprs) -> (q (M, K) `dtype`, scale (M,) fp32)."""
    m, k = x2.shape
    q = torch.empty(m, k, device=x2.device, dtype=dtype)
    scale = torch.empty(m, device=x2.device, dtype=torch.float32)
    if m == 0:
        return q, scale
    triton, _ = import_triton()
    block = min(triton.next_power_of_2(k), 4096)
    kernel[(m,)](x2, q, scale, k, *args, BLOCK=block, **constexprs)
    return q, scale


def fp8_w8a8_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with the Triton FP8 kernel; x (..., K) bf16/fp16."""
    return token_scaled_gemm(x, quantize_per_token, tensors, spec, config, kernel="fp8_w8a8")


def token_scaled_gemm(
    x: torch.Tensor,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    tensors: dict[str, torch.Tensor],
    spec: LinearSpec,
    config: GemmConfig | None = None,
    *,
    kernel: str,
    fused: bool | None = None,
) -> torch.Tensor:
    """y = (q @ weight.T) * scale_t * weight_scale (+ bias), q, scale_t = quantize(x rows), on 1-byte
    operands: FP8 e4m3 (fp32 accumulator) or int8 (exact int32 accumulator, int8_w8a8).

    Up to FUSED_QUANT_MAX_M rows (`fused` None) the GEMM quantizes the activations in its prologue
    (the same bytes as `quantize`: one launch, no quantized copy); above, `quantize` runs first."""
    x2 = gemm_rows(x, spec.k, kernel).contiguous()
    m, n, k = x2.shape[0], spec.n, spec.k
    cfg = config or default_config(m, n, k, x.device, kind="fp8")
    ws, w = tensors["weight_scale"], tensors["weight"]
    run = GemmLaunch.plan(x, m, n, cfg, tensors)
    int8 = w.dtype == torch.int8
    if fused if fused is not None else m <= FUSED_QUANT_MAX_M:
        return run.launch(
            _fused_gemm_kernel(),
            x2, w, ws, run.bias_or(ws), run.y,
            m, n, k, *(INT8_QUANT_ARGS if int8 else FP8_QUANT_ARGS),
            PER_CHANNEL=ws.numel() > 1, INT8=int8, INTERPRET=interpreter_enabled(),
        )  # fmt: skip
    xq, xs = quantize(x2)
    return run.launch(
        _gemm_kernel(),
        xq, xs, w, ws, run.bias_or(ws), run.y,
        m, n, k,
        PER_CHANNEL=ws.numel() > 1, INT8=int8,
    )  # fmt: skip


def scaled_mm_gemm(x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
    """The same GEMM through torch._scaled_mm with row-wise scales (CUDA sm89+; for the benchmark)."""
    x2 = gemm_rows(x, spec.k, "fp8_w8a8").contiguous()
    xq, xs = quantize_per_token(x2)
    ws = tensors["weight_scale"].float().reshape(1, -1).expand(1, spec.n).contiguous()
    # Row-wise scaling produces bfloat16 only; fp16 callers get a cast (bias added in fp32 below).
    y = torch._scaled_mm(
        xq, tensors["weight"].t(), scale_a=xs[:, None].contiguous(), scale_b=ws, out_dtype=torch.bfloat16
    )
    if "bias" in tensors:
        y = (y.float() + tensors["bias"].float()).to(x.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], spec.n)


@triton_builder
def row_amax_tile(tl: ModuleType) -> Any:
    """`@triton.jit` row_amax: max |x| over row `row` of the row-major (M, K) X, in BLOCK steps (fp32),
    the first pass of every per-token quantization kernel."""

    def row_amax(X, row, K, BLOCK: tl.constexpr):
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        return tl.max(amax, axis=0)

    return jit(row_amax)


@triton_builder
def _quant_kernel(tl: ModuleType) -> Any:
    row_amax = row_amax_tile()
    token_scale, token_quantize = token_quant_tiles()

    def fp8_per_token_quant_kernel(X, Q, S, K, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        scale = token_scale(row_amax(X, row, K, BLOCK), 0.0, 448.0, False)
        tl.store(S + row, scale)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(X + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(Q + row * K + offs, token_quantize(x, scale, 448.0, False, INTERPRET), mask=offs < K)

    return jit(fp8_per_token_quant_kernel)


@triton_builder
def _gemm_kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    token_scaled = fp8_tiles()[2]

    def token_scaled_gemm_kernel(
        XQ, XS, W, WS, BIAS, Y,
        M, N, K,
        PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, INT8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        acc = token_scaled(
            XQ, XS, W, WS, offs_m, mask_m, offs_n, mask_n, k_begin, k_end, K,
            BLOCK_M, BLOCK_N, BLOCK_K, PER_CHANNEL, INT8,
        )  # fmt: skip
        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(token_scaled_gemm_kernel)


@triton_builder
def _fused_gemm_kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile, kmajor_tile = operand_tiles()
    token_scale, token_quantize = token_quant_tiles()
    token_scaled_epilogue = fp8_tiles()[3]

    def token_quant_gemm_kernel(
        X, W, WS, BIAS, Y,
        M, N, K, min_amax, divisor, qmax,
        PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, INT8: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)  # over the whole row, whatever this K split
        for it in range(0, tl.cdiv(K, BLOCK_K)):
            x, _, _ = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, True)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = token_scale(amax, min_amax, divisor, INT8)  # (BM,)
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)  # exact: |127 * 128| * K < 2^31
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, offs_k, mask_k = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, True)
            a = token_quantize(x, scale[:, None], qmax, INT8, INTERPRET)
            acc += tl.dot(a, kmajor_tile(W, offs_n, mask_n, offs_k, mask_k, K))
        acc = token_scaled_epilogue(acc, scale, WS, offs_n, mask_n, PER_CHANNEL)
        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(token_quant_gemm_kernel)
