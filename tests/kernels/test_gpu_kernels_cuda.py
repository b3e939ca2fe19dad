"""The GPU kernels compiled by Triton for the real device: apply against the torch twin on CUDA.

Run on a CUDA machine with the interpreter OFF (tests/conftest.py turns it on unless told otherwise):
    TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_gpu_kernels_cuda.py
Shapes are larger than the interpreter tests' and cover every M bucket of the launch configs, the
split-K path the default config picks for small M, and fp8_w8a8's torch._scaled_mm backend. Every
Triton kernel the registry runs on a GPU has cases here (tests/kernels/test_registry.py checks that
without a GPU): the linear kernels, marlin_fp4 (NVFP4 and MXFP4) and the fused expert-group
kernels; the per-expert loops (`<kernel>_experts`) call the linear kernels checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kernels import jit, launch
from kernels.base import FP4_GROUP_SIZE, Fp4Weight, LinearSpec
from kernels.codecs.fp4 import quantize_fp4
from kernels.registry import get_kernel
from kernels.targets import Target
from tests.helpers.numerics import rel_err
from tests.kernels import test_moe_kernels as moe
from tests.kernels.test_gpu_kernels import DTYPE_NAMES, DTYPES, GEMM_REL_TOL, Fp8Case, IntCase

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        jit.interpreter_enabled(),
        reason="TRITON_INTERPRET=1 would run the kernels in the CPU interpreter; set TRITON_INTERPRET=0",
    ),
]

MS = (1, 33, 200)  # the three M buckets of the dequant launch configs (compile time stays bounded)
INT_CASES = {
    "tile_lut4": [
        IntCase(1024, 2048, 4, 64, codebook="nf4"),  # bitsandbytes' blocksize
        IntCase(1000, 576, 4, 64, codebook="nf4"),  # N that no tile divides
    ],
    "marlin_wna16": [
        IntCase(1024, 2048, 4, 128),
        IntCase(768, 4096, 4, 128, symmetric=False, act_order=True),
        IntCase(1024, 1024, 8, -1),
        IntCase(512, 2048, 8, 32, act_order=True),
        IntCase(2048, 1024, 4, 64, symmetric=False),
    ],
    "gptq_wna16": [
        IntCase(1024, 2048, 4, 128),
        IntCase(1000, 2048, 4, 128, symmetric=False),  # N that Marlin refuses
        IntCase(768, 1536, 8, -1),
        IntCase(512, 2048, 2, 64, symmetric=False, act_order=True),
        IntCase(640, 1280, 4, 40),  # group not a power of two: per-row scale gather
        IntCase(1000, 576, 4, 32, symmetric=False, float_min=True),  # GGUF Q4_1 / Q4_K (SmolLM2's K)
        IntCase(768, 2048, 4, 32, symmetric=False, act_order=True, float_min=True),  # gathered minimums
        IntCase(1024, 2048, 6, 16),  # GGUF Q6_K: codes one per byte at the 8-bit midpoint
        IntCase(1000, 576, 5, 32, symmetric=False, float_min=True),  # GGUF Q5_K
    ],
    "tile_wna16": [
        IntCase(1024, 2048, 4, 128),
        IntCase(1000, 2048, 4, 128, symmetric=False),  # N that no tile divides
        IntCase(768, 1536, 8, -1),
        IntCase(512, 2048, 2, 64, symmetric=False),
        IntCase(1000, 576, 4, 32, symmetric=False, float_min=True),  # GGUF Q4_1 / Q4_K (SmolLM2's K)
        IntCase(2048, 1024, 4, 128, symmetric=False, act_order=True),  # K sorted by group, x gathered
        IntCase(1024, 2048, 6, 16),  # GGUF Q6_K
        IntCase(768, 2048, 6, 16, symmetric=False, float_min=True),  # Q4_K_M's joint qkv (Q4_K + Q6_K)
    ],
    "int8_w8a8": [  # its twin quantizes the activations per token as the kernel does
        IntCase(1024, 2048, 8, -1, int8_activations=True),
        IntCase(1000, 1000, 8, -1, int8_activations=True),  # K not a multiple of the K tile
    ],
}
FP8_CASES = {
    "fp8_w8a8": [
        Fp8Case(1536, 2048, "tensor", shard_sizes=(1024, 256, 256)),
        Fp8Case(1024, 4096, "channel"),
    ],
    "fp8_marlin": [
        Fp8Case(1536, 2048, "tensor", shard_sizes=(1024, 256, 256)),
        Fp8Case(1024, 4096, "channel"),
        Fp8Case(1024, 2048, "block", block_size=(128, 128)),
    ],
    "fp8_w8a16": [  # shapes fp8_marlin refuses (K = 576 like SmolLM2, N % 64, partial blocks)
        Fp8Case(1536, 576, "tensor", shard_sizes=(576, 480, 480)),
        Fp8Case(1000, 1000, "channel"),
        Fp8Case(960, 2000, "block", block_size=(128, 128)),
    ],
}


@dataclass(frozen=True)
class Fp4Case:
    n: int
    k: int
    fmt: str  # "nvfp4" | "mxfp4"
    bias: bool = False

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        return LinearSpec(
            name="model.layers.0.mlp.down_proj", scheme="fp4", n=self.n, k=self.k, bits=4,
            group_size=FP4_GROUP_SIZE[self.fmt], has_bias=self.bias, act_dtype=DTYPE_NAMES[dtype],
            fp4_format=self.fmt,  # type: ignore[arg-type]
        )  # fmt: skip

    def weight(self, dtype: torch.dtype) -> Fp4Weight:
        gen = torch.Generator().manual_seed(self.n + self.k)
        codes, scales, global_scale = quantize_fp4(torch.randn(self.n, self.k, generator=gen), self.fmt)  # type: ignore[arg-type]
        bias = torch.randn(self.n, generator=gen).to(dtype) if self.bias else None
        return Fp4Weight(codes, scales, self.fmt, global_scale, bias=bias)  # type: ignore[arg-type]


FP4_CASES = {
    "marlin_fp4": [
        Fp4Case(1024, 2048, "nvfp4", bias=True),
        Fp4Case(2048, 1024, "mxfp4"),
        Fp4Case(768, 4096, "nvfp4"),
        Fp4Case(1024, 1536, "mxfp4", bias=True),
    ],
    "tile_fp4": [  # MXFP4 at the even (bfloat16) positions: tile_fp4 refuses it in float16
        Fp4Case(1024, 2048, "nvfp4", bias=True),
        Fp4Case(4096, 1024, "nvfp4"),
        Fp4Case(2048, 1024, "mxfp4"),
        Fp4Case(1000, 2080, "nvfp4"),  # N and K that no tile divides
        Fp4Case(1000, 1504, "mxfp4", bias=True),
    ],
}
MOE_MS = (1, 33, 200)  # tokens routed top-k: rows per expert from one to several blocks
# fp8_moe_w8a8 re-quantizes silu(gate) * up per token to e4m3 after rounding it to the act dtype from
# fp32 accumulators summed in another order than the twin's: an element on a rounding boundary moves
# by one e4m3 step (2^-3 relative). H200, fp16, M=200: 5.2e-3 against MOE_REL_TOL's 4e-3.
FP8_MOE_W8A8_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
CUDA_CASES: dict[str, list[Any]] = {**INT_CASES, **FP8_CASES, **FP4_CASES}


def _needs_fp8_tensor_cores(name: str) -> None:
    if name in ("fp8_w8a8", "fp8_moe_w8a8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8_w8a8 needs sm89+")


def _cases() -> list[Any]:
    out = []
    for name, cases in CUDA_CASES.items():
        for i, case in enumerate(cases):  # dtypes alternate over a kernel's cases: both are covered
            dtype = DTYPES[i % 2]
            out.append(pytest.param(name, case, dtype, id=f"{name}-{case}-{dtype}"))
    return out


def _prepared_on_cuda(name: str, case: Any, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor], Any]:
    kernel = get_kernel(name)
    spec = case.spec(dtype)
    tensors = kernel.prepare(case.weight(dtype), spec, Target.SM90)
    return kernel, {k: t.cuda() for k, t in tensors.items()}, spec


@pytest.mark.parametrize(("name", "case", "dtype"), _cases())
def test_apply_matches_reference_on_cuda(name: str, case: Any, dtype: torch.dtype) -> None:
    _needs_fp8_tensor_cores(name)
    kernel, tensors, spec = _prepared_on_cuda(name, case, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in MS:
        x = torch.randn(m, spec.k, device="cuda", generator=gen).to(dtype)
        y = kernel.apply(x, tensors, spec)
        assert y.is_cuda and y.dtype == dtype and y.shape == (m, spec.n)
        err = rel_err(y, kernel.reference(x, tensors, spec))
        assert err < GEMM_REL_TOL[dtype], f"M={m}: relative error {err:.2e}"


@pytest.mark.parametrize("split_k", [1, 4])
def test_explicit_configs_on_cuda(split_k: int) -> None:
    from kernels.fp8_marlin import fp8_marlin_gemm
    from kernels.gptq_wna16 import gptq_wna16_float_min_gemm, gptq_wna16_gemm
    from kernels.marlin_wna16 import marlin_wna16_gemm

    cfg = launch.GemmConfig(block_m=32, block_n=128, block_k=64, split_k=split_k, num_stages=2)
    dtype = torch.bfloat16
    for name, case, fn in (
        ("gptq_wna16", INT_CASES["gptq_wna16"][1], gptq_wna16_gemm),
        ("gptq_wna16", INT_CASES["gptq_wna16"][5], gptq_wna16_float_min_gemm),
        ("marlin_wna16", INT_CASES["marlin_wna16"][1], marlin_wna16_gemm),
        ("fp8_marlin", FP8_CASES["fp8_marlin"][2], fp8_marlin_gemm),
    ):
        kernel, tensors, spec = _prepared_on_cuda(name, case, dtype)
        x = torch.randn(5, 7, spec.k, device="cuda").to(dtype)
        y = fn(x, tensors, spec, cfg)
        assert y.shape == (5, 7, spec.n)
        assert rel_err(y, kernel.reference(x, tensors, spec)) < GEMM_REL_TOL[dtype], name


def test_fp8_scaled_mm_backend_and_quant_bytes() -> None:
    _needs_fp8_tensor_cores("fp8_w8a8")
    from kernels.fp8_w8a8 import quantize_per_token, quantize_per_token_reference, scaled_mm_gemm

    x = torch.randn(37, 4096, device="cuda").to(torch.bfloat16)
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    for dtype in DTYPES:
        kernel, tensors, spec = _prepared_on_cuda("fp8_w8a8", FP8_CASES["fp8_w8a8"][1], dtype)
        xd = x.to(dtype)
        ref = kernel.reference(xd, tensors, spec)
        assert rel_err(scaled_mm_gemm(xd, tensors, spec), ref) < GEMM_REL_TOL[dtype]


@pytest.mark.parametrize(("name", "case", "dtype"), [
    pytest.param(name, case, dtype, id=f"{name}-{case}-{DTYPE_NAMES[dtype]}")
    for name, cases in moe.CASES.items()
    for case, dtype in zip(cases, [DTYPES[i % 2] for i in range(len(cases))], strict=True)
])  # fmt: skip
def test_fused_moe_matches_reference_on_cuda(name: str, case: Any, dtype: torch.dtype) -> None:
    _needs_fp8_tensor_cores(name)
    kernel, tensors_cpu, spec = moe.prepared(name, case, dtype)
    tensors = {k: t.cuda() for k, t in tensors_cpu.items()}
    gen = torch.Generator().manual_seed(11)
    for m in MOE_MS:
        x = torch.randn(m, moe.H, generator=gen).to(dtype)
        ids, weights = moe.routes(m, spec.top_k, spec.num_experts, gen)
        y = kernel.apply(x.cuda(), ids.cuda(), weights.cuda(), tensors, spec)
        assert y.is_cuda and y.dtype == dtype and y.shape == (m, moe.H)
        want = kernel.reference(x, ids, weights, tensors_cpu, spec)
        err = rel_err(y.cpu(), want)
        tol = (FP8_MOE_W8A8_REL_TOL if name == "fp8_moe_w8a8" else moe.MOE_REL_TOL)[dtype]
        assert err < tol, f"M={m}: relative error {err:.2e}"
