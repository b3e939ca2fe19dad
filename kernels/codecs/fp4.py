"""FP4 (E2M1) nibble packing as every safetensors FP4 format stores it (compressed-tensors NVFP4 /
MXFP4, NVIDIA ModelOpt, gpt-oss): byte j of a row holds element 2j in its low nibble and element
2j + 1 in its high nibble, rows along K. (GGUF's MXFP4 blocks order nibbles differently.)
"""

from __future__ import annotations

import torch

from kernels.base import E2M1_VALUES
from kernels.errors import LayoutError

# (codes, block scales, global multiplier or None): the parts of a `kernels.base.Fp4Weight`
Fp4WeightLike = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(..., K / 2) uint8 packed codes -> (..., K) uint8 E2M1 codes."""
    if packed.dtype != torch.uint8:
        raise LayoutError(f"packed FP4 weights are uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) uint8 codes 0..15 -> (..., K / 2) uint8, the inverse of `unpack_fp4`."""
    if codes.shape[-1] % 2:
        raise LayoutError(f"FP4 packing needs an even K, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """(...) float -> (...) uint8 E2M1 code of the nearest value (saturating at ±6; ties to the lower
    magnitude)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    code = (x.float().abs().clamp(max=6.0)[..., None] - magnitudes).abs().argmin(-1).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def quantize_fp4(w: torch.Tensor, fmt: str) -> Fp4WeightLike:
    """(N, K) float weight -> (codes (N, K) uint8, block scales, global multiplier or None), the way
    the FP4 quantizers set their scales: NVFP4 `global = amax / (6 * 448)` and E4M3 block scales
    `amax_block / 6 / global`; MXFP4 E8M0 exponents `floor(log2(amax_block)) - 2` (biased by 127)."""
    n, k = w.shape
    w = w.float()
    if fmt == "nvfp4":
        g = (w.abs().amax() / (6 * 448)).clamp_min(2.0**-126).reshape(1)
        blocks = w.reshape(n, k // 16, 16)
        scales = (blocks.abs().amax(-1) / 6 / g).clamp(2.0**-9, 448).to(torch.float8_e4m3fn)
        step = (scales.float() * g)[..., None]
        return round_to_e2m1(blocks / step).reshape(n, k), scales, g
    blocks = w.reshape(n, k // 32, 32)
    exponent = torch.floor(torch.log2(blocks.abs().amax(-1).clamp_min(2.0**-120))) - 2
    scales = (exponent + 127).clamp(0, 254).to(torch.uint8)
    step = torch.exp2(scales.float() - 127)[..., None]
    return round_to_e2m1(blocks / step).reshape(n, k), scales, None
