"""FP8 quantization semantics (vLLM, docs/formats.md §5) against straightforward fp32 re-implementations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import native_build
from kernels.base import Fp8Weight
from kernels.codecs import E4M3_MAX, quantize_fp8, requantize_to_max_scale, round_to_e4m3_grid
from kernels.codecs import native_fp8 as native_fp8_module
from kernels.codecs.fp8 import quantize_fp8_measured
from kernels.codecs.native_fp8 import native_fp8
from kernels.errors import LayoutError
from tests.kernels.reference_layouts import (
    ref_fp8_per_block,
    ref_fp8_per_channel,
    ref_fp8_per_tensor,
    ref_requantize,
)

FAST = settings(max_examples=25, deadline=None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _weight(seed: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-8, 2, (n, 1), generator=gen).float())
    return w.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@FAST
@given(
    shards=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    k=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_per_tensor_matches_reference(shards: list[int], k: int, dtype: torch.dtype, seed: int) -> None:
    w = _weight(seed, sum(shards), k, dtype)
    f = quantize_fp8(w, "tensor", shard_sizes=tuple(shards))
    q_ref, s_ref = ref_fp8_per_tensor(w, shards)
    assert f.scale.dtype == torch.float32 and f.scale.tolist() == s_ref
    assert torch.equal(_bytes(f.weight), _bytes(q_ref))
    assert f.weight.dtype == torch.float8_e4m3fn and f.shard_sizes == tuple(shards)


def test_per_tensor_scale_is_amax_over_448_without_clamp() -> None:
    w = torch.tensor([[1e-30, -2e-30], [0.0, 1.5e-30]])
    f = quantize_fp8(w, "tensor")
    assert f.scale.item() == (torch.tensor(2e-30) / torch.tensor(448.0)).item()
    zero = quantize_fp8(torch.zeros(4, 8, dtype=torch.bfloat16), "tensor", shard_sizes=(2, 2))
    assert zero.scale.tolist() == [0.0, 0.0]
    assert (_bytes(zero.weight) == 0).all() and not zero.dequantize().isnan().any()


@FAST
@given(
    n=st.integers(1, 24), k=st.integers(1, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1)
)
def test_per_channel_matches_reference(n: int, k: int, dtype: torch.dtype, seed: int) -> None:
    w = _weight(seed, n, k, dtype)
    w[0] = 0  # a zero row: scale 0, codes 0 (documented)
    f = quantize_fp8(w, "channel")
    q_ref, s_ref = ref_fp8_per_channel(w)
    assert f.scale.shape == (n,) and f.scale.tolist() == s_ref
    assert torch.equal(_bytes(f.weight), _bytes(q_ref))
    assert f.scale[0].item() == 0.0 and (_bytes(f.weight[0]) == 0).all()
    assert torch.equal(f.dequantize()[0], torch.zeros(k))


def test_reciprocal_multiply_not_division() -> None:
    # values that sit on e4m3 rounding midpoints after scaling: x * fp32(1/s) and x / s round apart.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = ((grid[1:] + grid[:-1]) / 2)[8:]
    amax = torch.linspace(0.5, 3.0, 32)
    rows = torch.cat([amax[:, None], (mids[None, :] * (amax[:, None] / E4M3_MAX))], dim=1)
    f = quantize_fp8(rows, "channel")
    s = (amax / E4M3_MAX)[:, None]
    reciprocal = (rows * (1.0 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    division = (rows / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(_bytes(f.weight), _bytes(reciprocal))
    assert (_bytes(reciprocal) != _bytes(division)).any()  # the test can tell the two apart


@FAST
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    block=st.sampled_from([(128, 128), (64, 32), (16, 16)]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_per_block_matches_reference(
    n: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int
) -> None:
    w = _weight(seed, n, k, dtype)
    f = quantize_fp8(w, "block", block_size=block)
    bn, bk = block
    assert f.scale.shape == (-(-n // bn), -(-k // bk)) and f.block_size == block
    q_ref, s_ref = ref_fp8_per_block(w, bn, bk)
    assert torch.equal(f.scale, s_ref)
    assert torch.equal(_bytes(f.weight), _bytes(q_ref))


@pytest.mark.parametrize("threads", [1, 2])
def test_row_blocks_and_threads_give_the_same_bytes(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # tiny row blocks (several, the last shorter) spread over Python threads; outputs numpy-backed
    from kernels.codecs import word_ops

    monkeypatch.setattr(word_ops, "BLOCK_BYTES", 200)
    monkeypatch.setattr(word_ops, "_HUGE_MIN_BYTES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = _weight(3, 70, 36, torch.bfloat16)
        q_ref, s_ref = ref_fp8_per_tensor(w, [30, 40])
        f = quantize_fp8(w, "tensor", shard_sizes=(30, 40))
        assert f.scale.tolist() == s_ref and torch.equal(_bytes(f.weight), _bytes(q_ref))
        q_ref, s_ref = ref_fp8_per_channel(w)
        f = quantize_fp8(w, "channel")
        assert f.scale.tolist() == s_ref and torch.equal(_bytes(f.weight), _bytes(q_ref))
        q_ref, s_ref = ref_fp8_per_block(w, 16, 16)
        f = quantize_fp8(w, "block", block_size=(16, 16))
        assert torch.equal(f.scale, s_ref) and torch.equal(_bytes(f.weight), _bytes(q_ref))
        assert torch.get_num_threads() == threads  # the caller's intra-op thread count is restored
    finally:
        torch.set_num_threads(before)


def test_per_block_amax_floor() -> None:
    f = quantize_fp8(torch.zeros(130, 10), "block")
    assert f.scale.shape == (2, 1)
    assert torch.equal(f.scale, torch.full((2, 1), 1e-4) / 448.0)


@FAST
@given(
    shards=st.lists(st.integers(1, 16), min_size=1, max_size=3),
    k=st.integers(1, 32),
    seed=st.integers(0, 2**31 - 1),
)
@example(shards=[1, 11, 11], k=9, seed=12)  # the fp16-rounded scale changes a code here
def test_requantize_to_max_scale_matches_reference(shards: list[int], k: int, seed: int) -> None:
    w = _weight(seed, sum(shards), k, torch.bfloat16)
    f = quantize_fp8(w, "tensor", shard_sizes=tuple(shards))
    r = requantize_to_max_scale(f)
    q_ref, max_ref = ref_requantize(f.weight, f.scale.tolist(), shards)
    assert r.scale.shape == (1,) and r.scale.item() == max_ref and r.shard_sizes == ()
    assert torch.equal(_bytes(r.weight), _bytes(q_ref))


def test_requantize_refuses_other_strategies() -> None:
    f = quantize_fp8(torch.randn(8, 8), "channel")
    with pytest.raises(LayoutError, match="per-tensor"):
        requantize_to_max_scale(f)
    bad = Fp8Weight(f.weight, torch.ones(2), "tensor", shard_sizes=(8,))
    with pytest.raises(LayoutError, match="2 per-tensor scales for 1 shards"):
        requantize_to_max_scale(bad)


# ---------------------------------------------------------------------------------------------
# round_to_e4m3_grid
# ---------------------------------------------------------------------------------------------


def _torch_cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))  # signed zeros too


def test_round_to_e4m3_grid_exact_on_edge_values() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()]
    pos = torch.sort(finite[finite >= 0]).values
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties (all representable in fp32)
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    sub = torch.arange(-64, 65, dtype=torch.float32) * 2.0**-10  # subnormal ties and grid
    big = torch.tensor([447.9, 448.0, 449.0, 463.99, 464.0, 480.0, 1e6, 3e38, float("inf")])
    special = torch.tensor([float("nan"), 0.0, -0.0, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 2.0**-11, 1e-30])
    x = torch.cat([finite, mids, up, down, sub, big, special])
    x = torch.cat([x, -x])
    _assert_same_bits(round_to_e4m3_grid(x), _torch_cast(x))
    assert torch.equal(round_to_e4m3_grid(finite), finite)  # the grid is a fixed point


def test_round_to_e4m3_grid_exact_on_random_values() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * torch.exp2(
        torch.randint(-16, 11, (200_000,), generator=gen).float()
    )
    _assert_same_bits(round_to_e4m3_grid(x), _torch_cast(x))


def test_round_to_e4m3_grid_needs_float32() -> None:
    with pytest.raises(LayoutError, match="float32"):
        round_to_e4m3_grid(torch.zeros(3, dtype=torch.float16))


# --- the native quantizer (kernels/codecs/native/fp8_quant.c) and the measured error ----------------


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantize with torch ops: the native library reads as unavailable."""
    monkeypatch.setitem(native_fp8_module.LIBRARY._state, "lib", None)


def _edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of ordinary weights plus e4m3 edge values: ties, subnormals, ±0, the saturation point."""
    w = _weight(7, 96, 160, torch.float32)
    edge = torch.tensor([
        0.0, -0.0, 1e-30, 2**-10, 1.5 * 2**-9, 2.5 * 2**-9, 2**-6, 0.999 * 2**-6, 3.5 * 2**-9,
        447.0, 448.0, 464.0, 480.0, -17.0, 2**-7 * 1.0625, 2**-7 * 1.1875,
    ])  # fmt: skip
    w[0, : edge.numel()] = edge
    w[1, : edge.numel()] = -edge * 0.37
    return w.to(dtype)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_and_torch_quantizers_give_the_same_bytes_and_error(
    dtype: torch.dtype, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _edge_rows(dtype)
    native_q, native_err = quantize_fp8_measured(w, strategy)  # type: ignore[arg-type]
    _torch_path(monkeypatch)
    torch_q, torch_err = quantize_fp8_measured(w, strategy)  # type: ignore[arg-type]
    assert torch.equal(_bytes(native_q.weight), _bytes(torch_q.weight))
    assert torch.equal(native_q.scale, torch_q.scale)
    assert native_err == torch_err


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_measured_error_is_the_dequantized_comparison(dtype: torch.dtype) -> None:
    w = _edge_rows(dtype)
    q, err = quantize_fp8_measured(w, "channel")
    dequantized = q.weight.float() * q.scale[:, None]
    assert err.diff_max == float((dequantized - w.float()).abs().max())
    assert err.ref_max == float(w.float().abs().max())
    assert torch.equal(_bytes(q.weight), _bytes(quantize_fp8(w, "channel").weight))


def test_a_non_finite_weight_gives_a_nan_error() -> None:
    w = _edge_rows(torch.bfloat16)
    w[3, 4] = float("nan")
    _, err = quantize_fp8_measured(w, "tensor")
    assert err.diff_max != err.diff_max


def test_native_rounding_is_torchs_on_spread_fp32_patterns() -> None:
    """Every 1021st fp32 bit pattern (all exponents, both signs, NaNs and infinities), and a dense sweep
    around e4m3's subnormal range, through the native kernel with a unit scale: torch's e4m3fn bytes."""
    lib = native_fp8()
    if lib is None:
        pytest.skip("no C compiler: the native quantizer is not built here (the torch path is tested)")
    patterns = torch.arange(0, 2**32, 1021, dtype=torch.int64).to(torch.int32).view(torch.float32)
    sweep = torch.linspace(-0.05, 0.05, 1_000_000)
    for x in (patterns[:4_000_000].reshape(-1, 1000), sweep.reshape(-1, 1000)):
        n, k = x.shape
        ones, out = torch.ones(n), torch.empty(n, k, dtype=torch.uint8)
        lib.kiln_fp8_quantize_f32(x.data_ptr(), n, k, k, ones.data_ptr(), ones.data_ptr(), out.data_ptr(), 0)
        assert torch.equal(out, _bytes(x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)))


def test_without_a_compiler_it_warns_once_and_quantizes_with_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(native_fp8_module.LIBRARY, "_state", {})
    w = _edge_rows(torch.bfloat16)
    with caplog.at_level("WARNING", logger=native_build.__name__):
        first = quantize_fp8(w, "tensor")
        second = quantize_fp8(w, "tensor")
    warnings = [r for r in caplog.records if "native FP8 quantizer unavailable" in r.getMessage()]
    assert len(warnings) == 1 and native_fp8_module.LIBRARY._state == {"lib": None}
    assert torch.equal(_bytes(first.weight), _bytes(second.weight))
