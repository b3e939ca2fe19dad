"""What each kernel declares it takes as activations (`act_dtypes`, the host's check before serving)
is what it runs: every CPU kernel takes bf16, fp16 and fp32 and answers in the input's dtype; a GPU
layer takes the artifact's act dtype only."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.base import (
    CPU_ACT_DTYPES,
    DenseWeight,
    Fp4Weight,
    LinearKernel,
    LinearSpec,
    SourceWeight,
    Target,
)
from kernels.cpu_fp4 import CpuFp4Kernel
from kernels.cpu_fp8 import CpuFp8Kernel
from kernels.cpu_int4 import CpuInt4Kernel
from kernels.cpu_int8 import CpuInt8Kernel
from kernels.cpu_lut4 import CpuLut4Kernel
from kernels.cpu_w4a8 import CpuW4A8Kernel
from kernels.cpu_w8a8 import CpuW8A8Kernel
from kernels.dense import DenseKernel
from kernels.registry import candidates
from tests.helpers.numerics import rel_err
from tests.kernels.test_cpu_kernels import fp8_spec, fp8_weight, int_spec, int_weight

# Against the fp32 reference twin: the output's rounding (fp16 / bf16) plus the kernel's own inner
# dtype (bf16 int4 / fp8 paths), and W8A8's per-token int8 activation step.
REL_TOL = {torch.float32: 2e-2, torch.float16: 2e-2, torch.bfloat16: 3e-2}
N, K = 192, 576


def _dense() -> tuple[LinearKernel, SourceWeight, LinearSpec]:
    w = torch.randn(N, K) * 0.05
    spec = LinearSpec(name="model.layers.0.mlp.down_proj", scheme="dense", n=N, k=K)
    return DenseKernel(), DenseWeight(w), spec


Case = Callable[[], tuple[LinearKernel, SourceWeight, LinearSpec]]


def _int(bits: int, kernel: LinearKernel, **kw: object) -> Case:
    def make() -> tuple[LinearKernel, SourceWeight, LinearSpec]:
        w = int_weight(N, K, bits=bits, group_size=64 if bits == 4 else -1)
        return kernel, w, int_spec(w, **kw)

    return make


def _fp8() -> tuple[LinearKernel, SourceWeight, LinearSpec]:
    w = fp8_weight(N, K, "channel")
    return CpuFp8Kernel(), w, fp8_spec(w)


def _fp4() -> tuple[LinearKernel, SourceWeight, LinearSpec]:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(N, K // 16, generator=gen) * 0.01 + 0.001).to(torch.float8_e4m3fn)
    w = Fp4Weight(codes, scales, "nvfp4", torch.tensor([1.5]))
    spec = LinearSpec(
        name="model.layers.0.mlp.down_proj", scheme="fp4", n=N, k=K, bits=4, group_size=16, fp4_format="nvfp4"
    )
    return CpuFp4Kernel(), w, spec


def _lut4() -> tuple[LinearKernel, SourceWeight, LinearSpec]:
    w = int_weight(N, K, bits=4, group_size=64)
    w.codebook, w.scales = torch.linspace(-1, 1, 16), w.scales.float()  # a value table, fp32 absmax
    return CpuLut4Kernel(), w, int_spec(w, codebook="nf4")


CPU_CASES = {
    "dense": _dense,
    "cpu_int4": _int(4, CpuInt4Kernel()),
    "cpu_w4a8": _int(4, CpuW4A8Kernel(), int8_activations=True),
    "cpu_int8": _int(8, CpuInt8Kernel()),
    "cpu_w8a8": _int(8, CpuW8A8Kernel(), int8_activations=True),
    "cpu_fp8": _fp8,
    "cpu_fp4": _fp4,
    "cpu_lut4": _lut4,
}


def test_every_cpu_kernel_is_covered() -> None:
    assert {kernel.name for kernel in candidates(Target.CPU)} == set(CPU_CASES)


@pytest.mark.parametrize("dtype", sorted(CPU_ACT_DTYPES, key=str))
@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_a_cpu_kernel_runs_every_activation_dtype_it_declares(case: str, dtype: torch.dtype) -> None:
    kernel, weight, spec = CPU_CASES[case]()
    assert kernel.act_dtypes(spec, Target.CPU) == CPU_ACT_DTYPES
    tensors = kernel.prepare(weight, spec, Target.CPU)
    run = kernel.bind_apply(tensors, spec)
    x = torch.randn(5, K).to(dtype)
    y = run(x)
    assert y.dtype == dtype and y.shape == (5, N)
    reference = kernel.reference(x.float(), tensors, spec)
    assert rel_err(y.float(), reference) < REL_TOL[dtype]


@pytest.mark.parametrize("act_dtype", ["bfloat16", "float16"])
def test_a_gpu_layer_takes_the_artifacts_act_dtype_only(act_dtype: str) -> None:
    spec = fp8_spec(fp8_weight(N, K, "channel"), act_dtype)
    for kernel in candidates(Target.SM80):
        assert kernel.act_dtypes(spec, Target.SM80) == {getattr(torch, act_dtype)}, kernel.name
