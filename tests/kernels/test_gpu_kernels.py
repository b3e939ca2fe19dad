"""The GPU kernels (marlin_wna16, gptq_wna16, fp8_w8a8, int8_w8a8, fp8_marlin) on CPU through the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): layouts exact, apply against its torch
twin, and can_implement refusals. Shapes are small; the CUDA repeats live in test_gpu_kernels_cuda.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kernels import fp8_w8a8, jit, launch
from kernels.base import Fp8Weight, IntWeight, LinearSpec, ShardSpec, Target
from kernels.codecs.fp8 import quantize_fp8
from kernels.errors import LayoutError
from tests.helpers.numerics import rel_err

# apply vs its reference twin (relative Frobenius error). The twin dequantizes to fp32 and multiplies
# in fp32; the kernel rounds the dequantized weight to the act dtype before the tensor-core dot (on
# GPU) and rounds the output to the act dtype: bf16 keeps 8 significant bits (half-ulp 2^-9 rms-ish),
# fp16 keeps 11.
GEMM_REL_TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3}
# fp8_w8a8 against unquantized fp32 activations: per-token e4m3 activation rounding (3 mantissa bits,
# relative error <= 2^-4 per element, averaging down over K).
FP8_ACT_QUANT_REL_TOL = 6e-2
# int8_w8a8 against unquantized fp32 activations: a rounding step of amax / 127.5 per token (Gaussian
# rows: ≈ 2.6 sigma / 127.5, uniform error, averaging down over K).
INT8_ACT_QUANT_REL_TOL = 2e-2
# FP8 scales cast to the act dtype (fp8_marlin): per-element relative error <= half an ulp.
FP8_SCALE_CAST_REL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

DTYPES = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class IntCase:
    n: int
    k: int
    bits: int
    group_size: int
    symmetric: bool = True
    act_order: bool = False
    int8_activations: bool = False
    float_min: bool = False  # w = q * s + m with a float minimum per group (GGUF Q4_1 / Q4_K)
    codebook: str = ""  # w = table[q] * s (bitsandbytes NF4: the table is its quant_map, s fp32 absmax)

    def spec(self, dtype: torch.dtype, *, k_full: int = 0, row_parallel: bool = False) -> LinearSpec:
        return LinearSpec(
            name="model.layers.0.mlp.down_proj",
            scheme="int",
            n=self.n,
            k=self.k,
            k_full=k_full,
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            act_order=self.act_order,
            row_parallel=row_parallel,
            has_bias=True,
            act_dtype=DTYPE_NAMES[dtype],
            int8_activations=self.int8_activations,
            float_zeros=self.float_min,
            codebook=self.codebook,
        )

    def weight(self, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> IntWeight:
        gen = torch.Generator().manual_seed(seed)
        n, k, bits = self.n, self.k, self.bits
        groups = 1 if self.group_size == -1 else k // self.group_size
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
        # scales sized so that the dequantized weight has unit-ish rms
        scales = (torch.rand(groups, n, generator=gen) + 0.5) * (2.0 / (1 << bits))
        zeros = (
            None
            if self.symmetric or self.float_min
            else torch.randint(0, 1 << bits, (groups, n), generator=gen, dtype=torch.uint8)
        )
        # a minimum about 8 steps below zero, as Q4_1 / Q4_K put it for a group spanning zero
        mins = -(torch.rand(groups, n, generator=gen) * 8 + 4) * scales if self.float_min else None
        g_idx = None
        if self.act_order:
            g_idx = (torch.randperm(k, generator=gen) // self.group_size).to(torch.int32)
        bias = torch.randn(n, generator=gen)
        if self.codebook:  # NF4's normal-quantile table, an absmax of unit-ish weights
            table = torch.erfinv(torch.linspace(-0.9, 0.9, 1 << bits, dtype=torch.float64)).float()
            return IntWeight(codes, scales * 4, bits, self.group_size, bias=bias.to(dtype), codebook=table)
        return IntWeight(
            codes=codes,
            scales=scales.to(dtype),
            bits=bits,
            group_size=self.group_size,
            zeros=zeros,
            g_idx=g_idx,
            bias=bias.to(dtype),
            mins=None if mins is None else mins.to(dtype),
        )


@dataclass(frozen=True)
class Fp8Case:
    n: int
    k: int
    strategy: str
    shard_sizes: tuple[int, ...] = ()
    block_size: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def spec(self, dtype: torch.dtype) -> LinearSpec:
        return LinearSpec(
            name="model.layers.0.self_attn.qkv_proj",
            scheme="fp8",
            n=self.n,
            k=self.k,
            bits=8,
            fp8_strategy=self.strategy,  # type: ignore[arg-type]
            block_size=self.block_size,
            has_bias=True,
            act_dtype=DTYPE_NAMES[dtype],
            shards=tuple(ShardSpec(f"shard{i}", s) for i, s in enumerate(self.shard_sizes)),
        )

    def dense(self, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(self.n, self.k, generator=gen) * 0.05
        if self.shard_sizes:  # shards with different ranges, so their per-tensor scales differ
            w = torch.cat([p * (i + 1) for i, p in enumerate(torch.split(w, list(self.shard_sizes)))])
        w[0, :8] = 1e-5  # a few values that land on e4m3 subnormals
        return w

    def weight(self, dtype: torch.dtype, seed: int = 0) -> Fp8Weight:
        fw = quantize_fp8(
            self.dense(seed),
            self.strategy,  # type: ignore[arg-type]
            block_size=self.block_size or (128, 128),
            shard_sizes=self.shard_sizes,
        )
        fw.bias = torch.randn(self.n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        return fw


# --------------------------------------------------------------------------------------------
# Cases. Each GEMM case runs both dtypes; the M values alternate so that every kernel sees
# M in {1, 7, 16, 33} with both bf16 and fp16 across its shapes without a full cross product.
# --------------------------------------------------------------------------------------------

M_BY_PARITY = ((1, 16), (7, 33))

GPTQ_CASES = [
    IntCase(128, 256, 4, 64),
    IntCase(96, 384, 4, 32, symmetric=False),  # N not a multiple of 64 (Marlin refuses it)
    IntCase(192, 384, 8, -1),
    IntCase(128, 256, 2, 128, symmetric=False, act_order=True),
    IntCase(64, 320, 4, 40, symmetric=False),  # group not a multiple of 16: per-row scale gather
    IntCase(64, 256, 8, 64, symmetric=False, act_order=True),
    IntCase(100, 384, 4, 32, symmetric=False, float_min=True),  # N % 8: minimums are not packed
    IntCase(64, 320, 4, 40, symmetric=False, float_min=True),  # per-element scale and minimum gather
    IntCase(128, 256, 4, 64, symmetric=False, act_order=True, float_min=True),
]
TILE_CASES = [
    IntCase(128, 256, 4, 64),
    IntCase(96, 384, 4, 32, symmetric=False),  # N not a multiple of the N tile
    IntCase(192, 384, 8, -1),
    IntCase(64, 256, 2, 128, symmetric=False),
    IntCase(100, 384, 4, 32, symmetric=False, float_min=True),  # GGUF Q4_1 / Q4_K
    IntCase(192, 384, 4, 128, symmetric=False, act_order=True),  # K stored sorted by group
    IntCase(128, 256, 8, 64, act_order=True),
]
MARLIN_CASES = [
    IntCase(128, 256, 4, 64),
    IntCase(192, 384, 4, 128, symmetric=False, act_order=True),
    IntCase(128, 256, 8, -1),
    IntCase(192, 384, 8, 32, act_order=True),
    IntCase(64, 128, 4, 128, symmetric=False),  # group == K: the single scale permutation
]
FP8_W8A8_CASES = [
    Fp8Case(128, 256, "tensor", shard_sizes=(64, 32, 32)),
    Fp8Case(192, 384, "channel"),
    Fp8Case(96, 272, "tensor"),
]
INT8_W8A8_CASES = [
    IntCase(128, 256, 8, -1, int8_activations=True),
    IntCase(96, 272, 8, -1, int8_activations=True),  # K not a multiple of the 128-wide K tile
]
FP8_MARLIN_CASES = [
    Fp8Case(128, 256, "tensor", shard_sizes=(64, 32, 32)),
    Fp8Case(192, 384, "channel"),
    Fp8Case(192, 384, "block", block_size=(128, 128)),
    Fp8Case(128, 256, "block", block_size=(64, 64)),
]


def kernel(name: str) -> Any:
    from kernels.registry import get_kernel

    return get_kernel(name)


def gemm_params() -> list[Any]:
    params = []
    for name, cases in (
        ("gptq_wna16", GPTQ_CASES),
        ("tile_wna16", TILE_CASES),
        ("marlin_wna16", MARLIN_CASES),
        ("fp8_w8a8", FP8_W8A8_CASES),
        ("int8_w8a8", INT8_W8A8_CASES),
        ("fp8_marlin", FP8_MARLIN_CASES),
    ):
        for i, case in enumerate(cases):
            for j, dtype in enumerate(DTYPES):
                ms = M_BY_PARITY[(i + j) % 2]
                params.append(pytest.param(name, case, dtype, ms, id=f"{name}-{case}-{DTYPE_NAMES[dtype]}"))
    return params


def prepared(name: str, case: IntCase | Fp8Case, dtype: torch.dtype) -> tuple[Any, dict, LinearSpec, Any]:
    k = kernel(name)
    spec = case.spec(dtype)
    w = case.weight(dtype)
    return k, k.prepare(w, spec, Target.SM90), spec, w


# --------------------------------------------------------------------------------------------
# apply vs reference twin
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "case", "dtype", "ms"), gemm_params())
def test_apply_matches_reference(name: str, case: Any, dtype: torch.dtype, ms: tuple[int, ...]) -> None:
    k, tensors, spec, _ = prepared(name, case, dtype)
    gen = torch.Generator().manual_seed(7)
    for m in ms:
        x = torch.randn(m, spec.k, generator=gen).to(dtype)
        y = k.apply(x, tensors, spec)
        assert y.shape == (m, spec.n) and y.dtype == dtype
        err = rel_err(y, k.reference(x, tensors, spec))
        assert err < GEMM_REL_TOL[dtype], f"M={m}: relative error {err:.2e}"


@pytest.mark.parametrize(
    ("name", "case", "tol"),
    [
        ("fp8_w8a8", FP8_W8A8_CASES[1], FP8_ACT_QUANT_REL_TOL),
        ("int8_w8a8", INT8_W8A8_CASES[0], INT8_ACT_QUANT_REL_TOL),
    ],
)
def test_w8a8_close_to_unquantized_activations(name: str, case: Any, tol: float) -> None:
    """Per-token activation quantization (e4m3, or int8 with a step of amax / 127.5) against fp32
    activations on the same dequantized weight."""
    k, tensors, spec, w = prepared(name, case, torch.bfloat16)
    x = torch.randn(16, spec.k).to(torch.bfloat16)
    expected = x.float() @ w.dequantize().T + w.bias.float()
    assert rel_err(k.apply(x, tensors, spec), expected) < tol


def test_fp8_per_token_quant_bytes_match_torch() -> None:
    from kernels.fp8_w8a8 import quantize_per_token, quantize_per_token_reference

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0, 0.0])[:, None]
    x[4, :50] = 1e-7  # next to the row max these land on e4m3 subnormals / zero
    for dtype in DTYPES:
        xd = x.to(dtype)
        q, s = quantize_per_token(xd)
        q_ref, s_ref = quantize_per_token_reference(xd)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_int8_per_token_quant_bytes_match_torch() -> None:
    from kernels.codecs.int8 import quantize_per_token_int8
    from kernels.int8_w8a8 import quantize_per_token

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0, 0.0])[:, None]
    x[1, :4] = torch.tensor([0.5, -0.5, 1.5, -2.5]) * x[1].abs().max() / 127.5  # halves: to even
    for dtype in DTYPES:
        xd = x.to(dtype)
        q, s = quantize_per_token(xd)
        q_ref, s_ref = quantize_per_token_int8(xd)
        assert torch.equal(s, s_ref)
        assert torch.equal(q, q_ref)
    assert torch.equal(q_ref[5], torch.zeros(200, dtype=torch.int8))  # an all-zero row stays zero


@pytest.mark.parametrize("name", ["fp8_w8a8", "int8_w8a8"])
def test_prologue_quantization_is_the_separate_kernels(name: str) -> None:
    """Up to FUSED_QUANT_MAX_M rows the W8A8 GEMM quantizes activations in its prologue: the same
    output, bit for bit, as the separate per-token quantization kernel then the GEMM, at every K split
    (each program takes the whole row's max |x|), rows of very different magnitude and a zero row."""
    from kernels.fp8_w8a8 import FUSED_QUANT_MAX_M

    k, tensors, spec, _ = prepared(
        name, (FP8_W8A8_CASES if name == "fp8_w8a8" else INT8_W8A8_CASES)[1], torch.bfloat16
    )
    gen = torch.Generator().manual_seed(5)
    for m, cfg in (
        (1, launch.GemmConfig(16, 64, 64, split_k=1)),
        (5, launch.GemmConfig(16, 32, 64, split_k=2)),
        (FUSED_QUANT_MAX_M, launch.GemmConfig(16, 64, 32, split_k=4)),
    ):
        x = torch.randn(m, spec.k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
        x[-1] = 0.0
        x = x.to(torch.bfloat16)
        fused = fp8_w8a8.token_scaled_gemm(x, k.quantize, tensors, spec, cfg, kernel=name, fused=True)
        apart = fp8_w8a8.token_scaled_gemm(x, k.quantize, tensors, spec, cfg, kernel=name, fused=False)
        assert torch.equal(fused, apart), (m, cfg)
        assert rel_err(fused, k.reference(x, tensors, spec)) < GEMM_REL_TOL[torch.bfloat16]


def test_split_k_and_batched_input() -> None:
    from kernels.fp8_marlin import fp8_marlin_gemm
    from kernels.fp8_w8a8 import fp8_w8a8_gemm
    from kernels.gptq_wna16 import gptq_wna16_gemm
    from kernels.int8_w8a8 import quantize_per_token as int8_quantize
    from kernels.marlin_wna16 import marlin_wna16_gemm
    from kernels.tile_wna16 import tile_wna16_gemm

    def int8_gemm(x: torch.Tensor, tensors: dict, spec: LinearSpec, cfg: Any) -> torch.Tensor:
        return fp8_w8a8.token_scaled_gemm(x, int8_quantize, tensors, spec, cfg, kernel="int8_w8a8")

    cfg = launch.GemmConfig(block_m=16, block_n=64, block_k=64, split_k=2)
    dtype = torch.float16
    for name, case, fn in (
        ("gptq_wna16", GPTQ_CASES[1], gptq_wna16_gemm),
        ("marlin_wna16", MARLIN_CASES[1], marlin_wna16_gemm),
        ("tile_wna16", TILE_CASES[1], tile_wna16_gemm),
        ("fp8_w8a8", FP8_W8A8_CASES[0], fp8_w8a8_gemm),
        ("int8_w8a8", INT8_W8A8_CASES[1], int8_gemm),
        ("fp8_marlin", FP8_MARLIN_CASES[2], fp8_marlin_gemm),
    ):
        k, tensors, spec, _ = prepared(name, case, dtype)
        x = torch.randn(2, 3, spec.k).to(dtype)
        y = fn(x, tensors, spec, cfg)
        assert y.shape == (2, 3, spec.n)
        assert rel_err(y, k.reference(x, tensors, spec)) < GEMM_REL_TOL[dtype], name


@pytest.mark.parametrize("case", [TILE_CASES[0], TILE_CASES[1], TILE_CASES[4]], ids=str)
def test_tile_gemv_program_and_k_splits(case: IntCase) -> None:
    """tile_wna16's GEMV program (BLOCK_M 1, one row per program, multiply and reduce) and its
    tensor-core tiles, with and without K splits, against the twin; the bound layer as the runtime
    calls it (the GEMV program at M = 1)."""
    from kernels.tile_wna16 import tile_wna16_gemm

    dtype = torch.bfloat16
    k, tensors, spec, _ = prepared("tile_wna16", case, dtype)
    gen = torch.Generator().manual_seed(3)
    for cfg, m in (
        (launch.GemmConfig(1, 32, 64, split_k=1), 1),
        (launch.GemmConfig(1, 64, 32, split_k=4), 3),
        (launch.GemmConfig(16, 32, 32, split_k=2), 5),
    ):
        x = torch.randn(m, spec.k, generator=gen).to(dtype)
        err = rel_err(tile_wna16_gemm(x, tensors, spec, cfg), k.reference(x, tensors, spec))
        assert err < GEMM_REL_TOL[dtype], (cfg, err)
    x = torch.randn(1, spec.k, generator=gen).to(dtype)
    assert rel_err(k.bind_apply(tensors, spec)(x), k.reference(x, tensors, spec)) < GEMM_REL_TOL[dtype]


def test_tile_stored_tensors_are_rows_packed_along_k() -> None:
    """qweight (N, K // pf): row n's codes in standard packing along K; zero points unpacked uint8."""
    from kernels.codecs.bitpack import pack_cols

    case = TILE_CASES[1]  # 4-bit asymmetric g32
    k, tensors, spec, w = prepared("tile_wna16", case, torch.float16)
    assert tensors["qweight"].shape == (case.n, case.k // 8) and tensors["qweight"].dtype == torch.int32
    assert torch.equal(tensors["qweight"], pack_cols(w.codes, 4))
    row, col = 5, 37  # code of (n, k) in bits [4 * (k % 8), ...) of word k // 8 of row n
    word = int(tensors["qweight"][row, col // 8]) & 0xFFFFFFFF
    assert (word >> (4 * (col % 8))) & 0xF == int(w.codes[row, col])
    assert w.zeros is not None and torch.equal(tensors["zeros"], w.zeros)
    assert set(tensors) == set(k.stored_tensors(spec, Target.SM80))


def test_tile_act_order_sorts_k_by_group() -> None:
    """Act-order: qweight's column j holds input channel perm[j], perm sorting the channels by group,
    so each K block lies in one group and the stored scales stay (G, N); the stored weight decodes
    back to the checkpoint's order and g_idx."""
    case = TILE_CASES[5]
    k, tensors, spec, w = prepared("tile_wna16", case, torch.bfloat16)
    assert w.g_idx is not None
    perm = tensors["perm"].long()
    assert torch.equal(w.g_idx.long()[perm], torch.arange(case.k) // case.group_size)
    from kernels.codecs.bitpack import pack_cols

    assert torch.equal(tensors["qweight"], pack_cols(w.codes[:, perm], 4))
    back = k.stored_int_weight(tensors, spec)
    assert back is not None and torch.equal(back.codes, w.codes)
    assert back.g_idx is not None and torch.equal(back.g_idx.long(), w.g_idx.long())
    assert torch.equal(back.dequantize(), w.dequantize())


def test_tile_refusals() -> None:
    k = kernel("tile_wna16")
    act_order = IntCase(128, 256, 4, 64, act_order=True)
    assert k.can_implement(act_order.spec(torch.bfloat16), Target.SM80)[0]
    ok, reason = k.can_implement(act_order.spec(torch.bfloat16, k_full=512, row_parallel=True), Target.SM80)
    assert not ok and "act-order" in reason and "split over ranks" in reason
    uneven = act_order.weight(torch.bfloat16)
    assert uneven.g_idx is not None
    uneven.g_idx[:2] = torch.tensor([1, 1], dtype=uneven.g_idx.dtype)  # group 0 short of 2 channels
    with pytest.raises(LayoutError, match="does not give every group 64 channels"):
        k.prepare(uneven, act_order.spec(torch.bfloat16), Target.SM80)
    ok, reason = k.can_implement(IntCase(64, 320, 4, 40).spec(torch.bfloat16), Target.SM80)
    assert not ok and "group size 40" in reason
    ok, reason = k.can_implement(IntCase(64, 256, 4, 64).spec(torch.bfloat16), Target.SM75)
    assert not ok and "float16" in reason
    ok, reason = k.can_implement(IntCase(64, 256, 3, 64).spec(torch.bfloat16), Target.SM80)
    assert not ok and "bits" in reason


def test_apply_falls_back_to_reference_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k, tensors, spec, _ = prepared("gptq_wna16", GPTQ_CASES[0], torch.bfloat16)
    x = torch.randn(3, spec.k).to(torch.bfloat16)
    assert not jit.runs_triton(x)
    assert torch.equal(k.apply(x, tensors, spec), k.reference(x, tensors, spec))


# --------------------------------------------------------------------------------------------
# Layouts: exact for integer formats, bounded for FP8
# --------------------------------------------------------------------------------------------


INT_LAYOUT_CASES = (("gptq_wna16", GPTQ_CASES), ("tile_wna16", TILE_CASES), ("marlin_wna16", MARLIN_CASES))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int_layouts_round_trip_exactly(dtype: torch.dtype) -> None:
    for name, cases in INT_LAYOUT_CASES:
        for case in cases:
            k, tensors, spec, w = prepared(name, case, dtype)
            assert torch.equal(k.dequantize(tensors, spec), w.dequantize()), (name, case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int_layouts_give_back_the_source_int_weight(dtype: torch.dtype) -> None:
    """`stored_int_weight` (what verification compares code for code) is the source weight: codes
    in source row order, zero points, group of every input channel, scales cast to the act dtype."""
    for name, cases in INT_LAYOUT_CASES:
        for case in cases:
            k, tensors, spec, w = prepared(name, case, dtype)
            got = k.stored_int_weight(tensors, spec)
            assert torch.equal(got.codes, w.codes) and got.bits == w.bits, (name, case)
            assert (got.zeros is None) == (w.zeros is None), (name, case)
            assert got.zeros is None or torch.equal(got.zeros, w.zeros), (name, case)
            assert (got.mins is None) == (w.mins is None), (name, case)
            assert got.mins is None or torch.equal(got.mins, w.mins.to(dtype)), (name, case)
            assert torch.equal(got.group_index(), w.group_index()), (name, case)
            assert torch.equal(got.scales, w.scales.to(dtype)), (name, case)
            assert torch.equal(got.dequantize(), k.dequantize(tensors, spec)), (name, case)


def test_gptq_stored_tensors() -> None:
    from kernels.codecs.bitpack import pack_cols, pack_rows

    case = GPTQ_CASES[3]  # 2-bit asymmetric act-order
    _, tensors, _, w = prepared("gptq_wna16", case, torch.float16)
    assert tensors["qweight"].shape == (case.k * case.bits // 32, case.n)
    assert torch.equal(tensors["qweight"], pack_rows(w.codes.T, case.bits))
    assert torch.equal(tensors["qzeros"], pack_cols(w.zeros, case.bits))
    assert torch.equal(tensors["g_idx"], w.g_idx)
    assert tensors["scales"].dtype == torch.float16


def test_marlin_stored_tensors_are_vllm_layout() -> None:
    from kernels.codecs.bitpack import pack_rows
    from kernels.marlin_layout import marlin_permute_scales, marlin_repack, marlin_zero_points, sort_g_idx

    case = MARLIN_CASES[1]  # 4-bit asymmetric act-order
    _, tensors, _, w = prepared("marlin_wna16", case, torch.bfloat16)
    g_sorted, perm = sort_g_idx(w.g_idx)
    assert torch.equal(tensors["perm"], perm) and torch.equal(tensors["g_idx"], g_sorted)
    assert torch.equal(tensors["qweight"], marlin_repack(pack_rows(w.codes.T, 4), 4, perm))
    assert tensors["qweight"].shape == (case.k // 16, case.n * 2)
    assert torch.equal(tensors["scales"], marlin_permute_scales(w.scales, case.k, case.n, case.group_size))
    assert torch.equal(tensors["zeros"], marlin_zero_points(w.zeros, 4))
    assert tensors["zeros"].shape == (case.k // case.group_size, case.n // 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_marlin_closed_form_matches_repack(bits: int) -> None:
    """The index arithmetic the Triton kernel uses, evaluated in torch, against marlin_repack."""
    from kernels.codecs.bitpack import pack_rows
    from kernels.marlin_layout import marlin_permute_scales, marlin_repack

    kk, nn = 64, 192
    codes = torch.randint(0, 1 << bits, (kk, nn), dtype=torch.uint8)
    packed = marlin_repack(pack_rows(codes, bits), bits).view(-1)
    k = torch.arange(kk)[:, None]
    n = torch.arange(nn)[None, :]
    if bits == 4:
        col = 128 * (n // 64) + 16 * (n % 8) + (n % 64) // 16 + 4 * ((k % 8) // 2)
        shift = 8 * ((n % 16) // 8) + 4 * ((k % 16) // 8 + 4 * (k % 2))
    else:
        col = 256 * (n // 64) + 32 * (n % 8) + 2 * ((n % 64) // 16) + (n % 16) // 8 + 8 * ((k % 8) // 2)
        shift = 8 * ((k % 16) // 8 + 2 * (k % 2)) + 0 * n
    words = packed[(k // 16) * (nn * bits // 2) + col].long()
    assert torch.equal(((words >> shift) & ((1 << bits) - 1)).to(torch.uint8), codes)

    s = torch.arange(2 * nn, dtype=torch.float32).reshape(2, nn)
    n1 = torch.arange(nn)
    grouped = marlin_permute_scales(s, 128, nn, 64)
    assert torch.equal(grouped[:, 64 * (n1 // 64) + 8 * (n1 % 8) + (n1 % 64) // 8], s)
    single = marlin_permute_scales(s[:1], 128, nn, -1)
    pos = 32 * (n1 // 32) + 8 * ((n1 % 8) // 2) + 2 * ((n1 % 32) // 8) + n1 % 2
    assert torch.equal(single[:, pos], s[:1])


@pytest.mark.parametrize("name", ["marlin_wna16", "gptq_wna16"])
def test_act_order_row_parallel_keeps_all_groups(name: str) -> None:
    """Row-parallel rank 1 of 2 with act-order: its 256 channels name groups of the full K=512, and
    the scales of all 8 groups (g64) are kept on the rank (vLLM's marlin_repeat_scales_on_all_ranks)."""
    gen = torch.Generator().manual_seed(5)
    n, k, k_full, group = 128, 256, 512, 64
    g_full = (torch.randperm(k_full, generator=gen) // group).to(torch.int32)
    w = IntWeight(
        codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(k_full // group, n, generator=gen) * 0.1 + 0.05).to(torch.float16),
        bits=4,
        group_size=group,
        zeros=torch.randint(0, 16, (k_full // group, n), generator=gen, dtype=torch.uint8),
        g_idx=g_full[k:],
    )
    case = IntCase(n, k, 4, group, symmetric=False, act_order=True)
    spec = case.spec(torch.float16, k_full=k_full, row_parallel=True)
    kern = kernel(name)
    assert kern.can_implement(spec, Target.SM90) == (True, "")
    tensors = kern.prepare(w, spec, Target.SM90)
    assert tensors["scales"].shape == (k_full // group, n)
    assert torch.equal(kern.dequantize(tensors, spec), w.dequantize())
    x = torch.randn(7, k, generator=gen).to(torch.float16)
    assert (
        rel_err(kern.apply(x, tensors, spec), kern.reference(x, tensors, spec)) < GEMM_REL_TOL[torch.float16]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_w8a8_layout(dtype: torch.dtype) -> None:
    k = kernel("fp8_w8a8")
    channel, fused = FP8_W8A8_CASES[1], FP8_W8A8_CASES[0]
    w = channel.weight(dtype)
    tensors = k.prepare(w, channel.spec(dtype), Target.SM90)
    assert tensors["weight"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (channel.n,)
    assert torch.equal(k.dequantize(tensors, channel.spec(dtype)), w.dequantize())
    # Fused per-tensor shards are requantized to the max scale: each element moves by at most half
    # an e4m3 step at the new scale (relative 2^-4 for normals, 2^-10 * scale for subnormals) plus
    # the fp16 round trip vLLM's requantize goes through (2^-11 relative).
    w = fused.weight(dtype)
    tensors = k.prepare(w, fused.spec(dtype), Target.SM90)
    assert tensors["weight_scale"].shape == (1,)
    max_s = w.scale.max()
    assert torch.equal(tensors["weight_scale"], max_s.reshape(1))
    got, want = k.dequantize(tensors, fused.spec(dtype)), w.dequantize()
    bound = (2.0**-4 + 2.0**-10) * want.abs() + 2.0**-10 * max_s
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_marlin_layout(dtype: torch.dtype) -> None:
    from kernels.codecs.bitpack import pack_rows
    from kernels.fp8_marlin import EXPONENT_BIAS
    from kernels.marlin_layout import marlin_permute_scales, marlin_repack

    k = kernel("fp8_marlin")
    for case in FP8_MARLIN_CASES:
        spec = case.spec(dtype)
        w = case.weight(dtype)
        tensors = k.prepare(w, spec, Target.SM90)
        raw = w.weight.view(torch.uint8)
        assert torch.equal(tensors["qweight"], marlin_repack(pack_rows(raw.T, 8), 8))
        assert tensors["qweight"].shape == (case.k // 16, 4 * case.n)
        assert tensors["scales"].dtype == dtype
        got, want = k.dequantize(tensors, spec), w.dequantize()
        assert bool(((got - want).abs() <= FP8_SCALE_CAST_REL[dtype] * want.abs()).all()), case
    # the exponent bias is folded in: channel scales are (1, N), permuted, times 2^8 / 2^120
    case = FP8_MARLIN_CASES[1]
    w = case.weight(dtype)
    tensors = k.prepare(w, case.spec(dtype), Target.SM90)
    s = w.scale.to(dtype).reshape(1, -1)
    expected = marlin_permute_scales(s, case.k, case.n, -1) * torch.full_like(s, 2.0) ** EXPONENT_BIAS[dtype]
    assert torch.equal(tensors["scales"], expected)


# --------------------------------------------------------------------------------------------
# can_implement
# --------------------------------------------------------------------------------------------


def test_marlin_refusals() -> None:
    from kernels.base import Target

    k = kernel("marlin_wna16")
    bf16 = torch.bfloat16
    assert k.can_implement(IntCase(128, 256, 4, 64).spec(bf16), Target.SM80) == (True, "")
    refusals = [
        (IntCase(96, 256, 4, 64).spec(bf16), Target.SM90, "N=96"),
        (IntCase(128, 192, 4, 64).spec(bf16), Target.SM90, "K=192"),
        (IntCase(128, 256, 4, 64).spec(bf16), Target.SM75, "gptq_wna16"),
        (IntCase(128, 256, 2, 64).spec(bf16), Target.SM80, "4- and 8-bit"),
        (IntCase(128, 256, 8, 64, symmetric=False).spec(bf16), Target.SM80, "zero points only for 4-bit"),
        (IntCase(128, 256, 4, 256).spec(bf16), Target.SM80, "group_size=256"),
        (IntCase(128, 256, 4, 64).spec(bf16), Target.CPU, "cpu"),
    ]
    # row-parallel: K per rank 384 with group 256 of a K_full 768 would straddle ranks
    refusals.append((IntCase(128, 384, 4, 128).spec(bf16, k_full=768), Target.SM80, None))
    for spec, target, needle in refusals:
        ok, reason = k.can_implement(spec, target)
        if needle is None:
            assert ok, reason
            continue
        assert not ok and needle in reason, (spec, target, reason)
    fp32 = IntCase(128, 256, 4, 64).spec(torch.bfloat16)
    fp32 = LinearSpec.from_json({**fp32.to_json(), "act_dtype": "float32"})
    ok, reason = k.can_implement(fp32, Target.SM90)
    assert not ok and "float32" in reason


def test_gptq_refusals() -> None:
    from kernels.base import Target

    k = kernel("gptq_wna16")
    assert k.can_implement(IntCase(96, 384, 4, 32, symmetric=False).spec(torch.float16), Target.SM75)[0]
    cases = [
        (IntCase(128, 256, 3, 64).spec(torch.float16), Target.SM80, "3-bit"),
        (IntCase(128, 256, 4, 64).spec(torch.bfloat16), Target.SM75, "float16"),
        (IntCase(128, 256, 4, 64).spec(torch.float16), Target.CPU, "cpu"),
        (IntCase(128, 260, 4, 64).spec(torch.float16), Target.SM80, "K per rank = 260"),
        (IntCase(100, 256, 4, 64, symmetric=False).spec(torch.float16), Target.SM80, "N per rank = 100"),
    ]
    for spec, target, needle in cases:
        ok, reason = k.can_implement(spec, target)
        assert not ok and needle in reason, reason


def test_fp8_refusals() -> None:
    from kernels.base import Target

    w8a8, marlin = kernel("fp8_w8a8"), kernel("fp8_marlin")
    tensor = FP8_W8A8_CASES[0].spec(torch.bfloat16)
    block = FP8_MARLIN_CASES[2].spec(torch.bfloat16)
    assert w8a8.can_implement(tensor, Target.SM89) == (True, "")
    ok, reason = w8a8.can_implement(tensor, Target.SM80)
    assert not ok and "fp8_marlin" in reason
    ok, reason = w8a8.can_implement(block, Target.SM90)
    assert not ok and "block" in reason
    assert marlin.can_implement(block, Target.SM90) == (True, "")
    ok, reason = marlin.can_implement(tensor, Target.SM75)
    assert not ok and "sm75" in reason
    ok, reason = marlin.can_implement(Fp8Case(96, 256, "channel").spec(torch.float16), Target.SM86)
    assert not ok and "N=96" in reason
    ok, reason = marlin.can_implement(IntCase(128, 256, 4, 64).spec(torch.float16), Target.SM86)
    assert not ok and "scheme" in reason


def test_registry_picks_these_kernels() -> None:
    from kernels.base import Target
    from kernels.registry import choose_kernel

    int4 = IntCase(128, 256, 4, 64).spec(torch.float16)
    assert choose_kernel(int4, Target.SM90).kernel.name == "marlin_wna16"
    assert choose_kernel(int4, Target.SM75).kernel.name == "gptq_wna16"
    odd = IntCase(96, 256, 4, 64).spec(torch.float16)
    choice = choose_kernel(odd, Target.SM86)
    assert choice.kernel.name == "gptq_wna16"
    assert any(name == "marlin_wna16" and "N=96" in why for name, why in choice.rejected)
    fp8 = FP8_W8A8_CASES[1].spec(torch.bfloat16)
    assert choose_kernel(fp8, Target.SM90).kernel.name == "fp8_w8a8"
    assert choose_kernel(fp8, Target.SM80).kernel.name == "fp8_marlin"


@pytest.mark.slow
def test_kernels_compile_for_cuda_targets() -> None:
    """Ahead-of-time compile (no GPU needed) for sm80/sm89/sm90 with the default launch configs,
    shared memory within each arch's limit: catches what the interpreter cannot (types, layouts)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "gpu_check.py"), "--compile-only", "--quick"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "compile check: 0 failure(s)" in proc.stdout


def test_fp8_marlin_fused_layer_with_one_online_scale() -> None:
    """Online FP8 quantizes a fused layer with one per-tensor scale and no shard sizes."""
    from kernels.base import ShardSpec

    k = kernel("fp8_marlin")
    w = quantize_fp8(torch.randn(192, 256) * 0.05, "tensor")
    assert w.scale.numel() == 1 and not w.shard_sizes
    spec = LinearSpec(
        name="model.layers.0.self_attn.qkv_proj",
        scheme="fp8",
        n=192,
        k=256,
        bits=8,
        fp8_strategy="tensor",
        act_dtype="bfloat16",
        shards=(ShardSpec("q", 128), ShardSpec("k", 32), ShardSpec("v", 32)),
    )
    tensors = k.prepare(w, spec, Target.SM90)
    got, want = k.dequantize(tensors, spec), w.dequantize()
    assert bool(((got - want).abs() <= FP8_SCALE_CAST_REL[torch.bfloat16] * want.abs()).all())


# --------------------------------------------------------------------------------------------
# Float minimums (GGUF Q4_1 / Q4_K: w = q * s + m) on gptq_wna16
# --------------------------------------------------------------------------------------------

GGUF_GROUP = 32


def gguf_like(n: int, k: int, kind: str, seed: int = 0) -> IntWeight:
    """A weight quantized as llama.cpp does Q4_1 (per 32: d = (max - min) / 15, m = min, q = round((w -
    m) / d), d and m fp16) or, for "q4_k", with fp32 d and m and a few groups of scale 0 that keep
    their minimum (a Q4_K sub-block whose 6-bit scale is 0). The first n // 8 rows are narrow groups
    far from zero, where |m| / d is in the hundreds (m's rounding, not d's, dominates)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[: n // 8] = 1.0 + torch.randn(n // 8, k, generator=gen) * 0.002
    g = w.reshape(n, k // GGUF_GROUP, GGUF_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    dtype = torch.float16 if kind == "q4_1" else torch.float32
    d, m = ((hi - lo) / 15).to(dtype), lo.to(dtype)  # (N, G)
    if kind == "q4_k":
        d[n // 2, :2] = 0.0
    q = ((g - m.float()[..., None]) / d.float().clamp_min(1e-30)[..., None]).round().clamp(0, 15)
    return IntWeight(
        codes=q.reshape(n, k).to(torch.uint8),
        scales=d.T.contiguous(),
        bits=4,
        group_size=GGUF_GROUP,
        bias=torch.randn(n, generator=gen).to(torch.bfloat16),
        mins=m.T.contiguous(),
    )


def gguf_spec(n: int, k: int, dtype: torch.dtype) -> LinearSpec:
    return IntCase(n, k, 4, GGUF_GROUP, symmetric=False, float_min=True).spec(dtype)


@pytest.mark.parametrize("kind", ["q4_1", "q4_k"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
def test_float_minimum_gemm_matches_the_fp32_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    """The Triton GEMM (the per-K-block path, (x @ q) s + rowsum(x) m, and split-K) against x @ W.T in
    fp32 on the source's own dequantization: the gap is the act-dtype rounding of x, s, m and y."""
    from kernels.gptq_wna16 import gptq_wna16_float_min_gemm

    n, k = 100, 576  # SmolLM2's K; N not a multiple of 8
    w = gguf_like(n, k, kind)
    spec = gguf_spec(n, k, dtype)
    kern = kernel("gptq_wna16")
    tensors = kern.prepare(w, spec, Target.SM80)
    assert set(tensors) == {"qweight", "scales", "mins", "bias"}
    gen = torch.Generator().manual_seed(3)
    configs = (None, launch.GemmConfig(block_m=16, block_n=64, block_k=64, split_k=3))
    for m, cfg in zip((1, 33), configs, strict=True):
        x = torch.randn(m, k, generator=gen).to(dtype)
        want = x.float() @ w.dequantize().T + w.bias.float()  # type: ignore[union-attr]
        y = kern.apply(x, tensors, spec) if cfg is None else gptq_wna16_float_min_gemm(x, tensors, spec, cfg)
        assert y.dtype == dtype and y.shape == (m, n)
        err = rel_err(y, want)
        assert err < GEMM_REL_TOL[dtype], f"{kind} M={m}: relative error {err:.2e}"


def test_float_minimum_layout_and_refusals() -> None:
    from kernels.errors import LayoutError
    from kernels.registry import choose_kernel

    gptq, marlin = kernel("gptq_wna16"), kernel("marlin_wna16")
    spec = gguf_spec(100, 576, torch.bfloat16)
    assert gptq.can_implement(spec, Target.SM80) == (True, "")
    ok, reason = marlin.can_implement(gguf_spec(128, 576, torch.bfloat16), Target.SM90)
    assert not ok and "integer zero points only" in reason
    choice = choose_kernel(gguf_spec(128, 512, torch.bfloat16), Target.SM90)
    assert choice.kernel.name == "gptq_wna16"
    assert any(name == "marlin_wna16" and "integer zero points only" in why for name, why in choice.rejected)
    stored = gptq.stored_tensors(spec, Target.SM80)
    assert set(stored) == {"qweight", "scales", "mins", "bias"}  # no qzeros
    assert (stored["mins"].shape, stored["mins"].dtype) == ((576 // GGUF_GROUP, 100), torch.bfloat16)
    three_bit = IntCase(128, 256, 3, 32, symmetric=False, float_min=True).spec(torch.float16)
    ok, reason = gptq.can_implement(three_bit, Target.SM80)
    assert not ok and "3-bit" in reason
    ok, reason = gptq.can_implement(gguf_spec(128, 256, torch.bfloat16), Target.SM75)
    assert not ok and "float16" in reason
    w = gguf_like(100, 576, "q4_1")
    asym = IntCase(100, 576, 4, GGUF_GROUP, symmetric=False).spec(torch.bfloat16)  # integer zero points
    with pytest.raises(LayoutError, match="float minimum"):
        gptq.prepare(w, asym, Target.SM80)


def test_float_minimum_layout_verifies_within_its_rounding_allowance() -> None:
    """The converter's check of this layout (services/convert/verify.py): fp16 activations keep Q4_1's
    fp16 d and m as they are ("exact"); bf16 rounds both, which moves narrow groups far from zero by
    more than INT_STEP_BOUND steps, so the check allows |m| / d * MIN_ROUNDING_REL steps; a code off
    by one is still a whole step and fails."""
    from services.convert.verify import INT_STEP_BOUND, compare, compare_int_stored

    gptq = kernel("gptq_wna16")
    w = gguf_like(96, 256, "q4_1")
    for dtype in DTYPES:
        spec = gguf_spec(96, 256, dtype)
        tensors = gptq.prepare(w, spec, Target.SM80)
        exact = compare_int_stored(gptq.stored_int_weight(tensors, spec), w, dtype)
        got = gptq.dequantize(tensors, spec)
        check = compare(got, w, dtype)
        assert check.ok, (dtype, check)
        if dtype == torch.float16:
            assert exact is not None and exact.metric == check.metric == "exact"
            continue
        assert exact is None and check.metric == "max_step_err"  # rounded minimums are never "exact"
        step = w.scales.float().repeat_interleave(GGUF_GROUP, 0).T
        assert float(((got - w.dequantize()).abs() / step).max()) > INT_STEP_BOUND  # the allowance is needed
        row, col = 90, 7  # a group spanning zero: |m| / d about 8
        off = got.clone()
        off[row, col] += float(w.scales[col // GGUF_GROUP, row])
        assert not compare(off, w, dtype).ok


@pytest.mark.slow
def test_float_minimum_kernel_compiles_for_cuda_targets() -> None:
    """Ahead-of-time compile of `_float_min_kernel` (bench/gpu_check.py's compile matrix covers the
    integer-zero kernel only) for sm75 (fp16) / sm80 / sm90 at the decode and prefill tile configs,
    per-K-block and gathered scales, shared memory within each arch's limit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys
sys.argv.append("--compile-only")
from bench.gpu_check import SMEM_LIMIT, compile_kernel
from kernels import gptq_wna16
from kernels.launch import cuda_block_config, fit_to_groups
for arch, act in ((75, "fp16"), (80, "bf16"), (90, "bf16")):
    sig = {n: f"*{act}" for n in ("X", "S", "MINS", "BIAS", "Y")}
    sig |= {"QW": "*i32", "GIDX": "*i32", "M": "i32", "N": "i32", "K": "i32", "group_size": "i32"}
    for m in (1, 256):
        for act_order in (False, True):
            cfg, per_block = fit_to_groups(cuda_block_config(m), 32, act_order=act_order)
            consts = dict(BITS=4, ACT_ORDER=act_order, PER_BLOCK_SCALE=per_block, HAS_BIAS=True,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          SPLIT_K=2 if m == 1 else 1, BF16_INTERP=False)
            smem = compile_kernel(gptq_wna16._float_min_kernel(), sig, consts, arch, cfg.num_warps,
                                  cfg.num_stages)
            assert smem <= SMEM_LIMIT[86 if arch == 80 else arch], (arch, m, act_order, smem)
print("compiled")
"""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
