"""Standard bit packing of small unsigned integers into little-endian int32 words (docs/formats.md §0, §1.1).

"Standard packing": element ``t`` of a run of ``pf = 32 // bits`` consecutive elements sits in bits
``[bits*t, bits*t + bits)`` of its word, low bits first. 2/4/8-bit packing is built from byte
packing plus a little-endian reinterpretation of 4 bytes as one int32, so values with the top bit set
wrap into negative int32 exactly as a C uint32 -> int32 cast would. 3-bit packing follows AutoGPTQ:
every 32 consecutive values form one 96-bit little-endian bit stream stored as 3 int32 words.

`*_rows` pack along dim 0 (GPTQ qweight, CT zero points), `*_cols` along dim 1 (GPTQ qzeros,
CT weight_packed). A dimension that is not a multiple of the pack unit is zero-padded on packing
(compressed-tensors' ``ceil(K / pf)``) and cut back to the requested length on unpacking.
"""

from __future__ import annotations

import sys

import torch

from kernels.errors import LayoutError

SUPPORTED_BITS = (2, 3, 4, 8)

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("kernels.codecs.bitpack reinterprets bytes as little-endian int32 words")


# Code widths with no packing of their own (GGUF Q5_0 / Q5_1 / Q5_K: 5 bits, Q6_K: 6): a layout that
# takes them stores each code in a byte (8-bit packing), exactly; symmetric codes move to the 8-bit
# midpoint so that the stored zero is 128, as for any symmetric 8-bit layer.
BYTE_STORED_BITS = (5, 6)


def stored_bits(bits: int) -> int:
    """The packing width a layer of `bits`-bit codes is stored with (8 for BYTE_STORED_BITS)."""
    return 8 if bits in BYTE_STORED_BITS else bits


def code_shift(bits: int, midpoint_zero: bool) -> int:
    """What storing `bits`-bit codes at `stored_bits(bits)` adds to each code: a symmetric layer's
    implicit zero moves from 2**(bits-1) to the stored width's; integer zero points and float
    minimums keep the codes as they are."""
    wide = stored_bits(bits)
    return (1 << (wide - 1)) - (1 << (bits - 1)) if midpoint_zero and wide != bits else 0


def to_stored_codes(codes: torch.Tensor, bits: int, midpoint_zero: bool) -> torch.Tensor:
    """`bits`-bit codes as a layout packing them at `stored_bits(bits)` holds them (`codes` itself
    when nothing moves)."""
    shift = code_shift(bits, midpoint_zero)
    return codes + shift if shift else codes


def from_stored_codes(stored: torch.Tensor, bits: int, midpoint_zero: bool) -> torch.Tensor:
    """The inverse of `to_stored_codes`, as uint8."""
    return (stored - code_shift(bits, midpoint_zero)).to(torch.uint8)


def packed_length(length: int, bits: int) -> int:
    """int32 words that hold `length` values (padded up to a whole pack unit)."""
    _check_bits(bits)
    unit, words = _unit(bits)
    return -(-length // unit) * words


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(K, N) integer codes in [0, 2**bits) -> (ceil(K*bits/32), N) int32, packed along dim 0."""
    _check_2d(q, "q")
    _check_bits(bits)
    if bits == 3 or (not q.is_contiguous() and q.T.is_contiguous()):
        # a transposed view (e.g. IntWeight.codes.T): pack its contiguous side, transpose int32 words
        return pack_cols(q.T, bits).T.contiguous()
    codes = _as_codes(q, bits)
    pf = 32 // bits
    k, n = codes.shape
    if k % pf:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pf - k % pf))
    per_byte = 8 // bits
    v = codes.view(-1, 4, per_byte, n)  # [word row, byte j, field in byte s, N]
    out = torch.empty(v.shape[0], n, 4, dtype=torch.uint8)  # little-endian bytes of each word
    for j in range(4):  # byte planes; long contiguous inner loops, strided stores
        plane = v[:, j, 0] if per_byte == 1 else _or_fields(v[:, j], bits)
        out[..., j] = plane
    return out.view(torch.int32).view(-1, n)  # (ceil(K * bits / 32), N) int32


def unpack_rows(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """(K*bits/32, N) int32 -> (K, N) uint8: the inverse of `pack_rows`, keeping the first `k` rows."""
    _check_2d(packed, "packed")
    _check_bits(bits)
    if bits == 3:
        return unpack_cols(packed.T, bits, k).T.contiguous()
    if packed.dtype != torch.int32:
        raise LayoutError(f"packed tensor must be int32, got {packed.dtype}")
    rows, n = packed.shape
    if k > packed_capacity(rows, bits) or k < 0:
        raise LayoutError(f"cannot unpack {k} {bits}-bit rows from {rows} int32 rows")
    raw = packed.contiguous().view(torch.uint8).view(rows, n, 4)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    out = torch.empty(rows, 4, per_byte, n, dtype=torch.uint8)
    for j in range(4):
        for s in range(per_byte):
            if bits == 8:
                out[:, j, s] = raw[..., j]
            elif s == 0:
                torch.bitwise_and(raw[..., j], mask, out=out[:, j, s])
            elif s == per_byte - 1:
                torch.bitwise_right_shift(raw[..., j], bits * s, out=out[:, j, s])
            else:
                out[:, j, s] = (raw[..., j] >> (bits * s)) & mask
    full = out.view(-1, n)
    return full[:k] if k < full.shape[0] else full


def _or_fields(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v (R, per_byte, N) uint8 fields -> (R, N) uint8 bytes, field s at bits [bits*s, bits*s + bits)."""
    acc = v[:, 0] | (v[:, 1] << bits)
    for s in range(2, v.shape[1]):
        acc |= v[:, s] << (bits * s)
    return acc


def pack_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) integer codes in [0, 2**bits) -> (R, ceil(C*bits/32)) int32, packed along dim 1."""
    _check_2d(q, "q")
    _check_bits(bits)
    codes = _as_codes(q, bits)
    unit, _ = _unit(bits)
    rows, cols = codes.shape
    pad = -cols % unit
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if bits == 3:
        return _pack3(codes)
    per_byte = 8 // bits
    grouped = codes.reshape(rows, -1, per_byte)
    packed_bytes = grouped[..., 0].clone()
    for t in range(1, per_byte):  # at most 3 iterations: fields inside one byte
        packed_bytes |= grouped[..., t] << (bits * t)
    return packed_bytes.view(torch.int32)  # (R, C*bits/32) int32, little-endian bytes


def unpack_cols(packed: torch.Tensor, bits: int, c: int) -> torch.Tensor:
    """(R, C*bits/32) int32 -> (R, C) uint8: the inverse of `pack_cols`, keeping the first `c` columns."""
    _check_2d(packed, "packed")
    _check_bits(bits)
    if packed.dtype != torch.int32:
        raise LayoutError(f"packed tensor must be int32, got {packed.dtype}")
    capacity = packed_capacity(packed.shape[1], bits)
    if c > capacity or c < 0:
        raise LayoutError(f"cannot unpack {c} {bits}-bit values from {packed.shape[1]} int32 words per row")
    if bits == 3:
        return _unpack3(packed.contiguous())[:, :c].contiguous()
    raw = packed.contiguous().view(torch.uint8)  # (R, 4 * words)
    if bits == 8:
        return raw[:, :c].clone() if c < raw.shape[1] else raw.clone()
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    out = torch.empty(raw.shape[0], raw.shape[1], per_byte, dtype=torch.uint8)
    for t in range(per_byte):
        torch.bitwise_and(raw >> (bits * t), mask, out=out[..., t])
    return out.reshape(raw.shape[0], -1)[:, :c].contiguous()


def packed_capacity(words: int, bits: int) -> int:
    """How many values `words` int32 words hold (whole 3-word units for 3-bit)."""
    unit, per_unit = _unit(bits)
    return (words // per_unit) * unit


def wrap_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bit pattern (two's complement wrap)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _unit(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest whole packing unit."""
    return (32, 3) if bits == 3 else (32 // bits, 1)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise LayoutError(f"bit width {bits} is not supported; packing supports {SUPPORTED_BITS}")


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise LayoutError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _as_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Validate the range of integer codes and return them as uint8."""
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise LayoutError(f"codes must be an integer tensor, got {q.dtype}")
    if q.dtype == torch.uint8 and bits == 8:
        return q.contiguous()
    if q.numel():
        lo_t, hi_t = torch.aminmax(q)
        lo, hi = int(lo_t), int(hi_t)
        if lo < 0 or hi >= (1 << bits):
            raise LayoutError(
                f"{bits}-bit codes must lie in [0, {(1 << bits) - 1}], found values in [{lo}, {hi}]"
            )
    return q.to(torch.uint8).contiguous()


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    """(R, 32*u) uint8 -> (R, 3*u) int32: each 32 values form one 96-bit little-endian bit stream."""
    rows = codes.shape[0]
    v = codes.reshape(rows, -1, 32).to(torch.int64)
    words = []
    for w in range(3):  # the three words of a unit; each gathers the values overlapping it
        j = torch.arange(32)
        start = 3 * j - 32 * w
        hit = (start > -3) & (start < 32)
        j, start = j[hit], start[hit]
        part = (v[..., j] >> (-start).clamp(min=0)) << start.clamp(min=0)
        words.append((part & 0xFFFFFFFF).sum(-1))
    return wrap_int32(torch.stack(words, -1).reshape(rows, -1))


def _unpack3(packed: torch.Tensor) -> torch.Tensor:
    """(R, 3*u) int32 -> (R, 32*u) uint8, inverse of `_pack3`."""
    rows = packed.shape[0]
    w = packed.reshape(rows, -1, 3).to(torch.int64) & 0xFFFFFFFF
    lo64 = w[..., 0] | (w[..., 1] << 32)  # stream bits 0..63 (bit 63 lands in the sign, harmless)
    hi64 = w[..., 1] | (w[..., 2] << 32)  # stream bits 32..95
    j = torch.arange(32)
    use_hi = 3 * j + 3 > 64
    shift = torch.where(use_hi, 3 * j - 32, 3 * j)
    src = torch.where(use_hi[None, None, :], hi64[..., None], lo64[..., None])
    return ((src >> shift) & 7).to(torch.uint8).reshape(rows, -1)
