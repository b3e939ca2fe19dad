"""Marlin layout prep, bit-exact against the independent reference construction and the closed forms."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.codecs import decode_gptq, encode_gptq, pack_rows, unpack_rows
from kernels.errors import LayoutError
from kernels.marlin_layout import (
    check_marlin_shape,
    marlin_permute_scales,
    marlin_repack,
    marlin_unpack_zero_points,
    marlin_unpermute_scales,
    marlin_unrepack,
    marlin_zero_points,
    sort_g_idx,
)
from tests.kernels.reference_layouts import (
    ref_marlin_closed_form,
    ref_marlin_repack,
    ref_marlin_weight_perm,
    ref_marlin_zero_points,
    ref_marlin_zero_points_closed_form_4bit,
    ref_pack_rows,
    ref_permute_scales,
    ref_permute_scales_closed_form,
)

FAST = settings(max_examples=25, deadline=None)


def _codes(seed: int, k: int, n: int, bits: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int64).to(torch.uint8)


@FAST
@given(
    bits=st.sampled_from([4, 8]),
    k_tiles=st.integers(1, 8),
    n_tiles=st.integers(1, 3),
    act_order=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_repack_matches_reference_construction(
    bits: int, k_tiles: int, n_tiles: int, act_order: bool, seed: int
) -> None:
    k, n = 16 * k_tiles, 64 * n_tiles
    q = _codes(seed, k, n, bits)
    std = pack_rows(q, bits)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else None
    out = marlin_repack(std, bits, perm)
    assert out.shape == (k // 16, n * 16 * bits // 32) and out.dtype == torch.int32
    assert torch.equal(out, ref_marlin_repack(q, bits, perm))
    rows = q if perm is None else q[perm]
    assert torch.equal(out, ref_marlin_closed_form(rows, bits))
    # exact inverse, rows in perm order
    assert torch.equal(marlin_unrepack(out, bits, k, n), pack_rows(rows, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_constructions_agree_with_each_other(bits: int) -> None:
    # the marlin_utils_test construction and the CUDA-derived closed form, both independent of kernels/
    q = _codes(1, 32, 128, bits)
    assert torch.equal(ref_marlin_repack(q, bits), ref_marlin_closed_form(q, bits))
    perm = ref_marlin_weight_perm(bits)
    assert sorted(perm) == list(range(1024))


@FAST
@given(k_tiles=st.integers(1, 6), n_tiles=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_repack_8bit_arbitrary_int32_round_trips(k_tiles: int, n_tiles: int, seed: int) -> None:
    # FP8 Marlin packs raw e4m3 bytes: every int32 pattern, sign bit included, must survive.
    k, n = 16 * k_tiles, 64 * n_tiles
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31, (k // 4, n), generator=gen, dtype=torch.int64).to(torch.int32)
    out = marlin_repack(raw, 8)
    assert torch.equal(marlin_unrepack(out, 8, k, n), raw)
    assert torch.equal(out, ref_marlin_repack(unpack_rows(raw, 8, k), 8))


@pytest.mark.parametrize("bits", [4, 8])
def test_unrepack_of_repack_is_identity_on_random_words(bits: int) -> None:
    k, n = 128, 192
    gen = torch.Generator().manual_seed(bits)
    words = torch.randint(-(2**31), 2**31, (k * bits // 32, n), generator=gen, dtype=torch.int64)
    words = words.to(torch.int32)
    assert torch.equal(marlin_unrepack(marlin_repack(words, bits), bits, k, n), words)
    assert torch.equal(marlin_repack(marlin_unrepack(marlin_repack(words, bits), bits, k, n), bits),
                       marlin_repack(words, bits))  # fmt: skip


def test_repack_refuses_bad_shapes() -> None:
    with pytest.raises(LayoutError, match="N % 64"):
        marlin_repack(torch.zeros(16, 96, dtype=torch.int32), 4)
    with pytest.raises(LayoutError, match="K % 16"):
        marlin_repack(torch.zeros(1, 64, dtype=torch.int32), 4)  # K = 8
    with pytest.raises(LayoutError, match="4- or 8-bit"):
        marlin_repack(torch.zeros(6, 64, dtype=torch.int32), 3)
    with pytest.raises(LayoutError, match="perm"):
        marlin_repack(torch.zeros(2, 64, dtype=torch.int32), 4, torch.zeros(16, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# scales / zero points
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "group_size", "groups"), [(256, -1, 1), (256, 32, 8), (256, 64, 4), (256, 128, 2), (128, 128, 1)]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_permute_scales(k: int, group_size: int, groups: int, dtype: torch.dtype) -> None:
    n = 128
    s = torch.randn(groups, n, generator=torch.Generator().manual_seed(groups)).to(dtype)
    out = marlin_permute_scales(s, k, n, group_size)
    assert out.dtype == dtype and out.shape == s.shape
    assert torch.equal(out, ref_permute_scales(s, k, group_size))
    assert torch.equal(out, ref_permute_scales_closed_form(s, k, group_size))
    assert torch.equal(marlin_unpermute_scales(out, k, n, group_size), s)


def test_group_size_equal_to_k_uses_the_single_perm() -> None:
    s = torch.arange(64, dtype=torch.float32)[None, :]
    single = marlin_permute_scales(s, 128, 64, 128)
    grouped = marlin_permute_scales(s, 256, 64, 128)
    assert single[0, :8].tolist() == [0, 1, 8, 9, 16, 17, 24, 25]
    assert grouped[0, :8].tolist() == [0, 8, 16, 24, 32, 40, 48, 56]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("groups", [1, 3])
def test_zero_points(bits: int, groups: int) -> None:
    n = 192
    gen = torch.Generator().manual_seed(bits * groups)
    zp = torch.randint(0, 1 << bits, (groups, n), generator=gen, dtype=torch.int64).to(torch.uint8)
    out = marlin_zero_points(zp, bits)
    assert out.shape == (groups, n * bits // 32) and out.dtype == torch.int32
    assert torch.equal(out, ref_marlin_zero_points(zp, bits))
    if bits == 4:
        assert torch.equal(out, ref_marlin_zero_points_closed_form_4bit(zp))
    assert torch.equal(marlin_unpack_zero_points(out, bits, n), zp)


# ---------------------------------------------------------------------------------------------
# act-order
# ---------------------------------------------------------------------------------------------


def test_sort_g_idx_is_stable() -> None:
    g_idx = torch.tensor([2, 0, 1, 0, 2, 1, 0, 2], dtype=torch.int32)
    sorted_g, perm = sort_g_idx(g_idx)
    assert perm.dtype == torch.int32 and sorted_g.dtype == torch.int32
    assert perm.tolist() == [1, 3, 6, 2, 5, 0, 4, 7]
    assert sorted_g.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_gptq_to_marlin_and_back(bits: int) -> None:
    from kernels.base import IntWeight

    k, n, group = 256, 128, 64
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int64).to(torch.uint8)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    w = IntWeight(codes, torch.rand(k // group, n, generator=gen).half(), bits, group, g_idx=g_idx)
    t = encode_gptq(w, v2=False)
    back = decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=bits, group_size=group,
                       sym=True, v2=False)  # fmt: skip
    g_sorted, perm = sort_g_idx(back.g_idx)
    marlin = marlin_repack(t["qweight"], bits, perm)
    assert torch.equal(marlin, ref_marlin_repack(codes.T, bits, perm))
    rows = unpack_rows(marlin_unrepack(marlin, bits, k, n), bits, k)  # (K, N) in perm order
    assert torch.equal(rows, codes.T[perm.long()])
    assert torch.equal(g_sorted, g_idx[perm.long()])
    assert torch.equal(ref_pack_rows(rows, bits), marlin_unrepack(marlin, bits, k, n))


# ---------------------------------------------------------------------------------------------
# shape policy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "k_full", "group_size", "bits"),
    [(4096, 4096, 4096, 128, 4), (64, 128, 128, -1, 8), (128, 128, 256, 128, 4), (64, 128, 128, 128, 4)],
)
def test_check_marlin_shape_accepts(n: int, k: int, k_full: int, group_size: int, bits: int) -> None:
    assert check_marlin_shape(n, k, k_full, group_size, bits=bits) == (True, "")


@pytest.mark.parametrize(
    ("n", "k", "k_full", "group_size", "bits", "words"),
    [
        (1000, 4096, 4096, 128, 4, ["N=1000", "multiple of 64", "TP size"]),
        (4096, 4000, 4000, -1, 4, ["K=4000", "multiple of 128", "TP size"]),
        (4096, 384, 768, 256, 4, ["group_size=256", "-1, 32, 64, 128"]),
        (4096, 128, 256, 32, 3, ["3-bit", "4- and 8-bit"]),
        (4096, 128, 512, 16, 4, ["group_size=16"]),
    ],
)
def test_check_marlin_shape_refuses_with_reason(
    n: int, k: int, k_full: int, group_size: int, bits: int, words: list[str]
) -> None:
    ok, reason = check_marlin_shape(n, k, k_full, group_size, bits=bits)
    assert not ok
    for w in words:
        assert w in reason


def test_check_marlin_shape_row_parallel_split() -> None:
    # K_full = 384 over 3 ranks gives K = 128 per rank: fine for every Marlin group size.
    assert check_marlin_shape(64, 128, 384, 64)[0]
    # K_full = 384 over 2 ranks gives K = 192 per rank: refused by the K rule, naming this rank's K.
    ok, reason = check_marlin_shape(64, 192, 384, 64)
    assert not ok and "K=192" in reason


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k_tiles", [1, 7])
def test_repack_across_row_blocks_and_hugepage_outputs(
    bits: int, k_tiles: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiny blocks: several blocks plus a shorter last one (or a single 1-row block); every output
    # numpy-backed; the input must come back untouched (blocks work on copies)
    from kernels.codecs import word_ops

    monkeypatch.setattr(word_ops, "BLOCK_BYTES", 3000)
    monkeypatch.setattr(word_ops, "_HUGE_MIN_BYTES", 0)
    k, n = 16 * k_tiles, 64 * 3
    q = _codes(11 + bits, k, n, bits)
    std = pack_rows(q, bits)
    before = std.clone()
    out = marlin_repack(std, bits)
    assert torch.equal(out, ref_marlin_closed_form(q, bits))
    assert torch.equal(std, before)
