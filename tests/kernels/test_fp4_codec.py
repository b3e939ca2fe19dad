"""FP4 codecs and the canonical Fp4Weight: nibble packing, E2M1 / E8M0 values bit for bit, the
quantizer's rounding, and cpu_fp4 keeping fused shards' different global scales exactly."""

from __future__ import annotations

import pytest
import torch

from kernels.base import E2M1_VALUES, Fp4Weight, LinearSpec, ShardSpec, Target, e2m1_values, e8m0_values
from kernels.codecs.fp4 import pack_fp4, quantize_fp4, round_to_e2m1, unpack_fp4
from kernels.cpu_fp4 import CpuFp4Kernel
from kernels.dense import DenseKernel
from kernels.errors import LayoutError
from kernels.marlin_fp4 import MarlinFp4Kernel

# FP4 keeps one of 8 magnitudes per block: a block's largest value is within half a step of 6 units
# (1/12 of it), every other within half of its own step (at most 1/6 of the block's largest).
FP4_MAX_REL_ERR = 0.25


def test_pack_is_low_nibble_first_and_inverts() -> None:
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(unpack_fp4(packed), codes)


def test_e2m1_and_e8m0_values_bit_for_bit() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_values(codes)
    assert values.tolist() == list(E2M1_VALUES)
    assert torch.signbit(values[8]) and not torch.signbit(values[0])  # code 8 is -0.0
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_values(e)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert got[:-1].tolist() == want and bool(torch.isnan(got[-1]))


def test_round_to_e2m1_is_nearest_and_keeps_every_value() -> None:
    values = torch.tensor(E2M1_VALUES)
    assert torch.equal(e2m1_values(round_to_e2m1(values)), values)
    x = torch.linspace(-8, 8, 4001)
    nearest = (x[:, None] - values[None, :8].abs() * torch.sign(x)[:, None]).abs().min(-1).values
    assert torch.all((e2m1_values(round_to_e2m1(x)) - x.clamp(-6, 6)).abs() <= nearest + 1e-6)


def test_quantize_fp4_stays_within_a_blocks_step() -> None:
    w = torch.randn(64, 256) * 0.05
    for fmt in ("nvfp4", "mxfp4"):
        codes, scales, g = quantize_fp4(w, fmt)
        got = Fp4Weight(codes, scales, fmt, g).dequantize()  # type: ignore[arg-type]
        assert ((got - w).abs().max() / w.abs().max()).item() <= FP4_MAX_REL_ERR, fmt


def _fused_nvfp4() -> tuple[Fp4Weight, LinearSpec]:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(128, 4, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    sizes = (64, 32, 32)  # q, k, v rows, each its own global multiplier (an fp32 that is no power of 2)
    g = torch.tensor([1 / 3000, 1 / 2500, 1 / 7001], dtype=torch.float32)
    shards = tuple(ShardSpec(name, size) for name, size in zip(("q", "k", "v"), sizes, strict=True))
    spec = LinearSpec(
        name="qkv", scheme="fp4", n=128, k=64, bits=4, group_size=16, fp4_format="nvfp4", shards=shards
    )
    return Fp4Weight(codes, scales, "nvfp4", g, sizes), spec


def test_cpu_fp4_keeps_each_shards_global_scale_exactly() -> None:
    w, spec = _fused_nvfp4()
    kernel = CpuFp4Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())
    x = torch.randn(3, 64)
    want = x @ w.dequantize().T
    got = kernel.apply(x, tensors, spec)  # bf16 activations inside, fp32 accumulation
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_marlin_fp4_refuses_fused_shards_with_different_global_scales() -> None:
    w, spec = _fused_nvfp4()
    with pytest.raises(LayoutError, match="different global scales"):
        MarlinFp4Kernel().prepare(w, spec, Target.SM80)


def test_the_dense_kernel_is_the_lossless_cpu_fallback_for_fp4() -> None:
    w, spec = _fused_nvfp4()
    tensors = DenseKernel().prepare(w, spec, Target.CPU)
    assert torch.equal(tensors["weight"], w.dequantize())
