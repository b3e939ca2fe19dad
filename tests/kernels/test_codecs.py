"""Bit-exact tests of the source-format codecs (GPTQ v1/v2, AWQ-GEMM, compressed-tensors) and bit packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.base import IntWeight
from kernels.codecs import (
    awq_to_standard,
    decode_awq,
    decode_gptq,
    decode_int_quantized,
    decode_pack_quantized,
    encode_awq,
    encode_gptq,
    encode_pack_quantized,
    pack_cols,
    pack_rows,
    qzeros_look_v2_symmetric,
    unpack_cols,
    unpack_rows,
)
from kernels.codecs.gptq import v1_to_v2_qzeros, v2_to_v1_qzeros
from kernels.errors import LayoutError
from tests.kernels.reference_layouts import ref_awq_pack, ref_pack_cols, ref_pack_rows, ref_unpack_cols

FAST = settings(max_examples=30, deadline=None)

# Per-field +1 on packed words (GPTQModel's v1 -> v2), valid when no field overflows.
V1_TO_V2_WORD = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def _codes(gen: torch.Generator, shape: tuple[int, ...], bits: int, lo: int = 0) -> torch.Tensor:
    return torch.randint(lo, 1 << bits, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


def _int_weight(
    seed: int, n: int, k: int, bits: int, group_size: int, sym: bool, act_order: bool, zero_lo: int = 0
) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    g = 1 if group_size == -1 else k // group_size
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    return IntWeight(
        codes=_codes(gen, (n, k), bits),
        scales=(torch.rand(g, n, generator=gen) + 0.01).half(),
        bits=bits,
        group_size=group_size,
        zeros=None if sym else _codes(gen, (g, n), bits, lo=zero_lo),
        g_idx=g_idx,
    )


def _same_weight(a: IntWeight, b: IntWeight) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales, b.scales)
    assert a.bits == b.bits and a.group_size == b.group_size
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert torch.equal(a.zeros, b.zeros)
    assert (a.g_idx is None) == (b.g_idx is None)
    if a.g_idx is not None:
        assert torch.equal(a.g_idx, b.g_idx)
    assert torch.equal(a.dequantize(), b.dequantize())


# ---------------------------------------------------------------------------------------------
# bitpack
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    rows=st.integers(1, 70),
    cols=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_rows_and_cols_match_reference_and_round_trip(
    bits: int, rows: int, cols: int, seed: int
) -> None:
    q = _codes(torch.Generator().manual_seed(seed), (rows, cols), bits)
    packed = pack_rows(q, bits)
    assert packed.dtype == torch.int32
    assert torch.equal(packed, ref_pack_rows(q, bits))
    assert torch.equal(unpack_rows(packed, bits, rows), q)
    packed_t = pack_cols(q.T, bits)
    assert torch.equal(packed_t, ref_pack_cols(q.T, bits))
    assert torch.equal(unpack_cols(packed_t, bits, rows), q.T)
    assert torch.equal(ref_unpack_cols(packed_t, bits, rows), q.T)


@pytest.mark.parametrize(("bits", "word"), [(2, -1), (3, -1), (4, -1), (8, -1)])
def test_all_ones_fields_wrap_to_negative_int32(bits: int, word: int) -> None:
    q = torch.full((32, 1), (1 << bits) - 1)
    assert (pack_rows(q, bits) == word).all()


def test_top_field_sets_the_sign_bit() -> None:
    q = torch.zeros(8, 1, dtype=torch.int64)
    q[7] = 8  # 0x80000000
    assert pack_rows(q, 4).item() == -(2**31)
    assert torch.equal(unpack_rows(pack_rows(q, 4), 4, 8), q.to(torch.uint8))


def test_three_bit_scheme_matches_autogptq_bit_positions() -> None:
    q = torch.zeros(32, 1, dtype=torch.int64)
    q[10] = 0b101  # low 2 bits -> word0 bits 30-31, bit 2 -> word1 bit 0
    q[21] = 0b110  # bit 0 -> word1 bit 31, bits 1-2 -> word2 bits 0-1
    words = [w & 0xFFFFFFFF for w in pack_rows(q, 3)[:, 0].tolist()]
    assert words == [0b01 << 30, 1, 0b11]


def test_pack_rejects_out_of_range_codes() -> None:
    with pytest.raises(LayoutError, match="codes must lie"):
        pack_rows(torch.tensor([[16]] * 8), 4)
    with pytest.raises(LayoutError, match="codes must lie"):
        pack_cols(torch.tensor([[-1] * 8]), 4)
    with pytest.raises(LayoutError, match="not supported"):
        pack_rows(torch.zeros(8, 1, dtype=torch.int64), 5)


# ---------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    group_size=st.sampled_from([-1, 32, 64]),
    sym=st.booleans(),
    v2=st.booleans(),
    act_order=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gptq_round_trip_and_reference_packing(
    bits: int, group_size: int, sym: bool, v2: bool, act_order: bool, seed: int
) -> None:
    n, k = 64, 128
    act_order = act_order and group_size != -1
    w = _int_weight(seed, n, k, bits, group_size, sym, act_order, zero_lo=0 if v2 else 1)
    t = encode_gptq(w, v2=v2)
    assert torch.equal(t["qweight"], ref_pack_rows(w.codes.T, bits))
    zeros = torch.full_like(w.scales, 1 << (bits - 1), dtype=torch.int64) if sym else w.zeros.long()
    assert torch.equal(t["qzeros"], ref_pack_cols(zeros - (0 if v2 else 1), bits))
    assert torch.equal(t["g_idx"], w.group_index().to(torch.int32))
    back = decode_gptq(
        t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=bits, group_size=group_size, sym=sym, v2=v2
    )
    _same_weight(w, back)


@pytest.mark.parametrize(
    ("bits", "v1_word", "v2_word"), [(4, 0x77777777, 0x88888888), (8, 0x7F7F7F7F, 0x80808080)]
)
def test_gptq_symmetric_qzeros_constants(bits: int, v1_word: int, v2_word: int) -> None:
    w = _int_weight(0, 64, 64, bits, 32, sym=True, act_order=False)
    v1 = encode_gptq(w, v2=False)["qzeros"]
    v2 = encode_gptq(w, v2=True)["qzeros"]
    assert ((v1 & 0xFFFFFFFF) == v1_word).all()
    assert ((v2.long() & 0xFFFFFFFF) == v2_word).all()
    assert qzeros_look_v2_symmetric(v2, bits) and not qzeros_look_v2_symmetric(v1, bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_v1_v2_conversion(bits: int) -> None:
    w = _int_weight(3, 64, 64, bits, 32, sym=False, act_order=False, zero_lo=1)
    w.zeros = w.zeros.clamp(max=(1 << bits) - 2)  # keep the packed-word +1 free of carries
    v1 = encode_gptq(w, v2=False)["qzeros"]
    v2 = encode_gptq(w, v2=True)["qzeros"]
    assert torch.equal(v1_to_v2_qzeros(v1, bits, 64), v2)
    assert torch.equal(v2_to_v1_qzeros(v2, bits, 64), v1)
    if bits in V1_TO_V2_WORD:  # GPTQModel's packed-word arithmetic agrees
        shifted = ((v1.long() & 0xFFFFFFFF) + V1_TO_V2_WORD[bits]) & 0xFFFFFFFF
        assert torch.equal(shifted, v2.long() & 0xFFFFFFFF)


def test_gptq_sym_decode_rejects_asymmetric_zeros() -> None:
    w = _int_weight(1, 64, 64, 4, 32, sym=False, act_order=False, zero_lo=1)
    t = encode_gptq(w, v2=False)
    with pytest.raises(LayoutError, match="sym=true but GPTQ qzeros"):
        decode_gptq(t["qweight"], t["qzeros"], t["scales"], None, bits=4, group_size=32, sym=True, v2=False)


def test_gptq_v2_valued_checkpoint_labelled_v1_is_named() -> None:
    w = _int_weight(2, 64, 64, 4, 32, sym=True, act_order=False)
    t = encode_gptq(w, v2=True)
    assert qzeros_look_v2_symmetric(t["qzeros"], 4)
    with pytest.raises(LayoutError, match="v2 convention"):
        decode_gptq(t["qweight"], t["qzeros"], t["scales"], None, bits=4, group_size=32, sym=True, v2=False)
    back = decode_gptq(t["qweight"], t["qzeros"], t["scales"], None, bits=4, group_size=32, sym=True, v2=True)
    _same_weight(w, back)


def test_gptq_v1_true_zero_of_zero_is_refused() -> None:
    w = _int_weight(4, 64, 64, 4, 32, sym=False, act_order=False, zero_lo=1)
    with pytest.raises(LayoutError, match="gptq_v2"):
        encode_gptq(IntWeight(w.codes, w.scales, 4, 32, zeros=torch.zeros_like(w.zeros)), v2=False)
    t = encode_gptq(w, v2=False)
    broken = t["qzeros"].clone()
    broken[0, 0] = -1  # what AutoGPTQ writes for zero 0: -1 ORed over every field
    with pytest.raises(LayoutError, match="true zero point of 0"):
        decode_gptq(t["qweight"], broken, t["scales"], None, bits=4, group_size=32, sym=False, v2=False)


def test_gptq_shape_errors_name_the_tensor() -> None:
    w = _int_weight(5, 64, 64, 4, 32, sym=True, act_order=False)
    t = encode_gptq(w, v2=False)
    with pytest.raises(LayoutError, match="scale rows"):
        decode_gptq(t["qweight"], t["qzeros"], t["scales"], None, bits=4, group_size=16, sym=True, v2=False)
    with pytest.raises(LayoutError, match="g_idx"):
        decode_gptq(
            t["qweight"],
            t["qzeros"],
            t["scales"],
            torch.zeros(3, dtype=torch.int32),
            bits=4,
            group_size=32,
            sym=True,
            v2=False,
        )


# ---------------------------------------------------------------------------------------------
# AWQ
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    group_size=st.sampled_from([-1, 32, 64]),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_awq_round_trip_and_standard_conversion(group_size: int, bits: int, seed: int) -> None:
    n, k = 64, 128
    w = _int_weight(seed, n, k, bits, group_size, sym=False, act_order=False)
    t = encode_awq(w)
    assert torch.equal(t["qweight"], ref_awq_pack(w.codes.T, bits))
    assert torch.equal(t["qzeros"], ref_awq_pack(w.zeros, bits))
    back = decode_awq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size, bits=bits)
    _same_weight(w, back)

    qweight_std, zero_point = awq_to_standard(t["qweight"], t["qzeros"], bits=bits)
    gptq = encode_gptq(w, v2=True)
    assert torch.equal(qweight_std, gptq["qweight"])  # standard layout, unsigned codes
    assert torch.equal(zero_point, ref_pack_rows(w.zeros.T, bits))  # (N/pf, G)
    assert torch.equal(zero_point, encode_pack_quantized(w)["weight_zero_point"])
    # GPTQ v2 asymmetric qzeros .T has the same field order as the converted AWQ zero point
    assert torch.equal(unpack_cols(gptq["qzeros"], bits, n).T, unpack_rows(zero_point, bits, n))


def test_awq_nibble_order() -> None:
    codes = torch.arange(8, dtype=torch.uint8)[None, :]  # column j holds value j
    word = ref_awq_pack(codes)[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    from kernels.codecs.awq import awq_pack

    assert awq_pack(codes, 4).item() == ref_awq_pack(codes).item()


def test_fast_paths_across_row_blocks_and_hugepage_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # tiny blocks: several blocks plus a shorter last one; every output numpy-backed
    from kernels.codecs import word_ops

    monkeypatch.setattr(word_ops, "BLOCK_BYTES", 700)
    monkeypatch.setattr(word_ops, "_HUGE_MIN_BYTES", 0)
    n, k = 40, 112  # GPTQ: N blocks of 12, 12, 12, 4 rows; AWQ: K / 8 blocks of 4, 4, 4, 2
    w = _int_weight(5, n, k, 4, 16, sym=False, act_order=False)
    gptq = encode_gptq(w, v2=True)
    assert torch.equal(gptq["qweight"], ref_pack_rows(w.codes.T, 4))
    back = decode_gptq(
        gptq["qweight"], gptq["qzeros"], gptq["scales"], None, bits=4, group_size=16, sym=False, v2=True
    )
    assert torch.equal(back.codes, ref_unpack_cols(gptq["qweight"].T, 4, k))
    a = encode_awq(w)
    qweight_std, _ = awq_to_standard(a["qweight"], a["qzeros"], bits=4)
    assert torch.equal(qweight_std, ref_pack_rows(w.codes.T, 4))


# ---------------------------------------------------------------------------------------------
# compressed-tensors
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([-1, 32, 64]),
    sym=st.booleans(),
    act_order=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_quantized_round_trip(bits: int, group_size: int, sym: bool, act_order: bool, seed: int) -> None:
    n, k = 64, 128
    act_order = act_order and group_size != -1
    w = _int_weight(seed, n, k, bits, group_size, sym, act_order)
    t = encode_pack_quantized(w)
    assert torch.equal(t["weight_packed"], ref_pack_cols(w.codes, bits))
    assert t["weight_shape"].tolist() == [n, k] and t["weight_shape"].dtype == torch.int64
    assert ("weight_zero_point" in t) == (not sym)
    back = decode_pack_quantized(
        t["weight_packed"],
        t["weight_scale"],
        t.get("weight_zero_point"),
        t.get("weight_g_idx"),
        bits=bits,
        group_size=group_size,
    )
    _same_weight(w, back)
    if sym:  # CT symmetric weight_packed.T is bit-identical to the GPTQ qweight, scales transposed
        gptq = encode_gptq(w, v2=False)
        assert torch.equal(t["weight_packed"].T, gptq["qweight"])
        assert torch.equal(t["weight_scale"].T, gptq["scales"])


def test_pack_quantized_k_padding() -> None:
    w = _int_weight(7, 64, 100, 4, -1, sym=True, act_order=False)  # K=100: ceil(100/8)=13 words
    t = encode_pack_quantized(w)
    assert t["weight_packed"].shape == (64, 13)
    back = decode_pack_quantized(
        t["weight_packed"], t["weight_scale"], None, None, bits=4, group_size=-1, k=100
    )
    _same_weight(w, back)


def test_pack_quantized_signed_offset() -> None:
    # llm-compressor stores q + 8: signed -8 -> code 0, 7 -> code 15, zero point 0 -> 8.
    signed = torch.tensor([[-8, -1, 0, 7, 3, -3, 1, -7]])
    packed = pack_cols(signed + 8, 4)
    ws = torch.ones(1, 1)
    w = decode_pack_quantized(packed, ws, None, None, bits=4, group_size=-1)
    assert torch.equal(w.dequantize(), signed.float())


def test_int_quantized_decode() -> None:
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(-128, 128, (64, 96), generator=gen, dtype=torch.int64).to(torch.int8)
    scale = torch.rand(64, 1, generator=gen)
    w = decode_int_quantized(q, scale, None, group_size=-1)
    assert w.symmetric and w.bits == 8
    assert torch.equal(w.dequantize(), q.float() * scale)
    zp = torch.randint(-5, 5, (64, 1), generator=gen, dtype=torch.int64).to(torch.int8)
    wz = decode_int_quantized(q, scale, zp, group_size=-1)
    assert torch.equal(wz.dequantize(), (q.float() - zp.float()) * scale)
    wt = decode_int_quantized(q, torch.tensor([0.5]), None, group_size=-1)
    assert torch.equal(wt.dequantize(), q.float() * 0.5)


@pytest.mark.parametrize("bits", [4, 8])
def test_same_codes_same_dequant_across_formats(bits: int) -> None:
    w = _int_weight(9, 64, 128, bits, 64, sym=False, act_order=False, zero_lo=1)
    ref = w.dequantize()
    g = encode_gptq(w, v2=False)
    a = encode_awq(w)
    c = encode_pack_quantized(w)
    decoded = [
        decode_gptq(
            g["qweight"], g["qzeros"], g["scales"], g["g_idx"], bits=bits, group_size=64, sym=False, v2=False
        ),
        decode_awq(a["qweight"], a["qzeros"], a["scales"], group_size=64, bits=bits),
        decode_pack_quantized(
            c["weight_packed"], c["weight_scale"], c["weight_zero_point"], None, bits=bits, group_size=64
        ),
    ]
    for d in decoded:
        assert torch.equal(d.dequantize(), ref)
