"""llama.cpp GGUF tensor data <-> canonical weights, bit-exact with the `gguf` package's dequantizers.

A 2-D GGUF weight (N, K) stores each row as K / block_size blocks of type_size bytes; Kiln reads a
tensor's data as uint8 (N, K / block_size * type_size). Block layouts (fp16 fields little-endian):

    Q4_0  32 /  18   d, qs[16]                  x[i] = d * (q[i] - 8)
    Q4_1  32 /  20   d, m, qs[16]               x[i] = d * q[i] + m
    Q5_0  32 /  22   d, qh[4], qs[16]           x[i] = d * (q[i] - 16), bit 4 of q[i] = qh bit i
    Q5_1  32 /  24   d, m, qh[4], qs[16]        x[i] = d * q[i] + m
    Q8_0  32 /  34   d, qs int8[32]             x[i] = qs[i] * d
    Q4_K 256 / 144   d, dmin, scales[12], qs[128]            8 sub-blocks of 32, 6-bit scale and min
    Q5_K 256 / 176   d, dmin, scales[12], qh[32], qs[128]    as Q4_K, bit 4 of q[e] = qh[e % 32] bit e // 32
    Q6_K 256 / 210   ql[128], qh[64], scales int8[16], d    x[e] = (d * scales[e // 16]) * (q[e] - 32)

32-element nibbles run in split halves: element i < 16 is the low nibble of qs[i], element i + 16
its high nibble (not adjacent pairs). Products and sums are evaluated in the reference's order
(e.g. Q4_K: (d * sc) * q - dmin * m, each step rounded to float32) so the results match bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kernels.base import IntWeight
from kernels.codecs.word_ops import for_each_block, serial_ops
from kernels.errors import LayoutError, UnsupportedError


@dataclass(frozen=True)
class GgmlType:
    """One ggml tensor type: `block_size` elements stored in `type_size` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int
    decoded: bool  # dequantize_gguf handles it


def _table(*rows: tuple[int, str, int, int, bool]) -> dict[int, GgmlType]:
    return {row[0]: GgmlType(*row) for row in rows}


# Checked against gguf.GGML_QUANT_SIZES / gguf.GGMLQuantizationType by tests/kernels/test_gguf_codecs.py.
GGML_TYPES: dict[int, GgmlType] = _table(
    (0, "F32", 1, 4, True),
    (1, "F16", 1, 2, True),
    (2, "Q4_0", 32, 18, True),
    (3, "Q4_1", 32, 20, True),
    (6, "Q5_0", 32, 22, True),
    (7, "Q5_1", 32, 24, True),
    (8, "Q8_0", 32, 34, True),
    (9, "Q8_1", 32, 40, False),
    (10, "Q2_K", 256, 84, False),
    (11, "Q3_K", 256, 110, False),
    (12, "Q4_K", 256, 144, True),
    (13, "Q5_K", 256, 176, True),
    (14, "Q6_K", 256, 210, True),
    (15, "Q8_K", 256, 292, False),
    (16, "IQ2_XXS", 256, 66, False),
    (17, "IQ2_XS", 256, 74, False),
    (18, "IQ3_XXS", 256, 98, False),
    (19, "IQ1_S", 256, 50, False),
    (20, "IQ4_NL", 32, 18, False),
    (21, "IQ3_S", 256, 110, False),
    (22, "IQ2_S", 256, 82, False),
    (23, "IQ4_XS", 256, 136, False),
    (24, "I8", 1, 1, False),
    (25, "I16", 1, 2, False),
    (26, "I32", 1, 4, False),
    (27, "I64", 1, 8, False),
    (28, "F64", 1, 8, False),
    (29, "IQ1_M", 256, 56, False),
    (30, "BF16", 1, 2, True),
    (34, "TQ1_0", 256, 54, False),
    (35, "TQ2_0", 256, 66, False),
    (39, "MXFP4", 32, 17, False),
    (40, "NVFP4", 64, 36, False),
    (41, "Q1_0", 128, 18, False),
)

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
DECODED_TYPES: tuple[int, ...] = tuple(t.id for t in GGML_TYPES.values() if t.decoded)
# Held exactly as an IntWeight (decode_gguf_int): symmetric Q4_0 / Q8_0, and Q4_1 / Q4_K with a
# float minimum per 32 (Q4_K's d * sc and dmin * m are exact in fp32: 11 x 6 significant bits).
INT_TYPES: tuple[int, ...] = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
FLOAT_MIN_TYPES: tuple[int, ...] = (Q4_1, Q5_1, Q4_K, Q5_K)
INT_BITS: dict[int, int] = {Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5, Q8_0: 8, Q4_K: 4, Q5_K: 5, Q6_K: 6}
Q6_K_GROUP_SIZE = 16  # Q6_K scales every 16 values; the others every 32
ENCODED_TYPES: tuple[int, ...] = (Q4_0, Q8_0)  # encode_gguf_int
INT_GROUP_SIZE = 32


def ggml_type_name(ggml_type: int) -> str:
    """The ggml name of a type id ("Q4_K" for 12); "unknown type 99" for an id Kiln's table lacks."""
    t = GGML_TYPES.get(int(ggml_type))
    return t.name if t is not None else f"unknown type {int(ggml_type)}"


class UnsupportedGgufType(UnsupportedError):
    """A GGUF tensor of a ggml type Kiln cannot decode (for this purpose)."""

    def __init__(self, name: str, ggml_type: int, supported: Iterable[int], purpose: str = "decode") -> None:
        self.name = name
        self.ggml_type = int(ggml_type)
        self.supported = tuple(supported)
        names = ", ".join(ggml_type_name(t) for t in self.supported)
        if self.ggml_type in GGML_TYPES:
            kind = f"{ggml_type_name(ggml_type)} (id {self.ggml_type}), which Kiln cannot {purpose}"
        else:
            kind = f"id {self.ggml_type}, unknown to Kiln"
        super().__init__(f"GGUF tensor {name!r} has type {kind}; supported types: {names}")


def gguf_row_bytes(ggml_type: int, k: int, name: str) -> int:
    """Bytes of one K-element row of `ggml_type`; a LayoutError if K is not whole blocks."""
    t = _known(ggml_type, name)
    if k <= 0 or k % t.block_size:
        raise LayoutError(
            f"GGUF tensor {name!r}: row length K={k} is not a positive multiple of the {t.name} block "
            f"size {t.block_size}"
        )
    return k // t.block_size * t.type_size


def dequantize_gguf(
    raw: torch.Tensor, ggml_type: int, k: int, name: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 (..., K / block_size * type_size) tensor data -> (..., K) float32.

    Equals `gguf.quants.dequantize` bit for bit (float32 results; NaN payloads aside). Row blocks run
    on threads (kernels/codecs/word_ops.py `for_each_block`). Another `dtype`: each float32 value
    rounded once to it, block by block (no full-size float32 temporary).
    """
    if int(ggml_type) not in DECODED_TYPES:
        raise UnsupportedGgufType(name, ggml_type, DECODED_TYPES)
    t = GGML_TYPES[int(ggml_type)]
    rows2d = _rows(raw, ggml_type, k, name)  # (R, row_bytes) uint8
    decode = _DECODERS[t.id]
    out = torch.empty(rows2d.shape[0], k, dtype=dtype)

    def block(blk: slice) -> None:
        src = rows2d[blk]
        if t.block_size == 1:
            out[blk] = decode(src)
        else:
            blocks = src.reshape(-1, t.type_size)  # (R * K / bs, type_size)
            out[blk] = decode(blocks).view(src.shape[0], k)

    with serial_ops():  # blocks sized by their float32 output: the temporaries stay cache-sized
        for_each_block(rows2d.shape[0], k * 4, block)
    return out.view(*raw.shape[:-1], k)


def decode_gguf_int(raw: torch.Tensor, ggml_type: int, k: int, name: str) -> IntWeight:
    """A quantized GGUF weight (uint8 (N, K / block * type_size)) -> `IntWeight` with its codes as
    stored, group 32 (Q6_K: 16), unsigned codes with the type's midpoint as the symmetric zero.

    Q4_0 / Q5_0 / Q8_0 / Q6_K: symmetric (x = (q - 2**(bits-1)) * s); Q8_0 codes are qs + 128. Q4_1 /
    Q5_1: fp16 scales d and mins m (x = q * d + m). Q4_K / Q5_K: per 32, fp32 scales d * sc and mins
    -(dmin * m); Q6_K: per 16, fp32 scales d * sc (products of ≤ 11 and 8 significant bits: exact).
    `IntWeight.dequantize()` equals `dequantize_gguf` exactly.
    """
    if int(ggml_type) not in INT_TYPES:
        raise UnsupportedGgufType(name, ggml_type, INT_TYPES, "hold as integer codes")
    if raw.dim() != 2:
        raise LayoutError(f"GGUF tensor {name!r}: an integer weight must be 2-D, got {tuple(raw.shape)}")
    t = GGML_TYPES[int(ggml_type)]
    rows2d = _rows(raw, ggml_type, k, name)
    group = Q6_K_GROUP_SIZE if t.id == Q6_K else INT_GROUP_SIZE
    n, g = rows2d.shape[0], k // group
    decode = _INT_DECODERS[t.id]
    _, first_scales, first_mins = decode(rows2d[:1].reshape(-1, t.type_size))  # the fields' dtypes
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, g, dtype=first_scales.dtype)  # (N, G) here, (G, N) in the IntWeight
    mins = None if first_mins is None else torch.empty(n, g, dtype=first_mins.dtype)

    def block(blk: slice) -> None:
        b_codes, b_scales, b_mins = decode(rows2d[blk].reshape(-1, t.type_size))  # (M, block), (M, groups)
        rows = b_codes.numel() // k
        codes[blk] = b_codes.reshape(rows, k)
        scales[blk] = b_scales.reshape(rows, g)
        if mins is not None and b_mins is not None:
            mins[blk] = b_mins.reshape(rows, g)

    with serial_ops():  # blocks sized by their output (a byte per code, float scales)
        for_each_block(n, k * 2, block)
    return IntWeight(
        codes=codes,
        scales=scales.T.contiguous(),
        bits=INT_BITS[t.id],
        group_size=group,
        mins=None if mins is None else mins.T.contiguous(),
    )


def _raw_f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(M, type_size) uint8 -> (M, 1) fp16 of the field at `offset`, as stored."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16)


IntBlocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # codes, scales, mins


def _q4_0_int(b: torch.Tensor) -> IntBlocks:
    return _split_nibbles(b[:, 2:18]), _raw_f16(b, 0), None


def _q4_1_int(b: torch.Tensor) -> IntBlocks:
    return _split_nibbles(b[:, 4:20]), _raw_f16(b, 0), _raw_f16(b, 2)


def _q5_0_int(b: torch.Tensor) -> IntBlocks:
    return _split_nibbles(b[:, 6:22]) | (_q5_high(b[:, 2:6]) << 4), _raw_f16(b, 0), None


def _q5_1_int(b: torch.Tensor) -> IntBlocks:
    return _split_nibbles(b[:, 8:24]) | (_q5_high(b[:, 4:8]) << 4), _raw_f16(b, 0), _raw_f16(b, 2)


def _q8_0_int(b: torch.Tensor) -> IntBlocks:
    return b[:, 2:34] ^ 0x80, _raw_f16(b, 0), None  # int8 q + 128 as uint8


def _q4_k_int(b: torch.Tensor) -> IntBlocks:
    sc, mn = _k_scale_min(b[:, 4:16])  # (M, 8) each
    codes = _k_low_nibbles(b[:, 16:144]).reshape(-1, 256)
    return codes, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q5_k_int(b: torch.Tensor) -> IntBlocks:
    sc, mn = _k_scale_min(b[:, 4:16])
    shifts = torch.arange(8, dtype=torch.uint8)[:, None]
    hi = (b[:, None, 16:48] >> shifts) & 1  # (M, 8, 32): element 32 s + l is bit s of qh[l]
    codes = (_k_low_nibbles(b[:, 48:176]) | (hi << 4)).reshape(-1, 256)
    return codes, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q6_k_int(b: torch.Tensor) -> IntBlocks:
    ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32)  # (M, half, 1, ql byte run, 32)
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # (M, half, 32-run c, l)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    hi = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3  # (M, half, c, l)
    codes = (lo | (hi << 4)).reshape(-1, 256)  # q + 32
    return codes, _f16(b, 208) * b[:, 192:208].view(torch.int8).float(), None


_INT_DECODERS: dict[int, Callable[[torch.Tensor], IntBlocks]] = {
    Q4_0: _q4_0_int,
    Q4_1: _q4_1_int,
    Q5_0: _q5_0_int,
    Q5_1: _q5_1_int,
    Q8_0: _q8_0_int,
    Q4_K: _q4_k_int,
    Q5_K: _q5_k_int,
    Q6_K: _q6_k_int,
}


def encode_gguf_int(w: IntWeight, ggml_type: int) -> torch.Tensor:
    """Symmetric group-32 `IntWeight` with fp16-exact scales -> Q4_0 / Q8_0 uint8 (N, K / 32 * type_size)."""
    name = f"<{ggml_type_name(ggml_type)} encode>"
    if int(ggml_type) not in ENCODED_TYPES:
        raise UnsupportedGgufType(name, ggml_type, ENCODED_TYPES, "encode from integer codes")
    t = GGML_TYPES[int(ggml_type)]
    bits = 4 if t.id == Q4_0 else 8
    n, k = w.codes.shape
    if w.bits != bits or w.group_size != INT_GROUP_SIZE or not w.symmetric or w.g_idx is not None:
        raise LayoutError(
            f"{t.name} holds symmetric {bits}-bit codes in groups of {INT_GROUP_SIZE} without g_idx; got "
            f"{w.bits}-bit, group_size {w.group_size}, zeros {'set' if w.zeros is not None else 'None'}, "
            f"g_idx {'set' if w.g_idx is not None else 'None'}"
        )
    g = k // INT_GROUP_SIZE
    if k % INT_GROUP_SIZE or tuple(w.scales.shape) != (g, n):
        raise LayoutError(
            f"{t.name}: K={k} must be whole blocks of 32 with scales ({g}, {n}), got {tuple(w.scales.shape)}"
        )
    d = w.scales.to(torch.float16)
    if not torch.equal(d.to(w.scales.dtype), w.scales):
        raise LayoutError(f"{t.name} stores scales as fp16; these scales are not exact in fp16")
    if bits == 4 and bool((w.codes > 15).any()):
        raise LayoutError("Q4_0 codes must lie in [0, 16)")
    codes = w.codes.to(torch.uint8).reshape(n, g, INT_GROUP_SIZE)
    payload = codes[..., :16] | (codes[..., 16:] << 4) if bits == 4 else codes ^ 0x80
    d_bytes = d.T.contiguous().view(torch.uint8).view(n, g, 2)  # little-endian fp16
    return torch.cat([d_bytes, payload], dim=-1).reshape(n, g * t.type_size)


def unpermute_qk_rows(raw: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation ("llama" architecture): gguf_row[2j + i] = hf_row[i * hd/2 + j].

    Rows are dim 0 (weights, raw quantized bytes or biases alike); hd = rows / n_head. For k_proj,
    pass the kv head count.
    """
    return _permute_rows(raw, n_head, inverse=True)


def permute_qk_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter permutation (the inverse of `unpermute_qk_rows`), for synthetic GGUF writers."""
    return _permute_rows(rows, n_head, inverse=False)


def _permute_rows(t: torch.Tensor, n_head: int, *, inverse: bool) -> torch.Tensor:
    rows = t.shape[0] if t.dim() else 0
    if t.dim() == 0 or n_head <= 0 or rows % (2 * n_head):
        raise LayoutError(f"q/k row permutation: {rows} rows do not split into {n_head} heads of even size")
    half = rows // n_head // 2
    rest = t.shape[1:]
    if inverse:  # gguf (head, j, i) -> hf (head, i, j)
        return t.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(t.shape).contiguous()
    return t.reshape(n_head, 2, half, *rest).transpose(1, 2).reshape(t.shape).contiguous()


def _known(ggml_type: int, name: str) -> GgmlType:
    t = GGML_TYPES.get(int(ggml_type))
    if t is None:
        raise UnsupportedGgufType(name, ggml_type, DECODED_TYPES)
    return t


def _rows(raw: torch.Tensor, ggml_type: int, k: int, name: str) -> torch.Tensor:
    """raw as a contiguous (R, row_bytes) uint8 tensor, its width checked against K."""
    want = gguf_row_bytes(ggml_type, k, name)
    if raw.dtype != torch.uint8 or raw.dim() == 0:
        raise LayoutError(
            f"GGUF tensor {name!r}: data must be a uint8 tensor, got {raw.dtype} {tuple(raw.shape)}"
        )
    if raw.shape[-1] != want:
        t = GGML_TYPES[int(ggml_type)]
        raise LayoutError(
            f"GGUF tensor {name!r} ({t.name}, K={k}) needs {want} bytes per row ({k // t.block_size} blocks "
            f"of {t.type_size}), got {raw.shape[-1]}"
        )
    rows = raw.contiguous().view(-1, want)
    # dtype views below need a storage offset aligned to the widest field (4 bytes)
    return rows.clone() if rows.storage_offset() % 4 else rows


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(M, type_size) uint8 -> (M, 1) float32 of the fp16 field at `offset`."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _split_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) uint8 -> (..., 32) uint8: low nibbles, then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """(M, 4) uint8, a little-endian u32 -> (M, 32) uint8 of its bits, bit i at column i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _split_nibbles(b[:, 2:18]).to(torch.int16) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _split_nibbles(b[:, 4:20]).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_split_nibbles(b[:, 6:22]) | (_q5_high(b[:, 2:6]) << 4)).to(torch.int16) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_split_nibbles(b[:, 8:24]) | (_q5_high(b[:, 4:8]) << 4)).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].view(torch.int8).float() * _f16(b, 0)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, 12) uint8 packed 6-bit scales and mins -> two (M, 8) float32 (llama.cpp get_scale_min_k4)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(M, 128) uint8 -> (M, 8, 32): chunk c of 32 bytes gives sub-blocks 2c (low) and 2c + 1 (high)."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _k_low_nibbles(b[:, 16:144]).float()
    return ((_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _k_scale_min(b[:, 4:16])
    shifts = torch.arange(8, dtype=torch.uint8)[:, None]
    hi = (b[:, None, 16:48] >> shifts) & 1  # (M, 8, 32): element 32 s + l is bit s of qh[l]
    q = (_k_low_nibbles(b[:, 48:176]) | (hi << 4)).float()
    return ((_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32)  # (M, half, 1, ql byte run, 32)
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # (M, half, 32-run c, l)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    hi = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3  # (M, half, c, l)
    q = ((lo | (hi << 4)).to(torch.int16) - 32).float().reshape(-1, 16, 16)
    scale = _f16(b, 208) * b[:, 192:208].view(torch.int8).float()  # (M, 16)
    return (scale[:, :, None] * q).reshape(-1, 256)


def _f32(rows: torch.Tensor) -> torch.Tensor:
    return rows.view(torch.float32)


def _f16_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows.view(torch.float16).float()


def _bf16_rows(rows: torch.Tensor) -> torch.Tensor:
    return (rows.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: _f32,
    F16: _f16_rows,
    BF16: _bf16_rows,
    Q4_0: _q4_0,
    Q4_1: _q4_1,
    Q5_0: _q5_0,
    Q5_1: _q5_1,
    Q8_0: _q8_0,
    Q4_K: _q4_k,
    Q5_K: _q5_k,
    Q6_K: _q6_k,
}
