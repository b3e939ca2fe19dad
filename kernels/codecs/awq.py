"""AutoAWQ "GEMM" checkpoints (docs/formats.md §2) <-> canonical `IntWeight`, and vLLM's AWQ -> standard step.

    qweight (K, N * bits / 32) int32   packed along N in AWQ order: nibble i of int32 column c holds
                                       output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] (8-bit: [0, 2, 1, 3])
    qzeros  (G, N * bits / 32) int32   same order; stores the zero itself (no -1)
    scales  (G, N) float
Groups are contiguous (no g_idx).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.base import IntWeight
from kernels.codecs.bitpack import pack_cols, pack_rows
from kernels.codecs.word_ops import (
    for_each_block,
    hugepage_empty,
    nibble_transpose8,
    serial_ops,
)
from kernels.errors import LayoutError

AWQ_PACK_ORDER: dict[int, tuple[int, ...]] = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


def decode_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int,
    bits: int = 4,
) -> IntWeight:
    """Unpack one AWQ-GEMM layer (zero_point=True) into unsigned codes (N, K) and zeros (G, N)."""
    _check(qweight, qzeros, bits)
    k = qweight.shape[0]
    n = scales.shape[1]
    if qweight.shape[1] * 32 // bits != n or scales.shape[0] != qzeros.shape[0]:
        raise LayoutError(
            f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)} (expected (K, N/{32 // bits}), (G, N/{32 // bits}), (G, N))"
        )
    g = scales.shape[0]
    expected_g = 1 if group_size in (-1, 0) else k // group_size
    if g != expected_g:
        raise LayoutError(f"AWQ K={k} with group_size={group_size} needs {expected_g} scale rows, got {g}")
    codes = awq_unpack_transposed(qweight, bits)  # (N, K)
    zeros = awq_unpack(qzeros, bits)  # (G, N)
    return IntWeight(codes=codes, scales=scales, bits=bits, group_size=group_size, zeros=zeros)


def encode_awq(w: IntWeight) -> dict[str, torch.Tensor]:
    """Pack an `IntWeight` the way AutoAWQ's WQLinear_GEMM.from_linear writes it."""
    if w.g_idx is not None:
        raise LayoutError("AWQ has no g_idx: act-order weights cannot be written as AWQ")
    n = w.codes.shape[0]
    zeros = (
        torch.full((w.scales.shape[0], n), 1 << (w.bits - 1), dtype=torch.uint8)
        if w.zeros is None
        else w.zeros
    )
    return {
        "qweight": awq_pack(w.codes.T, w.bits),  # (K, N * bits / 32) int32
        "qzeros": awq_pack(zeros, w.bits),  # (G, N * bits / 32) int32
        "scales": w.scales,  # (G, N)
    }


def awq_to_standard(
    qweight: torch.Tensor, qzeros: torch.Tensor, *, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `_convert_awq_to_standard_format` (docs/formats.md §2.3).

    Returns (qweight_std (K * bits / 32, N) int32 packed along K, unsigned codes without bias;
             zero_point (N * bits / 32, G) int32, the compressed-tensors weight_zero_point layout).
    """
    _check(qweight, qzeros, bits)
    with serial_ops():
        zeros = awq_unpack(qzeros, bits)  # (G, N)
        if bits == 4 and qweight.shape[0] % 8 == 0:  # fast path: one nibble transpose per 8 rows x 1 word
            qweight_std = awq4_to_standard_rows(qweight.contiguous())
        else:
            qweight_std = pack_rows(awq_unpack(qweight, bits), bits)
        return qweight_std, pack_rows(zeros.T, bits)


def awq_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C * bits / 32) int32 in AWQ order -> (R, C) uint8 in natural column order."""
    r, words = packed.shape
    out = torch.empty(r, words, 32 // bits, dtype=torch.uint8)
    _scatter_fields(packed, bits, lambda col: out[..., col])
    return out.view(r, -1)


def awq_unpack_transposed(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C * bits / 32) int32 in AWQ order -> (C, R) uint8: `awq_unpack(...).T`, built directly."""
    r, words = packed.shape
    out = torch.empty(words, 32 // bits, r, dtype=torch.uint8)
    _scatter_fields(packed.T.contiguous(), bits, lambda col: out[:, col])  # int32 transpose is cheap
    return out.view(-1, r)


def awq_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) unsigned codes in natural order -> (R, C * bits / 32) int32 in AWQ order."""
    if bits not in AWQ_PACK_ORDER:
        raise LayoutError(f"AWQ packing exists for 4 and 8 bits, not {bits}")
    r, c = q.shape
    pf = 32 // bits
    if c % pf:
        raise LayoutError(f"AWQ packs {pf} columns per int32; {c} columns is not a multiple")
    order = torch.tensor(AWQ_PACK_ORDER[bits])
    return pack_cols(q.reshape(r, c // pf, pf)[..., order].reshape(r, c), bits)


def _scatter_fields(packed: torch.Tensor, bits: int, dest: Callable[[int], torch.Tensor]) -> None:
    """Write field f of every word (AWQ order) into dest(order[f]); one strided op per field."""
    raw = packed.contiguous().view(torch.uint8).view(*packed.shape, 4)
    order = AWQ_PACK_ORDER[bits]
    for f in range(32 // bits):
        if bits == 8:
            dest(order[f]).copy_(raw[..., f])
        elif f % 2 == 0:
            torch.bitwise_and(raw[..., f // 2], 0x0F, out=dest(order[f]))
        else:
            torch.bitwise_right_shift(raw[..., f // 2], 4, out=dest(order[f]))


def _check(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int) -> None:
    if bits not in AWQ_PACK_ORDER:
        raise LayoutError(f"AWQ-GEMM checkpoints are 4-bit (vLLM also knows 8-bit); got {bits}-bit")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise LayoutError(f"AWQ {name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")


_AWQ4_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) of AWQ nibble position i


def awq4_to_standard_rows(qweight: torch.Tensor) -> torch.Tensor:
    """(K, N / 8) int32 in AWQ nibble order (K % 8 == 0) -> (K / 8, N) int32 packed along K.

    Each block of 8 rows x 1 word is an 8 x 8 nibble matrix; transposing it leaves word i holding
    the 8 rows of AWQ nibble position i, i.e. of output column 8 c + _AWQ4_COLUMN[i].
    """
    k, w = qweight.shape
    kw = k // 8
    out = hugepage_empty((kw, w, 8), torch.int32)
    src = qweight.view(kw, 8, w)

    def block(blk: slice) -> None:
        v = src[blk].clone()
        nibble_transpose8(v, torch.empty(v.shape[0], 4, w, dtype=torch.int32))
        for i, col in enumerate(_AWQ4_COLUMN):
            out[blk, :, col].copy_(v[:, i])

    for_each_block(kw, 32 * w, block)
    return out.view(kw, 8 * w)  # (K / 8, N) int32
