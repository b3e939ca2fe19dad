"""The fused expert-group kernels (marlin_moe_wna16, fp8_moe_w8a8, fp8_moe_w8a16, fp8_marlin_moe) on CPU
through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1): apply against the torch twin
for every variant, routes that leave experts without tokens, expert parallelism, the route sort, the stacked
layouts (Marlin bytes per expert against the independent reference, FP8 requantization per expert),
can_implement refusals and the registry's choice. Shapes are small (H = 256, I = 128: Marlin needs
N % 64 == 0 and K % 128 == 0 per expert); each apply is two interpreted grouped GEMM launches.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kernels.base import Fp8Weight, IntWeight, LinearSpec, ShardSpec, StoredTensor, Target
from kernels.codecs.fp8 import quantize_fp8, requantize_to_max_scale
from kernels.moe import align, fused
from kernels.moe_base import MoEKernel, MoESpec, expert_slices, routed_sum
from tests.helpers.numerics import rel_err
from tests.kernels import reference_layouts as ref

# apply vs its twin (relative Frobenius error). Two chained GEMMs: each rounds its output to the act
# dtype (and, on a GPU, its dequantized weights before the tensor-core dot), silu(gate) * up is
# rounded to the act dtype in between and every routed row once more before the top-k sum: about
# 1.5x the single-GEMM tolerance of test_gpu_kernels.py (bf16 1.2e-2, fp16 2e-3).
MOE_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
# fp8_moe_w8a8 against the unquantized-activation twin (MoEKernel.expert_twin): two per-token e4m3
# activation roundings in the chain (x, then silu * up), each <= 2^-4 relative per element
# (one GEMM: FP8_ACT_QUANT_REL_TOL = 6e-2 in test_gpu_kernels.py; two compound to about sqrt(2)x).
MOE_FP8_ACT_QUANT_REL_TOL = 8e-2

DTYPES = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
H, INTER = 256, 128  # hidden, intermediate per expert: w13 (2 INTER, H), w2 (H, INTER)
# Each (variant, dtype) runs a prefill of 33 tokens and one of these (alternating): decode and a
# small batch, so every kernel sees M in {1, 7, 33} with both dtypes.
M_ALTERNATES = (1, 7)


def kernel(name: str) -> Any:
    from kernels.registry import get_moe_kernel

    return get_moe_kernel(name)


def moe_spec(
    w13: LinearSpec,
    w2: LinearSpec,
    *,
    num_experts: int,
    top_k: int,
    first_expert: int = 0,
    total_experts: int = 0,
) -> MoESpec:
    return MoESpec(
        name="model.layers.1.mlp.experts",
        num_experts=num_experts,
        top_k=top_k,
        w13=w13,
        w2=w2,
        first_expert=first_expert,
        total_experts=total_experts,
    )


def stack(per_expert: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.stack([p[name] for p in per_expert]) for name in per_expert[0]}


def routes(
    tokens: int, top_k: int, experts: list[int] | int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, k) distinct expert ids per token drawn from `experts` (a list of ids or range(n)), and
    routing weights."""
    pool = torch.tensor(experts if isinstance(experts, list) else list(range(experts)))
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=gen)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntMoECase:
    bits: int
    group_size: int
    symmetric: bool = True
    act_order: bool = False
    num_experts: int = 4
    top_k: int = 2

    def linear(self, part: str, n: int, k: int, dtype: torch.dtype) -> LinearSpec:
        return LinearSpec(
            name=f"model.layers.1.mlp.experts.{part}",
            scheme="int",
            n=n,
            k=k,
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            act_order=self.act_order,
            act_dtype=DTYPE_NAMES[dtype],
            shards=(ShardSpec("gate_proj", n // 2), ShardSpec("up_proj", n // 2)) if part == "w13" else (),
        )

    def spec(self, dtype: torch.dtype, **kw: Any) -> MoESpec:
        kw.setdefault("num_experts", self.num_experts)
        return moe_spec(
            self.linear("w13", 2 * INTER, H, dtype),
            self.linear("w2", H, INTER, dtype),
            top_k=self.top_k,
            **kw,
        )

    def weight(self, n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> IntWeight:
        """Codes, scales sized for an O(1) output per O(1) input row, zero points, act-order g_idx."""
        bits = self.bits
        groups = 1 if self.group_size == -1 else k // self.group_size
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(groups, n, generator=gen) + 0.5) * (2.0 / (1 << (bits - 1)) / k**0.5)
        zeros = None if self.symmetric else torch.randint(0, 1 << bits, (groups, n), generator=gen)
        g_idx = None
        if self.act_order:
            g_idx = (torch.randperm(k, generator=gen) // self.group_size).to(torch.int32)
        return IntWeight(
            codes=codes,
            scales=scales.to(dtype),
            bits=bits,
            group_size=self.group_size,
            zeros=None if zeros is None else zeros.to(torch.uint8),
            g_idx=g_idx,
        )

    def w13(self, dtype: torch.dtype, gen: torch.Generator) -> IntWeight:
        """gate (INTER, H) and up (INTER, H) quantized separately, fused gate rows first (vLLM's w13)."""
        gate, up = self.weight(INTER, H, dtype, gen), self.weight(INTER, H, dtype, gen)
        return IntWeight(
            codes=torch.cat([gate.codes, up.codes]),
            scales=torch.cat([gate.scales, up.scales], dim=1),
            bits=self.bits,
            group_size=self.group_size,
            zeros=None if gate.zeros is None else torch.cat([gate.zeros, up.zeros], dim=1),  # type: ignore[list-item]
            g_idx=gate.g_idx,  # one input-channel order per expert for the fused gate|up
        )


@dataclass(frozen=True)
class Fp8MoECase:
    strategy: str
    block_size: tuple[int, int] | None = None
    num_experts: int = 4
    top_k: int = 2

    def linear(self, part: str, n: int, k: int, dtype: torch.dtype) -> LinearSpec:
        return LinearSpec(
            name=f"model.layers.1.mlp.experts.{part}",
            scheme="fp8",
            n=n,
            k=k,
            bits=8,
            fp8_strategy=self.strategy,  # type: ignore[arg-type]
            block_size=self.block_size,
            act_dtype=DTYPE_NAMES[dtype],
            shards=(ShardSpec("gate_proj", n // 2), ShardSpec("up_proj", n // 2)) if part == "w13" else (),
        )

    def spec(self, dtype: torch.dtype, **kw: Any) -> MoESpec:
        kw.setdefault("num_experts", self.num_experts)
        return moe_spec(
            self.linear("w13", 2 * INTER, H, dtype),
            self.linear("w2", H, INTER, dtype),
            top_k=self.top_k,
            **kw,
        )

    def quantize(self, w: torch.Tensor, shard_sizes: tuple[int, ...] = ()) -> Fp8Weight:
        return quantize_fp8(
            w,
            self.strategy,  # type: ignore[arg-type]
            block_size=self.block_size or (128, 128),
            shard_sizes=shard_sizes if self.strategy == "tensor" else (),
        )

    def w13(self, dtype: torch.dtype, gen: torch.Generator) -> Fp8Weight:
        """gate|up with different ranges (per-tensor: two shard scales that differ)."""
        gate = torch.randn(INTER, H, generator=gen) / H**0.5
        up = torch.randn(INTER, H, generator=gen) * (2.5 / H**0.5)
        return self.quantize(torch.cat([gate, up]), (INTER, INTER))

    def w2(self, dtype: torch.dtype, gen: torch.Generator) -> Fp8Weight:
        return self.quantize(torch.randn(H, INTER, generator=gen) / INTER**0.5)


MARLIN_CASES = [
    IntMoECase(4, -1, num_experts=4, top_k=1),  # channelwise: the single scale permutation
    IntMoECase(4, 64, num_experts=8, top_k=2),
    IntMoECase(4, 128, symmetric=False, num_experts=4, top_k=2),  # w2: group == K, single perm
    IntMoECase(4, 64, symmetric=False, act_order=True, num_experts=8, top_k=1),
    IntMoECase(8, -1, num_experts=8, top_k=2),
    IntMoECase(8, 32, act_order=True, num_experts=4, top_k=2),
]
FP8_W8A8_CASES = [
    Fp8MoECase("tensor", num_experts=8, top_k=2),
    Fp8MoECase("channel", num_experts=4, top_k=1),
]
FP8_W8A16_CASES = [
    Fp8MoECase("tensor", num_experts=4, top_k=2),
    Fp8MoECase("channel", num_experts=8, top_k=1),
    Fp8MoECase("block", block_size=(64, 64), num_experts=8, top_k=2),
]
FP8_MARLIN_CASES = [
    Fp8MoECase("tensor", num_experts=4, top_k=2),
    Fp8MoECase("channel", num_experts=8, top_k=1),
    Fp8MoECase("block", block_size=(64, 64), num_experts=8, top_k=2),
]
CASES = {
    "marlin_moe_wna16": MARLIN_CASES,
    "fp8_moe_w8a8": FP8_W8A8_CASES,
    "fp8_moe_w8a16": FP8_W8A16_CASES,
    "fp8_marlin_moe": FP8_MARLIN_CASES,
}
EP_CASES = {
    "marlin_moe_wna16": MARLIN_CASES[1],
    "fp8_moe_w8a8": FP8_W8A8_CASES[0],
    "fp8_moe_w8a16": FP8_W8A16_CASES[0],
    "fp8_marlin_moe": FP8_MARLIN_CASES[2],
}
# the GPU each fused kernel is tested for (sm90 unless it does not run there)
KERNEL_TARGET = {"fp8_marlin_moe": Target.SM80}


def prepared(
    name: str, case: IntMoECase | Fp8MoECase, dtype: torch.dtype, *, seed: int = 0, **spec_kw: Any
) -> tuple[Any, dict[str, torch.Tensor], MoESpec]:
    """The kernel, its stacked tensors (prepare_expert per expert, stacked) and the spec."""
    k = kernel(name)
    spec = case.spec(dtype, **spec_kw)
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(spec.num_experts):
        w13 = case.w13(dtype, gen)
        w2 = case.weight(H, INTER, dtype, gen) if isinstance(case, IntMoECase) else case.w2(dtype, gen)
        experts.append(k.prepare_expert(w13, w2, spec, KERNEL_TARGET.get(name, Target.SM90)))
    return k, stack(experts), spec


def apply_params() -> list[Any]:
    params = []
    for name, cases in CASES.items():
        for i, case in enumerate(cases):
            for j, dtype in enumerate(DTYPES):
                ms = (M_ALTERNATES[(i + j) % 2], 33)
                params.append(pytest.param(name, case, dtype, ms, id=f"{name}-{case}-{DTYPE_NAMES[dtype]}"))
    return params


def u8(t: torch.Tensor) -> torch.Tensor:
    """FP8 bytes (torch.equal has no float8 kernel on CPU)."""
    return t.contiguous().view(torch.uint8)


def check(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol: float, what: str) -> None:
    assert y.shape == expected.shape and y.dtype == dtype, what
    err = rel_err(y, expected)
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"


# --------------------------------------------------------------------------------------------
# apply vs the twin
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "case", "dtype", "ms"), apply_params())
def test_apply_matches_reference(name: str, case: Any, dtype: torch.dtype, ms: tuple[int, ...]) -> None:
    k, tensors, spec = prepared(name, case, dtype)
    assert k.can_implement(spec, KERNEL_TARGET.get(name, Target.SM90)) == (True, "")
    gen = torch.Generator().manual_seed(7)
    for m in ms:
        x = torch.randn(m, H, generator=gen).to(dtype)
        ids, weights = routes(m, spec.top_k, spec.num_experts, gen)
        y = k.apply(x, ids, weights, tensors, spec)
        check(y, k.reference(x, ids, weights, tensors, spec), dtype, MOE_REL_TOL[dtype], f"M={m}")


def test_experts_without_tokens() -> None:
    """Prefill routed to 3 of 8 experts (and decode to 2): the others' blocks never run."""
    dtype = torch.float16
    for name, case in (("marlin_moe_wna16", MARLIN_CASES[1]), ("fp8_moe_w8a16", FP8_W8A16_CASES[2])):
        k, tensors, spec = prepared(name, case, dtype)
        gen = torch.Generator().manual_seed(3)
        for m, used in ((33, [1, 4, 6]), (1, [0, 7])):
            x = torch.randn(m, H, generator=gen).to(dtype)
            ids, weights = routes(m, 2, used, gen)
            y = k.apply(x, ids, weights, tensors, spec)
            check(y, k.reference(x, ids, weights, tensors, spec), dtype, MOE_REL_TOL[dtype], f"{name} M={m}")


def test_fp8_w8a8_close_to_unquantized_activations() -> None:
    """The twin quantizes activations per token as apply does; against unquantized activations
    (MoEKernel's twin: the dequantized experts in fp32) the error is the two e4m3 activation roundings."""
    dtype = torch.bfloat16
    k, tensors, spec = prepared("fp8_moe_w8a8", FP8_W8A8_CASES[0], dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, H, generator=gen).to(dtype)
    ids, weights = routes(16, spec.top_k, spec.num_experts, gen)
    y = k.apply(x, ids, weights, tensors, spec)
    unquantized = routed_sum(x, ids, weights, spec, MoEKernel.expert_twin(k, tensors, spec))
    check(y, unquantized, dtype, MOE_FP8_ACT_QUANT_REL_TOL, "vs unquantized activations")


@pytest.mark.parametrize("name", list(EP_CASES))
def test_expert_parallel_ranks_sum_to_the_layer(name: str) -> None:
    """12 experts split over 3 ranks of 4 (first_expert 0 / 4 / 8): each rank adds only its experts'
    share (ids outside its range contribute nothing), and the ranks' outputs sum to the whole layer."""
    dtype = torch.float16
    case = EP_CASES[name]
    assert case.top_k == 2
    k, tensors, spec = prepared(name, case, dtype, num_experts=12)
    gen = torch.Generator().manual_seed(11)
    m = 7
    x = torch.randn(m, H, generator=gen).to(dtype)
    ids, weights = routes(m, 2, 12, gen)
    ids[0] = torch.tensor([9, 10])  # token 0: no expert on rank 0
    total = torch.zeros(m, H)
    for rank in range(3):
        first = 4 * rank
        rank_spec = case.spec(dtype, num_experts=4, first_expert=first, total_experts=12)
        rank_tensors = {n: t[first : first + 4] for n, t in tensors.items()}
        y = k.apply(x, ids, weights, rank_tensors, rank_spec)
        check(y, k.reference(x, ids, weights, rank_tensors, rank_spec), dtype, MOE_REL_TOL[dtype], f"{rank}")
        if rank == 0:
            assert torch.equal(y[0], torch.zeros(H, dtype=dtype))
        total += y.float()
    check(
        total, k.reference(x, ids, weights, tensors, spec).float(), torch.float32, MOE_REL_TOL[dtype], "sum"
    )


def test_routes_all_on_other_ranks_add_nothing() -> None:
    case = MARLIN_CASES[0]
    k, tensors, spec = prepared("marlin_moe_wna16", case, torch.bfloat16, first_expert=4, total_experts=8)
    x = torch.randn(5, H).to(torch.bfloat16)
    ids = torch.tensor([[0], [1], [2], [3], [3]])
    y = k.apply(x, ids, torch.ones(5, 1), tensors, spec)
    assert torch.equal(y, torch.zeros(5, H, dtype=torch.bfloat16))


def test_worst_case_sized_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA route sort (no host sync: grid sized for the worst case, trailing blocks -1) gives
    the same result: the kernels skip the empty blocks."""
    exact = align.moe_align_block_size
    monkeypatch.setattr(fused, "moe_align_block_size", functools.partial(exact, exact_size=False))
    dtype = torch.float16
    for name in CASES:
        k, tensors, spec = prepared(name, CASES[name][0], dtype)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(3, H, generator=gen).to(dtype)
        ids, weights = routes(3, spec.top_k, spec.num_experts, gen)
        y = k.apply(x, ids, weights, tensors, spec)
        check(y, k.reference(x, ids, weights, tensors, spec), dtype, MOE_REL_TOL[dtype], name)


def test_bind_apply_equals_apply() -> None:
    dtype = torch.bfloat16
    k, tensors, spec = prepared("marlin_moe_wna16", MARLIN_CASES[5], dtype)
    run = k.bind_apply(tensors, spec)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, H, generator=gen).to(dtype)
    ids, weights = routes(7, spec.top_k, spec.num_experts, gen)
    assert torch.equal(run(x, ids, weights), k.apply(x, ids, weights, tensors, spec))


def test_apply_falls_back_to_reference_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name in CASES:
        k, tensors, spec = prepared(name, CASES[name][0], torch.bfloat16)
        x = torch.randn(3, H).to(torch.bfloat16)
        ids, weights = routes(3, spec.top_k, spec.num_experts, torch.Generator().manual_seed(0))
        assert not fused.runs_triton(x)
        assert torch.equal(
            k.apply(x, ids, weights, tensors, spec), k.reference(x, ids, weights, tensors, spec)
        )


# --------------------------------------------------------------------------------------------
# The route sort (vLLM's moe_align_block_size)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exact_size", [True, False])
def test_moe_align_block_size(exact_size: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, top_k, block_m, first, num = 21, 2, 4, 2, 5  # global ids 0..8, this rank 2..6
    ids = torch.stack([torch.randperm(9, generator=gen)[:top_k] for _ in range(tokens)])
    r = align.moe_align_block_size(ids, block_m, first, num, exact_size=exact_size)
    slots = tokens * top_k
    assert r.num_slots == slots and r.top_k == top_k and r.block_m == block_m
    assert r.sorted_ids.dtype == torch.int32 and r.block_experts.dtype == torch.int32
    assert r.sorted_ids.numel() == r.num_blocks * block_m
    flat = ids.reshape(-1)
    counts = [int((flat == first + e).sum()) for e in range(num)]
    used_blocks = sum(-(-c // block_m) for c in counts)
    if exact_size:
        assert r.num_blocks == used_blocks
    else:
        assert r.num_blocks >= used_blocks and bool((r.block_experts[used_blocks:] == -1).all())
    seen: list[int] = []
    for b in range(r.num_blocks):
        rows = r.sorted_ids[b * block_m : (b + 1) * block_m].tolist()
        e = int(r.block_experts[b])
        real = [s for s in rows if s != slots]
        if e < 0:
            assert not real
            continue
        assert all(int(flat[s]) == first + e for s in real), "a block holds one expert's slots"
        assert rows == real + [slots] * (len(rows) - len(real)), "padding at the end of an expert's run"
        seen += real
    # every local slot exactly once, each expert's slots in token order, experts in order
    expected = [s for e in range(num) for s in range(slots) if int(flat[s]) == first + e]
    assert seen == expected


# --------------------------------------------------------------------------------------------
# Layouts: stacked per expert, exactly the linear kernel's bytes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [MARLIN_CASES[0], MARLIN_CASES[3], MARLIN_CASES[5]], ids=str)
def test_marlin_moe_bytes_match_per_expert_reference(case: IntMoECase) -> None:
    """Each expert's slices are vLLM's gptq_marlin_repack / marlin_permute_scales / marlin_zero_points
    of that expert (= gptq_marlin_moe_repack / marlin_moe_permute_scales), checked bit for bit
    against the element-by-element reference construction of tests/kernels/reference_layouts.py."""
    dtype = torch.bfloat16
    k = kernel("marlin_moe_wna16")
    spec = case.spec(dtype, num_experts=2)
    gen = torch.Generator().manual_seed(1)
    weights = [(case.w13(dtype, gen), case.weight(H, INTER, dtype, gen)) for _ in range(2)]
    tensors = stack([k.prepare_expert(w13, w2, spec, Target.SM80) for w13, w2 in weights])
    declared = k.stored_tensors(spec, Target.SM80)
    assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == {
        n: (t.shape, t.dtype) for n, t in declared.items()
    }
    for e, (w13, w2) in enumerate(weights):
        for part, w, linear in (("w13", w13, spec.w13), ("w2", w2, spec.w2)):
            got = expert_slices(tensors, part, e)
            perm = None
            if case.act_order:
                assert w.g_idx is not None
                perm = torch.argsort(w.g_idx.long(), stable=True)
                assert torch.equal(got["perm"], perm.to(torch.int32))
                assert torch.equal(got["g_idx"], w.g_idx[perm])
            codes_kn = w.codes.T.contiguous()  # (K, N)
            assert torch.equal(got["qweight"], ref.ref_marlin_repack(codes_kn, case.bits, perm)), (part, e)
            assert torch.equal(got["scales"], ref.ref_permute_scales(w.scales, linear.k, case.group_size))
            if not case.symmetric:
                assert w.zeros is not None
                assert torch.equal(got["zeros"], ref.ref_marlin_zero_points(w.zeros, case.bits))
            assert set(got) == {n.split(".", 1)[1] for n in declared if n.startswith(part + ".")}
        # w13 is gate rows then up rows, exactly the checkpoint's values
        d13, d2 = k.dequantize_expert(tensors, spec, e)
        assert torch.equal(d13, w13.dequantize()) and torch.equal(d2, w2.dequantize())


def test_marlin_moe_layout_is_stacked_marlin_wna16() -> None:
    """The registry's marlin_wna16_experts and marlin_moe_wna16 declare and write the same tensors."""
    case = MARLIN_CASES[3]
    spec = case.spec(torch.float16, num_experts=2)
    fused, stacked = kernel("marlin_moe_wna16"), kernel("marlin_wna16_experts")
    assert fused.based_on == "marlin_wna16" and fused.layout_version == stacked.layout_version
    assert fused.stored_tensors(spec, Target.SM90) == stacked.stored_tensors(spec, Target.SM90)
    gen = torch.Generator().manual_seed(2)
    w13, w2 = case.w13(torch.float16, gen), case.weight(H, INTER, torch.float16, gen)
    a, b = (
        fused.prepare_expert(w13, w2, spec, Target.SM90),
        stacked.prepare_expert(w13, w2, spec, Target.SM90),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_fp8_w8a8_moe_requantizes_each_experts_shards_to_its_max_scale() -> None:
    """vLLM's Fp8MoEMethod (per-tensor): each expert's gate and up scales are replaced by their max
    and both shards requantized to it (requantize_with_max_scale per expert); w2 keeps its scale."""
    dtype = torch.bfloat16
    case = FP8_W8A8_CASES[0]
    k = kernel("fp8_moe_w8a8")
    spec = case.spec(dtype, num_experts=2)
    gen = torch.Generator().manual_seed(6)
    weights = [(case.w13(dtype, gen), case.w2(dtype, gen)) for _ in range(2)]
    tensors = stack([k.prepare_expert(w13, w2, spec, Target.SM90) for w13, w2 in weights])
    assert tensors["w13.weight_scale"].shape == (2, 1) and tensors["w2.weight_scale"].shape == (2, 1)
    for e, (w13, w2) in enumerate(weights):
        assert w13.scale.numel() == 2 and w13.scale[0] != w13.scale[1]
        q, max_s = ref.ref_requantize(w13.weight, w13.scale.tolist(), [INTER, INTER])
        assert float(tensors["w13.weight_scale"][e, 0]) == max_s == float(w13.scale.max())
        assert torch.equal(u8(tensors["w13.weight"][e]), u8(q))
        assert torch.equal(u8(tensors["w13.weight"][e]), u8(requantize_to_max_scale(w13).weight))
        assert torch.equal(u8(tensors["w2.weight"][e]), u8(w2.weight))
        assert torch.equal(tensors["w2.weight_scale"][e], w2.scale.reshape(1))
    # online FP8 (a bf16 checkpoint quantized whole per expert): one scale already, bytes kept
    online = quantize_fp8(torch.randn(2 * INTER, H, generator=gen), "tensor")
    one = k.prepare_expert(online, weights[0][1], spec, Target.SM90)
    assert torch.equal(u8(one["w13.weight"]), u8(online.weight)) and torch.equal(
        one["w13.weight_scale"], online.scale
    )


def test_fp8_w8a16_moe_keeps_shard_scales_per_row() -> None:
    """fp8_w8a16 needs no requantization: per-tensor gate / up scales are expanded over their rows."""
    case = FP8_W8A16_CASES[0]
    k = kernel("fp8_moe_w8a16")
    spec = case.spec(torch.float16, num_experts=2)
    gen = torch.Generator().manual_seed(6)
    weights = [(case.w13(torch.float16, gen), case.w2(torch.float16, gen)) for _ in range(2)]
    tensors = stack([k.prepare_expert(w13, w2, spec, Target.SM75) for w13, w2 in weights])
    assert tensors["w13.weight_scale"].shape == (2, 2 * INTER) and tensors["w2.weight_scale"].shape == (2, H)
    for e, (w13, _) in enumerate(weights):
        assert torch.equal(u8(tensors["w13.weight"][e]), u8(w13.weight))
        expected = torch.cat([w13.scale[0].expand(INTER), w13.scale[1].expand(INTER)])
        assert torch.equal(tensors["w13.weight_scale"][e], expected)
        assert torch.equal(k.dequantize_expert(tensors, spec, e)[0], w13.dequantize())


# --------------------------------------------------------------------------------------------
# can_implement and the registry
# --------------------------------------------------------------------------------------------


def int_moe_spec(h: int = H, i: int = INTER, dtype: torch.dtype = torch.bfloat16, **kw: Any) -> MoESpec:
    case = IntMoECase(**{"bits": 4, "group_size": 64, **kw})
    return moe_spec(
        case.linear("w13", 2 * i, h, dtype), case.linear("w2", h, i, dtype), num_experts=8, top_k=2
    )


def test_marlin_moe_refusals() -> None:
    k = kernel("marlin_moe_wna16")
    assert k.can_implement(int_moe_spec(), Target.SM80) == (True, "")
    biased = int_moe_spec()
    biased = MoESpec.from_json({**biased.to_json(), "w2": {**biased.w2.to_json(), "has_bias": True}})
    fp32 = int_moe_spec()
    fp32 = MoESpec.from_json(
        {**fp32.to_json(), **{p: {**fp32.part(p).to_json(), "act_dtype": "float32"} for p in ("w13", "w2")}}
    )
    fp8 = Fp8MoECase("channel").spec(torch.bfloat16)
    refusals = [
        (int_moe_spec(h=192), Target.SM90, "w13: K=192"),  # hidden not a multiple of 128
        (int_moe_spec(i=96), Target.SM90, "w2: K=96"),  # intermediate per rank not a multiple of 128
        (int_moe_spec(i=144), Target.SM90, "w13: N=288"),  # 2I not a multiple of 64
        (int_moe_spec(bits=8, symmetric=False), Target.SM80, "zero points only for 4-bit"),
        (int_moe_spec(bits=2), Target.SM80, "4- and 8-bit"),
        (int_moe_spec(group_size=256), Target.SM80, "group_size=256"),
        (int_moe_spec(), Target.SM75, "gptq_wna16_experts"),
        (int_moe_spec(), Target.CPU, "cpu_int4_experts"),
        (biased, Target.SM90, "biases"),
        (fp32, Target.SM90, "float32"),
        (fp8, Target.SM90, "fp8"),
    ]
    for spec, target, needle in refusals:
        ok, reason = k.can_implement(spec, target)
        assert not ok and needle in reason, (target, needle, reason)


def test_fp8_moe_refusals() -> None:
    w8a8, w8a16 = kernel("fp8_moe_w8a8"), kernel("fp8_moe_w8a16")
    channel = Fp8MoECase("channel").spec(torch.bfloat16)
    block = Fp8MoECase("block", block_size=(128, 128)).spec(torch.bfloat16)
    assert w8a8.can_implement(channel, Target.SM89) == (True, "")
    assert w8a16.can_implement(block, Target.SM80) == (True, "")
    assert w8a16.can_implement(Fp8MoECase("tensor").spec(torch.float16), Target.SM75) == (True, "")
    refusals = [
        (w8a8, channel, Target.SM86, "fp8_marlin_moe"),
        (w8a8, block, Target.SM90, "block"),
        (w8a8, int_moe_spec(), Target.SM90, "int"),
        (w8a16, channel, Target.SM75, "float16"),  # sm75: no bf16 tensor cores
        (w8a16, channel, Target.CPU, "cpu_fp8_experts"),
        (w8a16, Fp8MoECase("block", block_size=(128, 24)).spec(torch.float16), Target.SM80, "multiple of 16"),
    ]
    marlin = kernel("fp8_marlin_moe")
    assert marlin.can_implement(block, Target.SM80) == (True, "")
    refusals += [
        (marlin, block, Target.SM89, "sm89/sm90 use fp8_moe_w8a8"),
        (marlin, Fp8MoECase("block", block_size=(128, 48)).spec(torch.bfloat16), Target.SM80, "Marlin group"),
        (marlin, dataclasses.replace(channel, w13=dataclasses.replace(channel.w13, has_bias=True)),
         Target.SM80, "expert biases"),
    ]  # fmt: skip
    for k, spec, target, needle in refusals:
        ok, reason = k.can_implement(spec, target)
        assert not ok and needle in reason, (k.name, target, needle, reason)


def test_registry_picks_the_fused_kernels() -> None:
    from kernels.registry import FUSED_MOE_KERNELS, MOE_KERNELS, choose_moe_kernel

    fused = {"marlin_moe_wna16", "fp8_moe_w8a8", "fp8_moe_w8a16", "fp8_marlin_moe"}
    assert len(FUSED_MOE_KERNELS) == 4 and fused <= set(MOE_KERNELS)
    bases = {"marlin_wna16", "fp8_w8a8", "fp8_w8a16", "fp8_marlin"}
    assert {MOE_KERNELS[n].based_on for n in fused} == bases
    int4 = int_moe_spec()
    assert choose_moe_kernel(int4, Target.SM90).kernel.name == "marlin_moe_wna16"
    int4_fp16 = int_moe_spec(dtype=torch.float16)  # sm75 runs float16 only
    assert choose_moe_kernel(int4_fp16, Target.SM75).kernel.name == "gptq_wna16_experts"
    assert choose_moe_kernel(int4, Target.CPU).kernel.name == "cpu_int4_experts"
    odd = choose_moe_kernel(
        int_moe_spec(i=96, group_size=32), Target.SM86
    )  # Marlin refuses: the per-expert GPTQ loop
    assert odd.kernel.name == "gptq_wna16_experts"
    assert any(n == "marlin_moe_wna16" and "w2: K=96" in why for n, why in odd.rejected)
    channel = Fp8MoECase("channel").spec(torch.bfloat16)
    block = Fp8MoECase("block", block_size=(128, 128)).spec(torch.bfloat16)
    assert choose_moe_kernel(channel, Target.SM90).kernel.name == "fp8_moe_w8a8"
    assert choose_moe_kernel(channel, Target.SM80).kernel.name == "fp8_marlin_moe"  # vLLM: Marlin
    assert choose_moe_kernel(block, Target.SM86).kernel.name == "fp8_marlin_moe"
    assert choose_moe_kernel(block, Target.SM89).kernel.name == "fp8_moe_w8a16"  # vLLM: Triton
    assert choose_moe_kernel(block, Target.SM90).kernel.name == "fp8_moe_w8a16"
    disabled = choose_moe_kernel(int4, Target.SM90, disabled=["marlin_wna16"])
    assert disabled.kernel.name == "gptq_wna16_experts"
    assert ("marlin_moe_wna16", "disabled by KILN_DISABLED_KERNELS") in disabled.rejected


def test_float_minimum_experts_run_on_gptq_wna16_experts() -> None:
    """GGUF Q4_1 / Q4_K experts (w = q * s + m): Marlin MoE stores integer zero points only and refuses
    them; gptq_wna16_experts takes them through gptq_wna16's own layout, a `mins` tensor per expert
    (the contract sweep runs its apply against the twin)."""
    from kernels.registry import choose_moe_kernel

    base = int_moe_spec(group_size=32, symmetric=False)
    spec = dataclasses.replace(
        base,
        w13=dataclasses.replace(base.w13, float_zeros=True),
        w2=dataclasses.replace(base.w2, float_zeros=True),
    )
    ok, reason = kernel("marlin_moe_wna16").can_implement(spec, Target.SM90)
    assert not ok and "w13: marlin_wna16 takes integer zero points only" in reason
    choice = choose_moe_kernel(spec, Target.SM90)
    assert choice.kernel.name == "gptq_wna16_experts"
    assert any(name == "marlin_moe_wna16" and "integer zero points" in why for name, why in choice.rejected)
    assert choose_moe_kernel(spec, Target.CPU).kernel.name == "cpu_int4_experts"
    stored = kernel("gptq_wna16_experts").stored_tensors(spec, Target.SM90)
    assert stored["w13.mins"] == StoredTensor((8, H // 32, 2 * INTER), torch.bfloat16)
    assert stored["w2.mins"] == StoredTensor((8, INTER // 32, H), torch.bfloat16)
    assert not any(name.endswith("qzeros") for name in stored)
