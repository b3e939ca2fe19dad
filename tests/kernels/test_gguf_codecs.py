"""GGUF tensor blocks -> canonical weights (kernels/codecs/gguf.py), bit-exact against llama.cpp's `gguf`."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from kernels.base import IntWeight
from kernels.codecs import word_ops
from kernels.codecs.gguf import (
    DECODED_TYPES,
    GGML_TYPES,
    INT_TYPES,
    UnsupportedGgufType,
    decode_gguf_int,
    dequantize_gguf,
    encode_gguf_int,
    ggml_type_name,
    permute_qk_rows,
    unpermute_qk_rows,
)
from kernels.errors import LayoutError, UnsupportedError

T = gguf.GGMLQuantizationType
QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
FP16_FIELDS = {  # byte offsets of d / m / dmin in each block
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def _raw(rng: np.random.Generator, qtype: T, n: int, n_blocks: int) -> np.ndarray:
    """(n, n_blocks * type_size) uint8: random bytes with finite random fp16 fields (no NaN / inf)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    k = n_blocks * block_size
    if qtype == T.F32:
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), T.BF16)
    raw = rng.integers(0, 256, (n * n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        field = rng.standard_normal((n * n_blocks, 1)) * np.exp2(rng.integers(-12, 4, (n * n_blocks, 1)))
        raw[:, off : off + 2] = field.astype(np.float16).view(np.uint8)
    return raw.reshape(n, n_blocks * type_size)


def _k(qtype: T, raw: np.ndarray) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return raw.shape[-1] // type_size * block_size


def _reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype)))


def test_type_table_matches_gguf() -> None:
    known = {int(q) for q in T}
    for tid, t in GGML_TYPES.items():
        if tid in known:
            assert T(tid).name == t.name
            assert gguf.GGML_QUANT_SIZES[T(tid)] == (t.block_size, t.type_size), t.name
    assert {ggml_type_name(t) for t in DECODED_TYPES} == {q.name for q in QUANT_TYPES + FLOAT_TYPES}
    assert set(DECODED_TYPES) <= known
    assert ggml_type_name(12) == "Q4_K" and ggml_type_name(99) == "unknown type 99"


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_dequantize_matches_gguf(qtype: T, n: int, n_blocks: int) -> None:
    raw = _raw(np.random.default_rng([int(qtype), n, n_blocks]), qtype, n, n_blocks)
    out = dequantize_gguf(torch.from_numpy(raw), int(qtype), _k(qtype, raw), "blk.0.attn_q.weight")
    assert out.dtype == torch.float32
    assert torch.equal(out, _reference(raw, qtype))


def _f16(block: np.ndarray, off: int) -> float:
    return float(block[off : off + 2].view(np.float16)[0])


def _f32(x: float) -> float:
    return float(np.float32(x))


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    q = q.astype(int)
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _formula_block(qtype: T, b: np.ndarray) -> list[float]:
    """One block decoded element by element from the layout table in kernels/codecs/gguf.py."""
    out = []
    bi = b.astype(int)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        qs_at = {T.Q4_0: 2, T.Q4_1: 4, T.Q5_0: 6, T.Q5_1: 8}[qtype]
        for i in range(32):
            q = bi[qs_at + i] & 0xF if i < 16 else bi[qs_at + i - 16] >> 4
            if qtype in (T.Q5_0, T.Q5_1):
                qh_at = 2 if qtype == T.Q5_0 else 4
                qh = int.from_bytes(bytes(b[qh_at : qh_at + 4]), "little")
                q |= ((qh >> i) & 1) << 4
            d = _f16(b, 0)
            if qtype == T.Q4_0:
                out.append(_f32(d * (q - 8)))
            elif qtype == T.Q5_0:
                out.append(_f32(d * (q - 16)))
            else:
                out.append(_f32(_f32(d * q) + _f16(b, 2)))
    elif qtype == T.Q8_0:
        out = [_f32(_f16(b, 0) * v) for v in b[2:34].view(np.int8).tolist()]
    elif qtype in (T.Q4_K, T.Q5_K):
        qs_at = 16 if qtype == T.Q4_K else 48
        for e in range(256):
            c, r = divmod(e, 64)
            byte = bi[qs_at + c * 32 + r % 32]
            q = byte & 0xF if r < 32 else byte >> 4
            if qtype == T.Q5_K:
                q |= ((bi[16 + e % 32] >> (e // 32)) & 1) << 4
            sc, m = _scale_min_k4(e // 32, b[4:16])
            out.append(_f32(_f32(_f32(_f16(b, 0) * sc) * q) - _f32(_f16(b, 2) * m)))
    elif qtype == T.Q6_K:
        vals = [0.0] * 256
        scales = b[192:208].view(np.int8).tolist()
        for h in range(2):
            for col in range(32):
                ql0, ql1, qh = bi[h * 64 + col], bi[h * 64 + 32 + col], bi[128 + h * 32 + col]
                lows = [ql0 & 0xF, ql1 & 0xF, ql0 >> 4, ql1 >> 4]
                for c in range(4):
                    e = h * 128 + c * 32 + col
                    q = (lows[c] | (((qh >> (2 * c)) & 3) << 4)) - 32
                    vals[e] = _f32(_f32(_f16(b, 208) * scales[e // 16]) * q)
        out = vals
    return out


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_layout_table(qtype: T) -> None:
    raw = _raw(np.random.default_rng(int(qtype)), qtype, 1, 2)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    want = [x for blk in raw.reshape(-1, type_size) for x in _formula_block(qtype, blk)]
    got = dequantize_gguf(torch.from_numpy(raw), int(qtype), _k(qtype, raw), "w")
    assert got.reshape(-1).tolist() == want


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16], ids=lambda q: q.name)
def test_decodes_gguf_quantize_output(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((6, 96)) * np.exp2(rng.integers(-6, 3, (6, 1)))).astype(np.float32)
    w[0, :32] = 0.0  # a zero block (d = 0)
    raw = quants.quantize(w, qtype)
    out = dequantize_gguf(torch.from_numpy(raw), int(qtype), 96, "w")
    assert torch.equal(out, _reference(raw, qtype))
    assert float((out - torch.from_numpy(w)).abs().max()) < float(np.abs(w).max()) / 4


def test_one_dimensional_and_large_tensors() -> None:
    rng = np.random.default_rng(1)
    norm = rng.standard_normal(64).astype(np.float32)
    out = dequantize_gguf(torch.from_numpy(norm.view(np.uint8)), int(T.F32), 64, "blk.0.attn_norm.weight")
    assert out.shape == (64,) and torch.equal(out, torch.from_numpy(norm))
    bias = _raw(rng, T.Q8_0, 1, 2)[0]
    assert torch.equal(
        dequantize_gguf(torch.from_numpy(bias), int(T.Q8_0), 64, "b"), _reference(bias, T.Q8_0)
    )
    # several row blocks of ~1 MiB, decoded on threads
    big = _raw(rng, T.Q4_K, 256, 64)
    assert torch.equal(
        dequantize_gguf(torch.from_numpy(big), int(T.Q4_K), 64 * 256, "big"), _reference(big, T.Q4_K)
    )


def test_unaligned_storage_offset() -> None:
    raw = _raw(np.random.default_rng(2), T.F32, 2, 8)
    buf = torch.zeros(1 + raw.size, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw.reshape(-1))
    view = buf[1:].view(2, -1)
    assert view.storage_offset() == 1
    assert torch.equal(dequantize_gguf(view, int(T.F32), 8, "w"), _reference(raw, T.F32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_int_decode_is_exact_and_round_trips(qtype: T, n_blocks: int) -> None:
    raw = _raw(np.random.default_rng([int(qtype), n_blocks, 7]), qtype, 5, n_blocks)
    raw_t = torch.from_numpy(raw)
    k = 32 * n_blocks
    w = decode_gguf_int(raw_t, int(qtype), k, "blk.0.ffn_up.weight")
    assert w.bits == (4 if qtype == T.Q4_0 else 8) and w.group_size == 32
    assert w.zeros is None and w.g_idx is None
    assert w.codes.dtype == torch.uint8 and w.codes.shape == (5, k)
    assert w.scales.dtype == torch.float16 and w.scales.shape == (n_blocks, 5)
    assert int(w.codes.max()) < (1 << w.bits)
    assert torch.equal(w.dequantize(), dequantize_gguf(raw_t, int(qtype), k, "w"))
    assert torch.equal(encode_gguf_int(w, int(qtype)), raw_t)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_decoding_in_row_blocks_equals_one_pass(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both decoders write their output a row block at a time (on threads): a tensor cut into many
    blocks decodes to the same values as in one pass, and a bf16 dequantization is the float32 one
    rounded once (no full-size float32 temporary)."""
    raw = torch.from_numpy(_raw(np.random.default_rng([int(qtype), 5]), qtype, 37, 2))
    k = 2 * GGML_TYPES[int(qtype)].block_size
    whole, whole_int = dequantize_gguf(raw, int(qtype), k, "w"), decode_gguf_int(raw, int(qtype), k, "w")
    monkeypatch.setattr(word_ops, "BLOCK_BYTES", 3 * raw.shape[1])  # 3 rows a block: 13 blocks
    assert torch.equal(dequantize_gguf(raw, int(qtype), k, "w"), whole)
    assert torch.equal(dequantize_gguf(raw, int(qtype), k, "w", torch.bfloat16), whole.bfloat16())
    blocked = decode_gguf_int(raw, int(qtype), k, "w")
    for field in ("codes", "scales", "mins"):
        a, b = getattr(blocked, field), getattr(whole_int, field)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), field
    assert torch.equal(blocked.dequantize(), whole)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K], ids=lambda q: q.name)
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_float_minimum_types_decode_exactly(qtype: T, n_blocks: int) -> None:
    """Q4_1 / Q5_1 (fp16 d, m per 32) and Q4_K / Q5_K (fp32 d*sc, -(dmin*m) per 32): codes * scale +
    min in fp32 is gguf's own dequantization, bit for bit."""
    raw = torch.from_numpy(_raw(np.random.default_rng([int(qtype), n_blocks, 11]), qtype, 4, n_blocks))
    block = GGML_TYPES[int(qtype)].block_size
    k = block * n_blocks
    bits = 4 if qtype in (T.Q4_1, T.Q4_K) else 5
    w = decode_gguf_int(raw, int(qtype), k, "blk.0.attn_q.weight")
    assert w.bits == bits and w.group_size == 32 and w.zeros is None and w.mins is not None
    assert not w.symmetric and w.codes.shape == (4, k) and int(w.codes.max()) < (1 << bits)
    assert w.scales.shape == w.mins.shape == (k // 32, 4)
    assert w.scales.dtype == (torch.float16 if qtype in (T.Q4_1, T.Q5_1) else torch.float32)
    assert torch.equal(w.dequantize(), dequantize_gguf(raw, int(qtype), k, "w"))
    assert torch.equal(w.dequantize(), _reference(raw.numpy(), qtype).reshape(4, k))


@pytest.mark.parametrize(("qtype", "bits", "group"), [(T.Q5_0, 5, 32), (T.Q6_K, 6, 16)], ids=["Q5_0", "Q6_K"])
def test_symmetric_5_and_6_bit_types_decode_exactly(qtype: T, bits: int, group: int) -> None:
    """Q5_0 (x = d·(q - 16)) and Q6_K (x = (d·sc)·(q - 32), a scale per 16): the type's midpoint is the
    symmetric zero of `IntWeight`."""
    raw = torch.from_numpy(_raw(np.random.default_rng([int(qtype), 5]), qtype, 3, 2))
    k = GGML_TYPES[int(qtype)].block_size * 2
    w = decode_gguf_int(raw, int(qtype), k, "blk.1.ffn_down.weight")
    assert (w.bits, w.group_size, w.symmetric) == (bits, group, True) and w.scales.shape == (k // group, 3)
    assert int(w.codes.max()) < (1 << bits)
    assert torch.equal(w.dequantize(), _reference(raw.numpy(), qtype).reshape(3, k))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda q: q.name)
def test_int_encode_then_decode(qtype: T) -> None:
    gen = torch.Generator().manual_seed(int(qtype))
    bits = 4 if qtype == T.Q4_0 else 8
    w = IntWeight(
        codes=torch.randint(0, 1 << bits, (4, 64), generator=gen, dtype=torch.int64).to(torch.uint8),
        scales=(torch.rand(2, 4, generator=gen) - 0.5).half(),
        bits=bits,
        group_size=32,
    )
    raw = encode_gguf_int(w, int(qtype))
    assert raw.shape == (4, 2 * GGML_TYPES[int(qtype)].type_size)
    back = decode_gguf_int(raw, int(qtype), 64, "w")
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scales, w.scales)
    assert torch.equal(dequantize_gguf(raw, int(qtype), 64, "w"), _reference(raw.numpy(), qtype))


def test_int_encode_refuses_what_q4_0_cannot_hold() -> None:
    codes = torch.zeros(2, 32, dtype=torch.uint8)
    scales = torch.ones(1, 2, dtype=torch.float16)
    with pytest.raises(LayoutError, match="symmetric 4-bit"):
        encode_gguf_int(IntWeight(codes, scales, 4, 32, zeros=torch.zeros(1, 2, dtype=torch.uint8)), 2)
    with pytest.raises(LayoutError, match="groups of 32"):
        encode_gguf_int(IntWeight(codes, torch.ones(2, 2, dtype=torch.float16), 4, 16), 2)
    with pytest.raises(LayoutError, match="not exact in fp16"):
        encode_gguf_int(IntWeight(codes, torch.full((1, 2), 1e-9), 4, 32), 2)
    with pytest.raises(UnsupportedGgufType, match="Q4_K"):
        encode_gguf_int(IntWeight(codes, scales, 4, 32), 12)


def _ref_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter, from its formula: gguf_row[h*hd + 2j + i] = hf_row[h*hd + i*hd/2 + j]."""
    hd = w.shape[0] // n_head
    out = torch.empty_like(w)
    for h in range(n_head):
        for j in range(hd // 2):
            for i in range(2):
                out[h * hd + 2 * j + i] = w[h * hd + i * hd // 2 + j]
    return out


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_unpermute_qk_rows(n_head: int) -> None:
    gen = torch.Generator().manual_seed(n_head)
    w = torch.randn(n_head * 8, 64, generator=gen)
    permuted = _ref_permute(w, n_head)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk_rows(permuted, n_head), w)
    assert torch.equal(permute_qk_rows(w, n_head), permuted)
    bias = torch.randn(n_head * 8, generator=gen)
    assert torch.equal(unpermute_qk_rows(_ref_permute(bias, n_head), n_head), bias)

    raw = torch.from_numpy(_raw(np.random.default_rng(n_head), T.Q4_0, n_head * 8, 2))
    raw_gguf = _ref_permute(raw, n_head)
    assert torch.equal(unpermute_qk_rows(raw_gguf, n_head), raw)
    assert torch.equal(
        dequantize_gguf(unpermute_qk_rows(raw_gguf, n_head), 2, 64, "q"),
        unpermute_qk_rows(dequantize_gguf(raw_gguf, 2, 64, "q"), n_head),
    )


def test_unpermute_refuses_uneven_heads() -> None:
    with pytest.raises(LayoutError, match="heads"):
        unpermute_qk_rows(torch.zeros(12, 4), 8)
    with pytest.raises(LayoutError, match="heads"):
        unpermute_qk_rows(torch.zeros(6, 4), 2)


def test_malformed_inputs() -> None:
    raw = torch.from_numpy(_raw(np.random.default_rng(3), T.Q4_0, 2, 2))
    with pytest.raises(LayoutError, match=r"'blk.3.attn_v.weight' \(Q4_0, K=96\) needs 54 bytes per row"):
        dequantize_gguf(raw, 2, 96, "blk.3.attn_v.weight")
    with pytest.raises(LayoutError, match="not a positive multiple of the Q4_0 block size 32"):
        dequantize_gguf(raw, 2, 48, "w")
    with pytest.raises(LayoutError, match="uint8"):
        dequantize_gguf(raw.view(torch.int8), 2, 64, "w")
    with pytest.raises(UnsupportedGgufType) as unknown:
        dequantize_gguf(raw, 99, 64, "blk.0.ffn_down.weight")
    msg = str(unknown.value)
    assert "'blk.0.ffn_down.weight' has type id 99, unknown to Kiln" in msg
    assert "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16" in msg
    with pytest.raises(UnsupportedGgufType, match=r"'token_embd.weight' has type Q2_K \(id 10\)"):
        dequantize_gguf(raw, 10, 256, "token_embd.weight")
    with pytest.raises(
        UnsupportedError, match="supported types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"
    ):
        decode_gguf_int(raw, 10, 256, "blk.0.ffn_up.weight")
    assert set(INT_TYPES) == {2, 3, 6, 7, 8, 12, 13, 14}
