"""tile_fp4: Kiln's row-contiguous FP4 layout (the checkpoint's packed bytes as int32 words, block
scales as they are, the NVFP4 global per output row) bit-exact and exactly invertible, its refusals,
and the Triton kernel through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) against the
fp32 dequantized twin: the GEMV program, tensor-core tiles, K splits, ragged N and K."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.base import Fp4Weight, LinearSpec, Target
from kernels.codecs.fp4 import pack_fp4
from kernels.errors import LayoutError
from kernels.launch import GemmConfig
from kernels.registry import get_kernel
from kernels.tile_fp4 import TileFp4Kernel, tile_fp4_gemm
from tests.helpers.numerics import rel_err
from tests.kernels.test_marlin_fp4 import DTYPES, GEMM_REL_TOL, fp4_weight, spec_for

KERNEL = TileFp4Kernel()

# name -> (weight, act dtype); N and K off the 128-wide tiles where a case says so
CASES: dict[str, tuple[Fp4Weight, str]] = {
    "nvfp4-bf16-bias": (fp4_weight("nvfp4", 128, 256, 1, bias=True), "bfloat16"),
    "nvfp4-fp16": (fp4_weight("nvfp4", 64, 128, 2), "float16"),
    "nvfp4-bf16-ragged": (fp4_weight("nvfp4", 96, 208, 3, top=40.0), "bfloat16"),  # N % 64, K % 128
    "mxfp4-bf16-bias": (fp4_weight("mxfp4", 64, 256, 4, bias=True), "bfloat16"),
    "mxfp4-bf16-ragged": (fp4_weight("mxfp4", 80, 160, 5), "bfloat16"),
}
# (config, M): the GEMV program with and without K splits, tensor-core tiles with K splits
CONFIGS = (
    (GemmConfig(1, 32, 64, split_k=1), 1),
    (GemmConfig(1, 64, 32, split_k=4), 3),
    (GemmConfig(16, 32, 64, split_k=2), 5),
    (GemmConfig(16, 64, 128, split_k=1), 17),
)


def prepared(name: str) -> tuple[Fp4Weight, LinearSpec, dict[str, torch.Tensor]]:
    w, act = CASES[name]
    spec = spec_for(w, act)
    return w, spec, KERNEL.prepare(w, spec, Target.SM80)


def test_registered_after_the_marlin_bytes_only_for_kiln_layouts() -> None:
    assert get_kernel("tile_fp4").kiln_layout and Target.SM75 not in KERNEL.targets


@pytest.mark.parametrize("name", list(CASES))
def test_layout_is_the_checkpoint_bytes_and_inverts_exactly(name: str) -> None:
    w, spec, tensors = prepared(name)
    n, k = spec.n, spec.k
    assert tensors["qweight"].shape == (n, k // 8) and tensors["qweight"].dtype == torch.int32
    assert torch.equal(tensors["qweight"].view(torch.uint8), pack_fp4(w.codes))  # little-endian words
    assert torch.equal(tensors["scales"].view(torch.uint8), w.scales.view(torch.uint8))
    if w.fmt == "nvfp4":
        assert w.global_scale is not None
        assert torch.equal(tensors["global_scale"], w.global_scale.float().expand(n))
    assert {t: (v.shape, v.dtype) for t, v in tensors.items()} == {
        t: (s.shape, s.dtype) for t, s in KERNEL.stored_tensors(spec, Target.SM80).items()
    }
    back = KERNEL.stored_weight(tensors, spec)
    assert torch.equal(back.codes, w.codes) and torch.equal(
        back.scales.view(torch.uint8), w.scales.view(torch.uint8)
    )
    assert torch.equal(KERNEL.dequantize(tensors, spec), dataclasses.replace(w, bias=None).dequantize())


def test_fused_shards_keep_their_own_globals() -> None:
    """q/k/v-like shards with different NVFP4 globals: one multiplier per output row (Marlin FP4 refuses
    these), decoded back into the same shards."""
    base = fp4_weight("nvfp4", 128, 128, 6)
    w = dataclasses.replace(base, global_scale=torch.tensor([0.5, 0.125, 3.0]), shard_sizes=(64, 32, 32))
    spec = spec_for(w, "bfloat16", name="model.layers.0.self_attn.qkv_proj")
    tensors = KERNEL.prepare(w, spec, Target.SM90)
    assert torch.equal(tensors["global_scale"], torch.tensor([0.5] * 64 + [0.125] * 32 + [3.0] * 32))
    back = KERNEL.stored_weight(tensors, spec)
    assert back.shard_sizes == (64, 32, 32) and torch.equal(KERNEL.dequantize(tensors, spec), w.dequantize())
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert (
        rel_err(tile_fp4_gemm(x, tensors, spec), KERNEL.reference(x, tensors, spec)) < GEMM_REL_TOL[x.dtype]
    )


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_twin(name: str) -> None:
    _, spec, tensors = prepared(name)
    dtype = DTYPES[spec.act_dtype]
    gen = torch.Generator().manual_seed(7)
    for cfg, m in CONFIGS:
        x = torch.randn(m, spec.k, generator=gen).to(dtype)
        err = rel_err(tile_fp4_gemm(x, tensors, spec, cfg), KERNEL.reference(x, tensors, spec))
        assert err < GEMM_REL_TOL[dtype], (cfg, m, err)
    x = torch.randn(2, 1, spec.k, generator=gen).to(dtype)  # the bound layer at decode: (batch, 1, K)
    y = KERNEL.bind_apply(tensors, spec)(x)
    assert y.shape == (2, 1, spec.n) and rel_err(y, KERNEL.reference(x, tensors, spec)) < GEMM_REL_TOL[dtype]


def test_refusals() -> None:
    mx = spec_for(fp4_weight("mxfp4", 64, 128, 8), "float16")
    ok, reason = KERNEL.can_implement(mx, Target.SM80)
    assert not ok and "float16" in reason
    nv = spec_for(fp4_weight("nvfp4", 64, 128, 9), "bfloat16")
    ok, reason = KERNEL.can_implement(dataclasses.replace(nv, group_size=32), Target.SM80)
    assert not ok and "16 inputs" in reason
    ok, reason = KERNEL.can_implement(dataclasses.replace(nv, k=136), Target.SM80)
    assert not ok and "multiple" in reason
    w = fp4_weight("nvfp4", 64, 128, 10)
    w.scales[3, 2] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    with pytest.raises(LayoutError, match="NaN FP4 block scales"):
        KERNEL.prepare(w, nv, Target.SM80)
