"""fp8_w8a16 (FP8 weight-only on the plain layout) on CPU through the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1): stored tensors exact, apply against its torch twin for
shapes Marlin refuses, every strategy, both act dtypes, and the refusals / registry placement.
The CUDA repeat lives in test_gpu_kernels_cuda.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import launch
from kernels.base import LinearSpec, Target
from kernels.errors import LayoutError
from kernels.fp8_w8a16 import Fp8W8A16Kernel, fp8_w8a16_gemm
from kernels.registry import PRIORITY, choose_kernel
from tests.helpers.numerics import rel_err
from tests.kernels.test_gpu_kernels import DTYPES, Fp8Case

# apply vs its twin (relative Frobenius error). The kernel's dot runs on the exact e4m3 codes (every
# code is an fp16 / bf16 value) with fp32 accumulation and the scale applied in fp32; the twin
# multiplies code * scale first. They differ by fp32 rounding and accumulation order, and the final
# rounding to the act dtype can then land one ulp apart on a few elements (measured ~1e-5 overall).
# Bound: the act dtype's worst relative half-ulp, 2^-8 (bf16, 8 significant bits) / 2^-11 (fp16).
APPLY_REL_TOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# The twin against an fp32 matmul of Fp8Weight.dequantize(): only the output rounding, <= half an ulp.
TWIN_REL_TOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

MS = (1, 7, 16, 33)
CASES = [
    Fp8Case(96, 192, "channel"),
    Fp8Case(200, 320, "tensor", shard_sizes=(120, 40, 40)),  # fused q/k/v-like shards, distinct scales
    Fp8Case(200, 320, "block", block_size=(64, 48)),  # partial blocks along N and K
    Fp8Case(96, 576, "block", block_size=(128, 128)),  # SmolLM2's K = 576: 4.5 blocks of 128
    Fp8Case(40, 576, "tensor"),
]


def _case_id(case: Fp8Case) -> str:
    return f"{case.n}x{case.k}-{case.strategy}{case.block_size or ''}"


KERNEL = Fp8W8A16Kernel()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_stored_tensors_and_dequantize_are_exact(case: Fp8Case) -> None:
    spec = case.spec(torch.bfloat16)
    fw = case.weight(torch.bfloat16)
    tensors = KERNEL.prepare(fw, spec, Target.SM90)
    assert tensors["weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(tensors["weight"].view(torch.uint8), fw.weight.view(torch.uint8))  # bytes as is
    scale = tensors["weight_scale"]
    assert scale.dtype == torch.float32
    if case.strategy == "block":
        assert case.block_size is not None
        bn, bk = case.block_size
        assert scale.shape == (-(-case.n // bn), -(-case.k // bk))
        assert torch.equal(scale, fw.scale)
    else:
        assert scale.shape == (case.n,)
        assert torch.equal(scale, fw.expanded_scale()[:, 0])
    assert tensors["bias"].dtype == torch.bfloat16 and torch.equal(tensors["bias"], fw.bias)
    assert torch.equal(KERNEL.dequantize(tensors, spec), fw.dequantize())  # bit-exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_apply_matches_reference(case: Fp8Case, dtype: torch.dtype) -> None:
    spec = case.spec(dtype)
    fw = case.weight(dtype)
    tensors = KERNEL.prepare(fw, spec, Target.SM90)
    w = fw.dequantize()
    gen = torch.Generator().manual_seed(1)
    for m in MS:
        x = torch.randn(m, spec.k, generator=gen).to(dtype)
        y = KERNEL.apply(x, tensors, spec)
        assert y.dtype == dtype and y.shape == (m, spec.n)
        ref = KERNEL.reference(x, tensors, spec)
        err = rel_err(y, ref)
        assert err < APPLY_REL_TOL[dtype], f"M={m}: relative error {err:.2e}"
        exact = x.float() @ w.T + fw.bias.float()  # type: ignore[union-attr]
        assert rel_err(ref, exact) < TWIN_REL_TOL[dtype]


def test_no_bias_split_k_and_batched_input() -> None:
    case = CASES[2]
    dtype = torch.float16
    spec = replace(case.spec(dtype), has_bias=False)
    fw = case.weight(dtype)
    fw.bias = None
    tensors = KERNEL.prepare(fw, spec, Target.SM90)
    assert "bias" not in tensors
    x = torch.randn(2, 3, spec.k).to(dtype)
    ref = KERNEL.reference(x, tensors, spec)
    # BLOCK_K is shrunk from 64 to 16 to divide bk = 48; split-K accumulates in fp32 atomically
    cfg = launch.GemmConfig(block_m=16, block_n=64, block_k=64, split_k=2)
    y = fp8_w8a16_gemm(x, tensors, spec, cfg)
    assert y.shape == (2, 3, spec.n) and y.dtype == dtype
    assert rel_err(y, ref) < APPLY_REL_TOL[dtype]
    assert fp8_w8a16_gemm(x[:0], tensors, spec).shape == (0, 3, spec.n)


def test_e4m3_decode_covers_every_code() -> None:
    """All 254 finite e4m3 codes (subnormals, normals, ±0, ±448) through the kernel's bit decode."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes
    n, k = 16, codes.numel()  # K = 254: masked tail
    weight = codes.repeat(n, 1).view(torch.float8_e4m3fn)  # (N, K)
    spec = LinearSpec(name="l", scheme="fp8", n=n, k=k, bits=8, fp8_strategy="channel", act_dtype="float16")
    tensors = {"weight": weight, "weight_scale": torch.ones(n)}
    x = torch.eye(k)[:n].to(torch.float16)  # row i picks code i: y[i, :] = decode(code i)
    y = KERNEL.apply(x, tensors, spec)
    want = weight.float()[:, :n].T.to(torch.float16)
    assert torch.equal(y, want)


def test_prepare_refuses_mismatched_weights() -> None:
    case = CASES[2]
    spec = case.spec(torch.float16)
    fw = case.weight(torch.float16)
    with pytest.raises(LayoutError, match="block size"):
        KERNEL.prepare(fw, replace(spec, block_size=(128, 128)), Target.SM90)
    with pytest.raises(LayoutError, match="spec says"):
        KERNEL.prepare(fw, replace(spec, n=case.n + 8), Target.SM90)
    shards = CASES[1].weight(torch.float16)
    with pytest.raises(LayoutError, match="per-tensor scales"):
        KERNEL.prepare(replace(shards, shard_sizes=(100, 100)), CASES[1].spec(torch.float16), Target.SM90)


def test_can_implement_and_refusals() -> None:
    bf16 = CASES[0].spec(torch.bfloat16)
    fp16 = CASES[0].spec(torch.float16)
    for target in (Target.SM80, Target.SM86, Target.SM89, Target.SM90):
        assert KERNEL.can_implement(bf16, target) == (True, "")
    assert KERNEL.can_implement(fp16, Target.SM75) == (True, "")
    refusals = [
        (bf16, Target.SM75, "needs act_dtype float16"),
        (bf16, Target.CPU, "cpu_fp8"),
        (replace(bf16, scheme="int", bits=4, group_size=64), Target.SM80, "scheme 'int'"),
        (replace(bf16, act_dtype="float32"), Target.SM80, "float32"),
        (replace(bf16, fp8_strategy="block"), Target.SM80, "without block_size"),
        (replace(bf16, fp8_strategy="block", block_size=(128, 100)), Target.SM80, "multiple of 16"),
    ]
    for spec, target, needle in refusals:
        ok, reason = KERNEL.can_implement(spec, target)
        assert not ok and needle in reason, reason


def test_registry_falls_back_to_it_for_shapes_marlin_refuses() -> None:
    for target in (Target.SM80, Target.SM86, Target.SM89, Target.SM90):
        order = PRIORITY[target]
        assert order.index("fp8_w8a16") == order.index("fp8_marlin") + 1
    smol = LinearSpec(
        name="model.layers.0.mlp.gate_up_proj", scheme="fp8", n=3072, k=576, bits=8, fp8_strategy="channel"
    )
    choice = choose_kernel(smol, Target.SM80)
    assert choice.kernel.name == "fp8_w8a16"
    assert any(name == "fp8_marlin" and "K" in why for name, why in choice.rejected)
    block = replace(smol, fp8_strategy="block", block_size=(128, 128))
    assert choose_kernel(block, Target.SM90).kernel.name == "fp8_w8a16"  # fp8_w8a8 takes no blocks
    assert choose_kernel(replace(smol, act_dtype="float16"), Target.SM75).kernel.name == "fp8_w8a16"
    aligned = replace(smol, k=1024)
    assert choose_kernel(aligned, Target.SM80).kernel.name == "fp8_marlin"  # Marlin stays first


def test_fused_layer_with_one_per_tensor_scale() -> None:
    """Online FP8 quantizes a fused layer whole: one scale, no shard_sizes, while the spec names shards."""
    case = CASES[1]
    spec = case.spec(torch.float16)
    assert len(spec.shards) == 3
    whole = Fp8Case(case.n, case.k, "tensor").weight(torch.float16)
    tensors = KERNEL.prepare(whole, spec, Target.SM90)
    assert torch.equal(tensors["weight_scale"], whole.scale.expand(case.n))
    assert torch.equal(KERNEL.dequantize(tensors, spec), whole.dequantize())
