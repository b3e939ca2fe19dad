"""Symmetric int8: the channelwise weight layout the int8 kernels share, and dynamic per-token
activation quantization (SmoothQuant-style W8A8 as llm-compressor's W8A8 scheme declares it).

Weights: checkpoint codes are unsigned with bias 128 (uint8b128), so the stored int8 is `code - 128`;
one scale per output channel.
Activations: every token row t of x (M, K) gets scale_t = max(amax_t, MIN_AMAX) / 127.5 and
q_t = clamp(round_half_even(x_t / scale_t), -128, 127): compressed-tensors' symmetric qparams
(scale = amax / ((2^8 - 1) / 2)), the semantics the checkpoint was calibrated and evaluated with.
vLLM divides by 127 instead; on the SmoothQuant W8A8 SmolLM2 that raised perplexity from 24.28 to
24.45 against transformers' 24.25 on the same checkpoint (tests/runtime/test_w8a8.py).
"""

from __future__ import annotations

import torch

from kernels.base import IntWeight, LinearSpec
from kernels.codecs.exact import exact_div
from kernels.errors import LayoutError

CODE_BIAS = 128  # uint8b128: real integer = code - 128
INT8_MAX = 127.0
SCALE_DIVISOR = 127.5  # (2^8 - 1) / 2
MIN_AMAX = 1e-10  # an all-zero token row quantizes to zeros with a finite scale


def symmetric_channelwise_int8(
    weight: object, spec: LinearSpec, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight (N, K) int8 = code - 128, scales (N,) in the checkpoint dtype) of a symmetric
    channelwise 8-bit layer; anything else is a LayoutError naming the layer and what takes it."""
    if not isinstance(weight, IntWeight):
        raise LayoutError(f"{kernel}: layer {spec.name} needs an IntWeight, got {type(weight).__name__}")
    n, k = spec.n, spec.k
    if tuple(weight.codes.shape) != (n, k) or weight.bits != 8:
        raise LayoutError(
            f"{kernel}: layer {spec.name} codes {tuple(weight.codes.shape)} x {weight.bits} bits, "
            f"spec says ({n}, {k}) x 8 bits"
        )
    if weight.zeros is not None and not bool((weight.zeros == CODE_BIAS).all()):
        raise LayoutError(f"{kernel}: layer {spec.name} has asymmetric zero points; use the dense kernel")
    if tuple(weight.scales.shape) != (1, n):
        raise LayoutError(
            f"{kernel}: layer {spec.name} scales have shape {tuple(weight.scales.shape)}, "
            f"channelwise needs (1, {n}); grouped 8-bit goes to the dense kernel"
        )
    qweight = (weight.codes.to(torch.int16) - CODE_BIAS).to(torch.int8).contiguous()  # (N, K)
    return qweight, weight.scales.reshape(n)


def quantize_channelwise_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> IntWeight:
    """(N, K) float weight -> symmetric channelwise 8-bit `IntWeight` (uint8b128 codes, scales (1, N)
    in `scale_dtype`): scale = max |row| / 127, rounded to `scale_dtype` before the codes are taken
    from it, so the codes times the stored scales are what the weight is quantized to (an all-zero
    row gets a tiny finite scale and zero codes)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1).clamp_(min=MIN_AMAX) / INT8_MAX).to(scale_dtype)  # (N,)
    codes = torch.div(wf, scale.float()[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX)
    return IntWeight(codes=(codes + CODE_BIAS).to(torch.uint8), scales=scale[None, :], bits=8, group_size=-1)


def quantize_per_token_int8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (q (M, K) int8, scale (M,) float32); x ≈ q * scale[:, None]."""
    xf = x2.float()
    scale = exact_div(xf.abs().amax(dim=1).clamp_(min=MIN_AMAX), SCALE_DIVISOR)
    q = torch.div(xf, scale[:, None]).round_().clamp_(-128.0, INT8_MAX).to(torch.int8)
    return q, scale
