"""cpu_w4a8: the integer-dot layout bit-exact, the activation quantization bit for bit between the
library and the twin, every body (scalar, AVX2, AVX-512 VNNI) against the twin, integer sums exact,
the error against unquantized activations within its bound, and the conversion option that asks
for the kernel."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kernels.base import IntWeight, LinearSpec, Target
from kernels.cpu_w4a8 import (
    LEVELS,
    LIBRARY,
    CpuW4A8Kernel,
    block_scales,
    dequantized_activations,
    group_of,
    group_scales,
    pack_w4a8,
    quantize_activations,
    unpack_w4a8,
)
from kernels.registry import choose_kernel
from tests.helpers.native import each_body
from tests.helpers.numerics import rel_err
from tests.kernels.test_cpu_kernels import int_spec, int_weight

# The library and the twin multiply the same integers and scales; the fp32 epilogue (scale x sum,
# offset x csum, the groups added) runs in a different order: a few fp32 ulps of the largest terms.
W4A8_TWIN_REL_ERR = 2e-6
# Elementwise: |library - twin| <= this x sum_k |x_dq[k] w[n, k]| (the terms' magnitudes).
W4A8_TWIN_TERM_REL = 1e-5

KERNEL = CpuW4A8Kernel()


def _lib():  # type: ignore[no-untyped-def]
    lib = LIBRARY.get()
    if lib is None:
        pytest.skip("no C compiler: cpu_w4a8 runs its torch twin here")
    return lib


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each body this CPU can run (skipped above what it has)."""
    yield from each_body(_lib().kiln_w4a8_level, LEVELS, request.param)


def _a8(w: IntWeight, **kw: object) -> LinearSpec:
    return int_spec(w, int8_activations=True, **kw)


def _weight(n: int, k: int, group: int, zero: str, seed: int = 0) -> tuple[IntWeight, LinearSpec]:
    w = int_weight(n, k, group_size=group, symmetric=zero != "zero_points", seed=seed)
    if zero == "float_mins":
        mins = torch.randn(w.scales.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.01
        w = replace(w, mins=mins.to(torch.float16).float())
    return w, replace(_a8(w), float_zeros=zero == "float_mins", symmetric=zero == "symmetric")


# ---- layout ---------------------------------------------------------------------------------------


def test_codes_lie_sixteen_rows_by_eight_k_per_64_bytes() -> None:
    """Byte j of row r's lane in k chunk c of row block b: code (16b + r, 8c + j) low, 8c + 4 + j high."""
    n, k = 48, 40
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_w4a8(codes)
    assert packed.shape == (n // 16, 8 * k) and packed.dtype == torch.uint8
    flat = packed.reshape(-1).tolist()
    for b in range(n // 16):
        for c in range(k // 8):
            for r in range(16):
                for j in range(4):
                    byte = flat[b * 8 * k + c * 64 + r * 4 + j]
                    assert byte & 15 == codes[16 * b + r, 8 * c + j]
                    assert byte >> 4 == codes[16 * b + r, 8 * c + 4 + j]
    assert torch.equal(unpack_w4a8(packed, n, k), codes)


def test_block_scales_round_trip() -> None:
    gen = torch.Generator().manual_seed(1)
    scales, offsets = torch.rand(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    stored = block_scales(scales, offsets)
    assert stored.shape == (2, 3, 2, 16)
    assert torch.equal(stored[1, 2, 0], scales[2, 16:]) and torch.equal(stored[1, 2, 1], offsets[2, 16:])
    back = group_scales(stored)
    assert torch.equal(back[0], scales) and torch.equal(back[1], offsets)


@pytest.mark.parametrize("zero", ["symmetric", "zero_points", "float_mins"])
def test_dequantize_is_the_source_weight(zero: str) -> None:
    """w = code * scale + offset gives the checkpoint's (q - z) * s / q * s + m exactly (bf16 / fp16
    scales, 4-bit codes: every product and sum exact in fp32)."""
    w, spec = _weight(64, 128, 32, zero)
    tensors = KERNEL.prepare(w, spec, Target.CPU)
    assert torch.equal(KERNEL.dequantize(tensors, spec), w.dequantize())


# ---- activations ----------------------------------------------------------------------------------


def _library_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    sx, csum = torch.empty(m, k // group), torch.empty(m, k // group)
    x = x.float().contiguous()
    _lib().kiln_w4a8_quantize(x.data_ptr(), m, k, group, q.data_ptr(), sx.data_ptr(), csum.data_ptr())
    return q, sx, csum


@pytest.mark.parametrize("group", [8, 32, 40, 128])
def test_activation_quantization_is_the_twins_bit_for_bit(level: str, group: int) -> None:
    """Random rows, a zero group, exact ties (amax 127: x * 127 / amax lands on k + 0.5, rounded to
    even) and bf16 values as the model feeds them."""
    gen = torch.Generator().manual_seed(2)
    k = group * 4 if group != 40 else 40
    x = torch.randn(6, k, generator=gen) * torch.logspace(-3, 2, 6)[:, None]
    x[1, :group] = 0.0
    ties = torch.arange(group, dtype=torch.float32) % 8 - 3.5
    ties[0] = 127.0
    x[2, :group] = ties
    x = x.to(torch.bfloat16).float()
    got, want = _library_quantize(x, group), quantize_activations(x, group)
    for g, w, name in zip(got, want, ("q", "sx", "csum"), strict=True):
        assert torch.equal(g, w), name
    assert want[0][2, 1:8].tolist() == [-2, -2, 0, 0, 2, 2, 4]  # -2.5 ... 3.5: ties to even
    assert int(want[0].abs().max()) <= 127


# ---- GEMV -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", ["symmetric", "zero_points", "float_mins"])
@pytest.mark.parametrize("group", [32, 64, -1])
def test_every_body_matches_the_twin(level: str, zero: str, group: int) -> None:
    """N = 208 (13 row blocks), K = 192; token counts around the tiles (8 AVX-512, 4 AVX2)."""
    w, spec = _weight(208, 192, group, zero, seed=3)
    tensors = KERNEL.prepare(w, spec, Target.CPU)
    run = KERNEL.bind_apply(tensors, spec)
    gen = torch.Generator().manual_seed(4)
    weight = KERNEL.dequantize(tensors, spec)
    for m in (1, 2, 3, 5, 8, 9, 17):
        x = torch.randn(m, spec.k, generator=gen)
        got = run(x)
        want = KERNEL.reference(x, tensors, spec)
        assert rel_err(got, want) < W4A8_TWIN_REL_ERR, (m, rel_err(got, want))
        xdq = dequantized_activations(x, group_of(spec))
        bound = W4A8_TWIN_TERM_REL * (xdq.abs() @ weight.abs().T) + 1e-6
        assert bool(((got - want).abs() <= bound).all()), m


def test_integer_sums_are_exact(level: str) -> None:
    """Activations already on the int8 grid (amax 127 per group: sx = 1) and unit scales: the
    layer is an integer matmul, every partial sum below 2^24, so the output is exact."""
    n, k, group = 64, 256, 64
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    w = IntWeight(codes, torch.ones(k // group, n, dtype=torch.bfloat16), 4, group)
    spec = _a8(w)
    x = torch.randint(-127, 128, (9, k), generator=gen).float()
    x[:, ::group] = 127.0
    tensors = KERNEL.prepare(w, spec, Target.CPU)
    want = x.double() @ (codes.double() - 8).T
    assert torch.equal(KERNEL.apply(x, tensors, spec).double(), want)
    assert torch.equal(KERNEL.reference(x, tensors, spec).double(), want)


def test_error_against_unquantized_activations_is_within_half_a_step() -> None:
    """|y - x @ W.T| <= sum_k (sx_g(k) / 2) |w[n, k]|: each activation moves by at most half its
    group's step."""
    w, spec = _weight(128, 256, 32, "zero_points", seed=6)
    tensors = KERNEL.prepare(w, spec, Target.CPU)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(7))
    weight = KERNEL.dequantize(tensors, spec)
    _, sx, _ = quantize_activations(x, 32)
    half_step = (sx / 2).repeat_interleave(32, dim=1)  # (M, K)
    bound = half_step @ weight.abs().T * (1 + 1e-5) + 1e-5
    err = (KERNEL.apply(x, tensors, spec) - (x @ weight.T + tensors["bias"])).abs()
    assert bool((err <= bound).all())
    assert err.max() > 0  # the activations were quantized


def test_bias_and_dtypes() -> None:
    w, spec = _weight(32, 64, 32, "symmetric")
    bias = torch.randn(32, generator=torch.Generator().manual_seed(8))
    w = replace(w, bias=bias)
    spec = replace(spec, has_bias=True)
    tensors = KERNEL.prepare(w, spec, Target.CPU)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
        y = KERNEL.apply(x, tensors, spec)
        assert y.shape == (2, 3, 32) and y.dtype == dtype
        assert rel_err(y, KERNEL.reference(x, tensors, spec)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert KERNEL.apply(torch.empty(0, 64), tensors, spec).shape == (0, 32)  # no tokens: no rows


def test_without_the_library_the_twin_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    w, spec = _weight(32, 64, 32, "symmetric")
    tensors = KERNEL.prepare(w, spec, Target.CPU)
    monkeypatch.setattr(LIBRARY, "get", lambda: None)
    x = torch.randn(3, 64)
    assert torch.equal(KERNEL.bind_apply(tensors, spec)(x), KERNEL.reference(x, tensors, spec))


# ---- choice ---------------------------------------------------------------------------------------


def test_only_layers_converted_for_int8_activations_get_it() -> None:
    w = int_weight(64, 128, group_size=32)
    plain = int_spec(w)
    assert choose_kernel(plain, Target.CPU).kernel.name == "cpu_int4"
    choice = choose_kernel(_a8(w), Target.CPU)
    assert choice.kernel.name == "cpu_w4a8"
    rejected = dict(choose_kernel(plain, Target.CPU).rejected)
    assert "--int8-activations" in rejected["cpu_w4a8"]


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"n": 72}, "multiple of 16"),
        ({"group_size": 36, "k": 144}, "multiples of 8"),
        ({"act_order": True}, "act-order"),
        ({"bits": 8}, "4-bit"),
    ],
)
def test_shapes_it_cannot_take_say_why(change: dict[str, object], reason: str) -> None:
    spec = replace(_a8(int_weight(64, 128, group_size=32)), **change)  # type: ignore[arg-type]
    ok, why = KERNEL.can_implement(spec, Target.CPU)
    assert not ok and reason in why
    assert choose_kernel(spec, Target.CPU).kernel.name != "cpu_w4a8"


def test_gpu_targets_refuse_it() -> None:
    ok, why = KERNEL.can_implement(_a8(int_weight(64, 128, group_size=32)), Target.SM80)
    assert not ok and "cpu" in why
