"""The generic expert-group kernels on the cpu target: `stacked_experts(k)` for cpu_int4, cpu_int8,
cpu_fp8 and dense. apply (one batched call per routed expert) against the fp32 twin at decode and
prefill (some experts unused), expert parallel ranks, bind_apply, the stacked declaration against
prepare_expert, and act-order cpu_int4 experts where one expert's g_idx is trivial (its `perm` is
the neutral identity so that every expert stacks the same tensors).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.base import DenseWeight, Fp8Weight, IntWeight, LinearSpec, ShardSpec, SourceWeight, Target
from kernels.codecs.fp8 import quantize_fp8
from kernels.moe.stacked import StackedExperts, stacked_experts
from kernels.moe_base import MoEKernel, MoESpec, expert_slices
from kernels.registry import BUILTIN_KERNELS, MOE_KERNELS
from tests.helpers.numerics import rel_err

# apply vs the fp32 twin, relative Frobenius error. The cpu kernels run bf16 activations (torch's
# int4 / int8 ops, the widened fp8 weight): each of the two GEMMs rounds its output to bf16 (<= 2^-8
# relative, single GEMM: BF16_GEMM_REL_ERR = 1e-2 in test_cpu_kernels.py), silu * up is rounded to
# bf16 between them, and cpu_int4 / cpu_int8 round their scales to bf16 (exact here: bf16 scales).
BF16_MOE_REL_ERR = 2e-2
# dense on cpu: fp32 weights and activations, fp32 GEMMs: accumulation order only.
FP32_MOE_REL_ERR = 1e-5

H, INTER = 128, 64  # hidden, intermediate per expert: w13 (2 INTER, H) = (128, 128), w2 (H, INTER)
NAMES = ("cpu_int4", "cpu_int8", "cpu_fp8", "dense")


def linear(name: str, part: str, n: int, k: int, **kw: Any) -> LinearSpec:
    scheme = {"cpu_int4": "int", "cpu_int8": "int", "cpu_fp8": "fp8", "dense": "dense"}[name]
    fields: dict[str, Any] = {
        "cpu_int4": {"bits": 4, "group_size": 32},
        "cpu_int8": {"bits": 8, "group_size": -1},
        "cpu_fp8": {"bits": 8, "fp8_strategy": "channel"},
        "dense": {"bits": 16},
    }[name]
    return LinearSpec(
        name=f"model.layers.0.mlp.experts.{part}",
        scheme=scheme,  # type: ignore[arg-type]
        n=n,
        k=k,
        act_dtype="float32" if name == "dense" else "bfloat16",
        shards=(ShardSpec("gate_proj", n // 2), ShardSpec("up_proj", n // 2)) if part == "w13" else (),
        **{**fields, **kw},
    )


def spec_for(name: str, num_experts: int = 8, top_k: int = 2, **kw: Any) -> MoESpec:
    lin = {k: v for k, v in kw.items() if k not in ("first_expert", "total_experts")}
    return MoESpec(
        name="model.layers.0.mlp.experts",
        num_experts=num_experts,
        top_k=top_k,
        w13=linear(name, "w13", 2 * INTER, H, **lin),
        w2=linear(name, "w2", H, INTER, **lin),
        first_expert=kw.get("first_expert", 0),
        total_experts=kw.get("total_experts", 0),
    )


def source_weight(
    name: str, n: int, k: int, gen: torch.Generator, *, act_order: bool = False, trivial_g_idx: bool = False
) -> SourceWeight:
    dense = torch.randn(n, k, generator=gen) / k**0.5
    if name == "dense":
        return DenseWeight(weight=dense)
    if name == "cpu_fp8":
        return quantize_fp8(dense, "channel")
    bits, group = (4, 32) if name == "cpu_int4" else (8, -1)
    groups = 1 if group == -1 else k // group
    g_idx = None
    if act_order:
        g_idx = torch.arange(k) // group
        if not trivial_g_idx:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        g_idx = g_idx.to(torch.int32)
    scales = (torch.rand(groups, n, generator=gen) + 0.5) * (2.0 / (1 << (bits - 1)) / k**0.5)
    return IntWeight(
        codes=torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8),
        scales=scales.to(torch.bfloat16),
        bits=bits,
        group_size=group,
        g_idx=g_idx,
    )


def build(
    name: str, spec: MoESpec, *, seed: int = 0, trivial: frozenset[int] = frozenset()
) -> tuple[MoEKernel, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    k = MOE_KERNELS[f"{name}_experts"]
    gen = torch.Generator().manual_seed(seed)
    act_order = spec.w13.act_order
    experts = []
    for e in range(spec.num_experts):
        w13 = source_weight(name, 2 * INTER, H, gen, act_order=act_order, trivial_g_idx=e in trivial)
        w2 = source_weight(name, H, INTER, gen, act_order=act_order, trivial_g_idx=e in trivial)
        experts.append(k.prepare_expert(w13, w2, spec, Target.CPU))
    tensors = {n: torch.stack([p[n] for p in experts]) for n in experts[0]}
    return k, tensors, experts


def routes(
    tokens: int, top_k: int, pool: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack(
        [torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(tokens)]
    )
    return ids, torch.rand(tokens, top_k, generator=gen)


def act_dtype(k: MoEKernel) -> torch.dtype:
    return k.cpu_act_dtype


def tolerance(name: str) -> float:
    return FP32_MOE_REL_ERR if name == "dense" else BF16_MOE_REL_ERR


@pytest.mark.parametrize("name", NAMES)
def test_stacked_kernel_declares_what_the_linear_kernel_does(name: str) -> None:
    k = MOE_KERNELS[f"{name}_experts"]
    inner = BUILTIN_KERNELS[name]
    assert isinstance(k, StackedExperts) and k.inner is inner and k.based_on == name
    assert k.name == f"{name}_experts" and k.targets == inner.targets and Target.CPU in k.targets
    assert k.layout_version == inner.layout_version and k.cpu_act_dtype == inner.cpu_act_dtype
    assert type(stacked_experts(inner)).__name__ == type(k).__name__
    spec = spec_for(name)
    assert k.can_implement(spec, Target.CPU) == (True, "")


@pytest.mark.parametrize("name", NAMES)
def test_stored_tensors_are_prepare_expert_stacked(name: str) -> None:
    spec = spec_for(name, num_experts=3)
    k, tensors, experts = build(name, spec)
    declared = k.stored_tensors(spec, Target.CPU)
    inner = BUILTIN_KERNELS[name]
    assert set(declared) == set(tensors) == set(experts[0])
    for full, want in declared.items():
        part, suffix = full.split(".", 1)
        one = inner.stored_tensors(spec.part(part), Target.CPU)[suffix]
        assert want.shape == (3, *one.shape) and want.dtype == one.dtype, full
        assert tuple(tensors[full].shape) == want.shape and tensors[full].dtype == want.dtype, full
        assert all(tuple(p[full].shape) == one.shape for p in experts), full
    # each expert's slice dequantizes to what the linear kernel gives for that expert alone
    for e in range(3):
        w13, w2 = k.dequantize_expert(tensors, spec, e)
        assert torch.equal(w13, inner.dequantize(expert_slices(tensors, "w13", e), spec.w13))
        assert torch.equal(w2, inner.dequantize(expert_slices(tensors, "w2", e), spec.w2))
        assert w13.shape == (2 * INTER, H) and w2.shape == (H, INTER)


@pytest.mark.parametrize("name", NAMES)
def test_decode_and_prefill_match_reference(name: str) -> None:
    spec = spec_for(name)
    k, tensors, _ = build(name, spec)
    dtype = act_dtype(k)
    gen = torch.Generator().manual_seed(1)
    # decode: one token, two experts; prefill: 33 tokens on 5 of the 8 experts (1, 3 and 6 unused)
    for tokens, pool in ((1, list(range(8))), (33, [0, 2, 4, 5, 7])):
        x = torch.randn(tokens, H, generator=gen).to(dtype)
        ids, weights = routes(tokens, spec.top_k, pool, gen)
        y = k.apply(x, ids, weights, tensors, spec)
        assert y.shape == (tokens, H) and y.dtype == dtype
        err = rel_err(y, k.reference(x, ids, weights, tensors, spec))
        assert err < tolerance(name), f"T={tokens}: rel err {err:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_bind_apply_equals_apply(name: str) -> None:
    spec = spec_for(name, num_experts=4, top_k=1)
    k, tensors, _ = build(name, spec)
    run = k.bind_apply(tensors, spec)
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, 9):
        x = torch.randn(tokens, H, generator=gen).to(act_dtype(k))
        ids, weights = routes(tokens, 1, [0, 1, 2, 3], gen)
        assert torch.equal(run(x, ids, weights), k.apply(x, ids, weights, tensors, spec))


@pytest.mark.parametrize("name", ["cpu_int4", "dense"])
def test_expert_parallel_rank_adds_only_its_experts(name: str) -> None:
    """Rank 1 of 2 holds experts 4..7: ids 0..3 contribute nothing, the two ranks sum to the layer."""
    full = spec_for(name)
    k, tensors, _ = build(name, full)
    dtype = act_dtype(k)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, H, generator=gen).to(dtype)
    ids, weights = routes(12, 2, list(range(8)), gen)
    ids[0] = torch.tensor([1, 2])  # token 0 stays on rank 0
    total = torch.zeros(12, H)
    for first in (0, 4):
        spec = spec_for(name, num_experts=4, first_expert=first, total_experts=8)
        part = {n: t[first : first + 4] for n, t in tensors.items()}
        y = k.apply(x, ids, weights, part, spec)
        assert rel_err(y, k.reference(x, ids, weights, part, spec)) < tolerance(name)
        if first == 4:
            assert torch.equal(y[0], torch.zeros(H, dtype=dtype))
        total += y.float()
    assert rel_err(total, k.reference(x, ids, weights, tensors, full)) < tolerance(name)


def test_cpu_int4_act_order_expert_with_trivial_g_idx_gets_the_neutral_perm() -> None:
    """cpu_int4 stores `perm` only for a non-trivial g_idx (an optional tensor): in a stacked group
    an expert whose g_idx is k // group_size gets the identity, which leaves it unchanged."""
    spec = spec_for("cpu_int4", num_experts=4, act_order=True)
    inner = BUILTIN_KERNELS["cpu_int4"]
    assert inner.stored_tensors(spec.w13, Target.CPU)["perm"].optional
    k, tensors, experts = build("cpu_int4", spec, trivial=frozenset({2}))
    assert tensors["w13.perm"].shape == (4, H) and tensors["w2.perm"].shape == (4, INTER)
    identity = torch.arange(H, dtype=torch.int32)
    assert torch.equal(experts[2]["w13.perm"], identity)
    assert torch.equal(tensors["w2.perm"][2], torch.arange(INTER, dtype=torch.int32))
    assert not torch.equal(tensors["w13.perm"][0], identity)
    # without a perm the linear kernel gives the same layer as with the neutral one
    alone = {s: t for s, t in expert_slices(tensors, "w13", 2).items() if s != "perm"}
    assert torch.equal(inner.dequantize(alone, spec.w13), k.dequantize_expert(tensors, spec, 2)[0])
    gen = torch.Generator().manual_seed(4)
    for tokens in (1, 17):
        x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        ids, weights = routes(tokens, 2, [0, 1, 2, 3], gen)
        err = rel_err(k.apply(x, ids, weights, tensors, spec), k.reference(x, ids, weights, tensors, spec))
        assert err < BF16_MOE_REL_ERR, f"T={tokens}: rel err {err:.2e}"


def test_cpu_refusals_name_the_part() -> None:
    k = MOE_KERNELS["cpu_int8_experts"]
    ok, reason = k.can_implement(spec_for("cpu_int8", group_size=32), Target.CPU)
    assert not ok and reason.startswith("w13: ") and "channelwise" in reason
    ok, reason = k.can_implement(spec_for("cpu_int8"), Target.SM90)
    assert not ok and "cpu" in reason
    w4 = MOE_KERNELS["cpu_int4_experts"]
    ok, reason = w4.can_implement(spec_for("cpu_int4", group_size=48), Target.CPU)
    assert not ok and "w13: " in reason


def test_fp8_experts_keep_per_row_shard_scales() -> None:
    """cpu_fp8 stores one scale per row: a per-tensor gate|up pair keeps both scales (no requantize)."""
    spec = spec_for("cpu_fp8", num_experts=2, fp8_strategy="tensor")
    k = MOE_KERNELS["cpu_fp8_experts"]
    gen = torch.Generator().manual_seed(5)
    w13 = quantize_fp8(torch.randn(2 * INTER, H, generator=gen), "tensor", shard_sizes=(INTER, INTER))
    w2: Fp8Weight = quantize_fp8(torch.randn(H, INTER, generator=gen), "tensor")
    out = k.prepare_expert(w13, w2, spec, Target.CPU)
    assert torch.equal(out["w13.scale"], w13.expanded_scale()[:, 0])
    tensors = {n: t[None] for n, t in out.items()}
    assert torch.equal(k.dequantize_expert(tensors, spec, 0)[0], w13.dequantize())
