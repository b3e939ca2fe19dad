"""`bind_apply` (the runtime's pre-resolved hot path) returns what `apply` returns, for every
activation dtype the runtime uses, on cpu_int4 (symmetric, asymmetric, act-order, bias) and cpu_fp8."""

from __future__ import annotations

import pytest
import torch

from kernels.base import Fp8Weight, LinearSpec, Target
from kernels.codecs.fp8 import quantize_fp8
from kernels.cpu_fp8 import WIDEN_FP32_MIN_M, CpuFp8Kernel
from kernels.cpu_int4 import CpuInt4Kernel
from tests.kernels.test_cpu_kernels import BF16_GEMM_REL_ERR, int_spec, int_weight

# Both paths run the same ops on the same bf16 inputs; only the fp32 summation order of the
# asymmetric / bias terms may differ, which can move an output by one bf16 rounding.
BIND_APPLY_REL_TOL = 2**-8
ROWS = (1, 3, 8)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    assert err < BIND_APPLY_REL_TOL, f"rel err {err:.2e}"


@pytest.mark.parametrize(
    "symmetric,act_order,bias", [(True, False, False), (False, False, True), (True, True, True)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_bind_apply_equals_apply(
    symmetric: bool, act_order: bool, bias: bool, dtype: torch.dtype
) -> None:
    w = int_weight(64, 256, symmetric=symmetric, act_order=act_order, bias=bias)
    spec = int_spec(w, act_order=act_order)
    kernel = CpuInt4Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    run = kernel.bind_apply(tensors, spec, exact_zero_offsets=True)
    for m in ROWS:
        x = torch.randn(2, m, spec.k).to(dtype)
        _close(run(x), kernel.apply(x, tensors, spec))


@pytest.mark.parametrize("m", ROWS)
def test_int4_bind_apply_folded_zero_offsets_match_reference(m: int) -> None:
    """Default asymmetric path (bf16 zero offsets in the op's zero column) against the fp32
    dequantized reference, with the same tolerance as `apply`."""
    w = int_weight(576, 1536, symmetric=False)
    spec = int_spec(w)
    kernel = CpuInt4Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    run = kernel.bind_apply(tensors, spec)
    x = torch.randn(m, spec.k).to(torch.bfloat16)
    y, ref = run(x), kernel.reference(x, tensors, spec)
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    assert y.dtype == torch.bfloat16 and err < BF16_GEMM_REL_ERR, f"rel err {err:.2e}"


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("strategy", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_bind_apply_equals_apply(
    strategy: str, dtype: torch.dtype, native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also from WIDEN_FP32_MIN_M rows, where a CPU without native bf16 widens the weight to fp32."""
    monkeypatch.setattr("kernels.cpu_fp8.has_native_bf16", lambda: native_bf16)
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(64, 256, generator=gen)
    weight: Fp8Weight = quantize_fp8(dense, strategy, block_size=(32, 128))  # type: ignore[arg-type]
    spec = LinearSpec(
        name="model.layers.0.mlp.down_proj",
        scheme="fp8",
        n=64,
        k=256,
        bits=8,
        fp8_strategy=weight.strategy,
        block_size=weight.block_size,
    )
    kernel = CpuFp8Kernel()
    tensors = kernel.prepare(weight, spec, Target.CPU)
    run = kernel.bind_apply(tensors, spec)
    for m in (*ROWS, WIDEN_FP32_MIN_M + 5):
        x = torch.randn(m, spec.k).to(dtype)
        _close(run(x), kernel.apply(x, tensors, spec))
