"""compressed-tensors integer layouts (docs/formats.md §3.2) <-> canonical `IntWeight`.

pack-quantized (W4A16 / W8A16):
    weight_packed      (N, ceil(K * bits / 32)) int32  packed along K, standard order
    weight_scale       (N, G) float                    G = 1 for strategy "channel"
    weight_zero_point  (ceil(N * bits / 32), G) int32  packed along N; only when asymmetric
    weight_g_idx       (K,) int32                      only for actorder "group"
    weight_shape       (2,) int64                      (N, K)
Stored code = signed q + 2**(bits-1), i.e. exactly the unsigned code of `IntWeight`; the stored zero
point carries the same offset.

int-quantized (W8A8 int8 weights): weight (N, K) int8 signed, weight_scale (N, G) / (N, 1) / scalar,
optional weight_zero_point (N, G) int8 signed.
"""

from __future__ import annotations

import torch

from kernels.base import IntWeight
from kernels.codecs.bitpack import pack_cols, pack_rows, packed_capacity, unpack_cols, unpack_rows
from kernels.errors import LayoutError


def decode_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    k: int | None = None,
) -> IntWeight:
    """Unpack one pack-quantized layer. `k` (from weight_shape) trims K padding; default: all fields."""
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise LayoutError(
            "weight_packed must be a 2-D int32 tensor, "
            f"got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    n = weight_packed.shape[0]
    k = packed_capacity(weight_packed.shape[1], bits) if k is None else k
    if weight_scale.dim() != 2 or weight_scale.shape[0] != n:
        raise LayoutError(f"weight_scale must be (N={n}, G), got {tuple(weight_scale.shape)}")
    g = weight_scale.shape[1]
    codes = unpack_cols(weight_packed, bits, k)  # (N, K) uint8
    zeros = None
    if weight_zero_point is not None and weight_zero_point.numel():
        if weight_zero_point.shape[1] != g:
            raise LayoutError(
                f"weight_zero_point must be (ceil(N*{bits}/32), G={g}), got {tuple(weight_zero_point.shape)}"
            )
        zeros = unpack_rows(weight_zero_point, bits, n).T.contiguous()  # (G, N) uint8
    g_idx = None
    if weight_g_idx is not None and weight_g_idx.numel():
        if weight_g_idx.shape != (k,):
            raise LayoutError(f"weight_g_idx must have shape (K={k},), got {tuple(weight_g_idx.shape)}")
        g_idx = weight_g_idx.to(torch.int32)
        if group_size > 0 and torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group_size):
            g_idx = None
    return IntWeight(
        codes=codes,
        scales=weight_scale.T.contiguous(),
        bits=bits,
        group_size=group_size,
        zeros=zeros,
        g_idx=g_idx,
    )


def encode_pack_quantized(w: IntWeight) -> dict[str, torch.Tensor]:
    """Pack an `IntWeight` the way compressed-tensors' PackedQuantizationCompressor writes it."""
    n, k = w.codes.shape
    out = {
        "weight_packed": pack_cols(w.codes, w.bits),  # (N, ceil(K * bits / 32)) int32
        "weight_scale": w.scales.T.contiguous(),  # (N, G)
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if w.zeros is not None:
        out["weight_zero_point"] = pack_rows(w.zeros.T, w.bits)  # (ceil(N * bits / 32), G) int32
    if w.g_idx is not None:
        out["weight_g_idx"] = w.g_idx.to(torch.int32)
    return out


def decode_int_quantized(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    *,
    group_size: int,
) -> IntWeight:
    """int-quantized int8 (N, K) signed weights -> 8-bit unsigned codes (offset 128).

    weight_scale may be per-tensor (scalar or (1,)), channel (N, 1) or group (N, G); per-tensor
    scales are broadcast to (1, N). A zero point that is all 0 means symmetric (zeros=None).
    """
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise LayoutError(
            f"int-quantized weight must be (N, K) int8, got {weight.dtype} {tuple(weight.shape)}"
        )
    n, _ = weight.shape
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    scales = _scales_to_gn(weight_scale, n, "weight_scale")
    zeros = None
    if weight_zero_point is not None and weight_zero_point.numel() and bool(weight_zero_point.any()):
        zp = _scales_to_gn(weight_zero_point, n, "weight_zero_point")
        if zp.shape != scales.shape:
            raise LayoutError(
                f"weight_zero_point shape {tuple(zp.shape)} does not match scales {tuple(scales.shape)}"
            )
        zeros = (zp.to(torch.int16) + 128).to(torch.uint8)
    return IntWeight(codes=codes, scales=scales, bits=8, group_size=group_size, zeros=zeros)


def _scales_to_gn(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if t.numel() == 1:
        return t.reshape(1, 1).expand(1, n).contiguous()
    if t.dim() == 2 and t.shape[0] == n:
        return t.T.contiguous()
    raise LayoutError(f"{name} must be a scalar, (N={n}, 1) or (N={n}, G); got {tuple(t.shape)}")
