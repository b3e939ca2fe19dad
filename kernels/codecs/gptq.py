"""GPTQ checkpoints (AutoGPTQ / GPTQModel, docs/formats.md §1) <-> canonical `IntWeight`.

    qweight (K * bits / 32, N) int32   codes packed along K, standard order (3-bit: AutoGPTQ scheme)
    qzeros  (G, N * bits / 32) int32   zero points packed along N; v1 stores zero - 1, v2 the zero
    scales  (G, N) float               dequant multipliers
    g_idx   (K,) int32                 group of each input channel (non-monotonic under act-order)

A "symmetric" checkpoint still stores qzeros (0x77777777 for 4-bit v1, 0x88888888 for v2); decoding
with ``sym=True`` verifies them and returns ``zeros=None``.
"""

from __future__ import annotations

import torch

from kernels.base import IntWeight
from kernels.codecs.bitpack import pack_cols, packed_capacity, unpack_cols
from kernels.codecs.word_ops import for_each_block, hugepage_empty, nibbles_to_bytes, serial_ops
from kernels.errors import LayoutError


def decode_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    v2: bool,
) -> IntWeight:
    """Unpack one GPTQ layer. `v2` selects the checkpoint_format "gptq_v2" zero convention."""
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    k = packed_capacity(qweight.shape[0], bits)
    n = qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != n:
        raise LayoutError(f"GPTQ scales must be (G, N={n}), got {tuple(scales.shape)}")
    g = scales.shape[0]
    _check_groups(g, k, group_size)
    if qzeros.shape[0] != g or packed_capacity(qzeros.shape[1], bits) < n:
        raise LayoutError(
            f"GPTQ qzeros must be (G={g}, N*bits/32) int32 for N={n}, {bits}-bit; got {tuple(qzeros.shape)}"
        )
    with serial_ops():
        if bits == 4:
            codes = unpack4_transposed(qweight)  # (N, K) uint8
        else:
            codes = unpack_cols(qweight.T, bits, k)  # (N, K) uint8; transposing int32 words is the cheap side
        zeros = _stored_to_zeros(unpack_cols(qzeros, bits, n), bits, v2)  # (G, N)
        if sym:
            mid = 1 << (bits - 1)
            if not bool((zeros == mid).all()):
                raise LayoutError(_asym_message(zeros, bits, v2))
            zeros_out: torch.Tensor | None = None
        else:
            zeros_out = zeros.to(torch.uint8)
        return IntWeight(
            codes=codes,
            scales=scales,
            bits=bits,
            group_size=group_size,
            zeros=zeros_out,
            g_idx=_canonical_g_idx(g_idx, k, g, group_size),
        )


def encode_gptq(w: IntWeight, *, v2: bool) -> dict[str, torch.Tensor]:
    """Pack an `IntWeight` the way AutoGPTQ (v1) or GPTQModel gptq_v2 writes it."""
    n = w.codes.shape[0]
    g = w.scales.shape[0]
    zeros = (
        torch.full((g, n), 1 << (w.bits - 1), dtype=torch.int16)
        if w.zeros is None
        else w.zeros.to(torch.int16)
    )
    if not v2:
        if bool((zeros == 0).any()):
            raise LayoutError(
                "a zero point of 0 cannot be stored in a GPTQ v1 checkpoint (stored as -1, it corrupts the "
                "higher fields of its int32 word); write checkpoint_format 'gptq_v2' instead"
            )
        zeros = zeros - 1
    return {
        "qweight": pack_cols(w.codes, w.bits).T.contiguous(),  # (K * bits / 32, N) int32
        "qzeros": pack_cols(zeros, w.bits),  # (G, N * bits / 32) int32
        "scales": w.scales,  # (G, N)
        "g_idx": w.group_index().to(torch.int32),  # (K,) int32
    }


def qzeros_look_v2_symmetric(qzeros: torch.Tensor, bits: int, *, n: int | None = None) -> bool:
    """True if every stored zero equals 2**(bits-1) (0x88888888 for 4-bit): a symmetric v2-valued checkpoint.

    Labelled v1 ("gptq"), such a checkpoint would shift every weight by one step on the exllama
    kernel. `n` limits the check to the first n fields per row (padding fields are zero).
    """
    _check_int32("qzeros", qzeros)
    cols = packed_capacity(qzeros.shape[1], bits) if n is None else n
    stored = unpack_cols(qzeros, bits, cols)
    return bool(stored.numel()) and bool((stored == (1 << (bits - 1))).all())


def v1_to_v2_qzeros(qzeros: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Add one to every stored zero field (GPTQModel's v1 -> v2 conversion), any bit width."""
    stored = unpack_cols(qzeros, bits, n).to(torch.int16) + 1
    if bool((stored >= (1 << bits)).any()):
        raise LayoutError(f"GPTQ v1 qzeros hold {(1 << bits) - 1} (a true zero of 0): not convertible to v2")
    return pack_cols(stored, bits)


def v2_to_v1_qzeros(qzeros: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Subtract one from every stored zero field (GPTQModel's v2 -> v1 conversion), any bit width."""
    stored = unpack_cols(qzeros, bits, n).to(torch.int16) - 1
    if bool((stored < 0).any()):
        raise LayoutError("GPTQ v2 qzeros hold a zero point of 0, which GPTQ v1 cannot represent")
    return pack_cols(stored, bits)


def _stored_to_zeros(stored: torch.Tensor, bits: int, v2: bool) -> torch.Tensor:
    if v2:
        return stored
    full = (1 << bits) - 1
    if bool((stored == full).any()):
        raise LayoutError(
            f"GPTQ v1 qzeros contain the field value {full}: a true zero point of 0 stored as -1, which "
            "also corrupts the higher fields of its int32 word; this layer cannot be decoded exactly "
            "(re-quantize, or re-export it as checkpoint_format 'gptq_v2')"
        )
    return stored + 1


def _asym_message(zeros: torch.Tensor, bits: int, v2: bool) -> str:
    mid = 1 << (bits - 1)
    found = sorted({int(v) for v in zeros.unique()[:8]})
    if not v2 and found == [mid + 1]:
        return (
            f"GPTQ qzeros of this symmetric {bits}-bit layer hold {mid} in every field, the v2 convention, "
            "but the checkpoint is labelled v1 (checkpoint_format 'gptq'); decode it with v2=True "
            "(set checkpoint_format 'gptq_v2')"
        )
    return (
        f"quantization_config says sym=true but GPTQ qzeros decode to zero points {found} "
        f"(expected all {mid} for symmetric {bits}-bit); decode with sym=False"
    )


def _check_int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise LayoutError(f"GPTQ {name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")


def _check_groups(g: int, k: int, group_size: int) -> None:
    if group_size in (-1, 0):
        if g != 1:
            raise LayoutError(f"group_size -1 (channelwise) needs 1 scale row, got {g}")
        return
    if group_size < 0 or g not in (k // group_size, -(-k // group_size)):
        raise LayoutError(f"K={k} with group_size={group_size} needs {k // group_size} scale rows, got {g}")


def _canonical_g_idx(g_idx: torch.Tensor | None, k: int, g: int, group_size: int) -> torch.Tensor | None:
    """None when g_idx is the trivial k // group_size (or absent), else the (K,) int32 tensor."""
    if g_idx is None or g_idx.numel() == 0:
        return None
    if g_idx.shape != (k,):
        raise LayoutError(f"g_idx must have shape (K={k},), got {tuple(g_idx.shape)}")
    gi = g_idx.to(torch.int32)
    if int(gi.min()) < 0 or int(gi.max()) >= g:
        raise LayoutError(f"g_idx values must lie in [0, {g}), found [{int(gi.min())}, {int(gi.max())}]")
    trivial = (
        torch.zeros(k, dtype=torch.int32)
        if group_size in (-1, 0)
        else torch.arange(k, dtype=torch.int32) // group_size
    )
    return None if torch.equal(gi, trivial) else gi.contiguous()


def unpack4_transposed(packed: torch.Tensor) -> torch.Tensor:
    """(K / 8, N) int32 packed along K (standard nibble order) -> (N, K) uint8 codes."""
    kw, n = packed.shape
    out = hugepage_empty((n, kw * 4), torch.int16)  # (N, K / 2) int16 = (N, K) uint8

    words = hugepage_empty((n, kw), torch.int32)
    words.copy_(packed.T)  # one whole 2-D int32 transpose: torch's blocked fast path

    def block(blk: slice) -> None:
        scratch = torch.empty(blk.stop - blk.start, kw * 4, dtype=torch.int16)
        nibbles_to_bytes(words[blk], out[blk], scratch)

    for_each_block(n, 4 * kw, block)
    return out.view(torch.uint8).view(n, kw * 8)
