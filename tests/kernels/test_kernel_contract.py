"""The kernel contract, swept over the registry: every linear kernel (`KERNELS` and third-party entry
points) and every expert-group kernel (`MOE_KERNELS`), on every target it declares, with every
canonical source weight of tests/kernels/contract_cases.py whose spec it accepts. A kernel added with
one line in the registry is tested here with no new line.

Per case (layout tests, cheap, one per kernel x target x weight x act dtype):
  1. `prepare` writes exactly what `stored_tensors` declares (names, shapes, dtypes; optional tensors
     may be absent), as contiguous CPU tensors (what safetensors writes), the bias as given;
  2. `dequantize` gives the canonical weight back: bit for bit for exact source weights (see
     contract_cases), within a named bound where the source or the layout is lossy;
  3. `stored_int_weight`, where a layout has one, gives back the source's codes, zero points, group
     map and scales (in their stored dtype), and dequantizes to what `dequantize` gives;
  4. `reference` is x @ dequantized.T (+ bias) in fp32 (the W8A8 twins quantize x per token first).
Per (kernel, weight, act dtype) over its targets (apply tests; a target whose prepared tensors equal
another's is run once, since apply does not see the target):
  5. `apply` (and `bind_apply`, where a kernel has its own) against `reference` for every activation
     dtype the kernel declares for the layer, decode / batch / (..., K) inputs, on CPU for the cpu
     target and through the Triton interpreter (tests/conftest.py) for GPU targets; on a CUDA machine
     without the interpreter, on the device for the targets it can run.
Expert groups: the same through prepare_expert / stored_tensors / dequantize_expert /
stored_int_weights / reference / apply (groups on GPU targets only run one act dtype per source
weight, alternating, to keep the interpreter's time small).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kernels import base as kernel_base
from kernels.base import Fp8Weight, IntWeight, LinearKernel, LinearSpec, SourceWeight, StoredTensor
from kernels.moe_base import MoEKernel, MoESpec
from kernels.registry import BUILTIN_KERNELS, FUSED_MOE_KERNELS, import_object
from kernels.targets import Target
from tests.helpers.numerics import rel_err
from tests.kernels.contract_cases import (
    ACT_DTYPES,
    VARIANTS,
    LinearCase,
    MoECase,
    Variant,
    linear_cases,
    linear_kernels,
    moe_cases,
    moe_kernels,
)

LINEAR_KERNELS = linear_kernels()
MOE_KERNELS = moe_kernels()
LINEAR_CASES = linear_cases()
MOE_CASES = moe_cases()

# --------------------------------------------------------------------------------------------
# Tolerances (everything else is compared bit for bit)
# --------------------------------------------------------------------------------------------

# dequantize of a non-exact source weight (fp16 GPTQ scales, fp32 FP8 scales, an fp32 dense weight)
# against its canonical dequantization, relative Frobenius error: a layout may store scales / values
# in its act dtype or bf16, which rounds each to <= 2^-8 relative (bf16 keeps 8 significant bits).
SOURCE_ROUNDING_REL_ERR = 2.0**-8
# Kernels whose layout holds ONE per-tensor FP8 scale, so that per-shard scales of a fused layer are
# requantized to the largest (vLLM's requantize_with_max_scale), keyed by the linear kernel (expert
# groups by `based_on`). Each element then moves by at most half an e4m3 step at the new scale:
# 2^-4 relative for normals plus the fp16 round trip of vLLM's requantize (2^-10), or half the
# subnormal step (2^-10) times the scale.
REQUANTIZES_FP8_SHARDS = frozenset({"fp8_w8a8"})
FP8_REQUANT_REL = 2.0**-4 + 2.0**-10
FP8_REQUANT_SUBNORMAL_ABS = 2.0**-10
# reference vs x @ dequantized.T in fp32 for the plain twin: the same fp32 products, summed in a
# possibly different order.
FP32_REL_ERR = 1e-6
# reference vs unquantized fp32 activations for twins that quantize activations per token (W8A8):
# e4m3 keeps 4 significant bits (<= 2^-4 per element, averaging down over K); int8 steps amax/127.5.
# One GEMM; expert groups chain two (x, then silu(gate) * up), which compounds to about sqrt(2)x.
ACT_QUANT_REL_ERR = 6e-2
MOE_ACT_QUANT_REL_ERR = 8e-2
# apply vs reference, relative Frobenius error, by the coarsest float dtype of the computation (see
# `apply_tolerance`: activations, stored tensors, the cpu fast path's dtype): both round the output
# to that dtype (bf16 keeps 8 significant bits, fp16 11) and the kernel may round its dequantized
# weight to it before the dot; fp32 differs by summation order only.
APPLY_REL_TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# The same for an expert group: two chained GEMMs, silu(gate) * up rounded to the act dtype between
# them and every routed row once more before the top-k sum (about 1.5x one GEMM).
MOE_APPLY_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
# Leading dimensions of x per apply: decode, a batch (33 rows cross cpu_int8's switch to its widened
# GEMM at 32) and a batched (..., K) input. The Triton interpreter is slow, so GPU targets run decode
# or the batched input, alternately.
CPU_LEADS: tuple[tuple[int, ...], ...] = ((1,), (33,), (2, 3))
GPU_LEADS: tuple[tuple[tuple[int, ...], ...], ...] = (((1,),), ((2, 3),))
MOE_CPU_TOKENS = (1, 9)
MOE_GPU_TOKENS = ((1,), (5,))


# --------------------------------------------------------------------------------------------
# Shared checks
# --------------------------------------------------------------------------------------------


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors (torch.equal has no float8 kernel on CPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_declared(
    declared: dict[str, StoredTensor], tensors: dict[str, torch.Tensor], *, stacked: int = 0
) -> None:
    """`tensors` are what `declared` states (leading dimension `stacked` stripped off when > 0)."""
    undeclared = set(tensors) - set(declared)
    assert not undeclared, f"prepared but not declared: {sorted(undeclared)}"
    for name, want in declared.items():
        shape = want.shape
        if stacked:
            assert shape[0] == stacked, f"{name}: declared {shape}, expected {stacked} experts first"
            shape = shape[1:]
        t = tensors.get(name)
        if t is None:
            assert want.optional, f"declared tensor {name!r} is missing"
            continue
        assert (tuple(t.shape), t.dtype) == (shape, want.dtype), (
            f"{name}: prepared {tuple(t.shape)} {t.dtype}, declared {shape} {want.dtype}"
        )
        assert t.device.type == "cpu" and t.is_contiguous(), f"{name}: not a contiguous CPU tensor"


def layout_key(kernel: LinearKernel | MoEKernel) -> str:
    """The linear kernel whose layout `kernel` stores (itself for a linear kernel)."""
    return (kernel.based_on if isinstance(kernel, MoEKernel) else "") or kernel.name


def check_dequantized(
    kernel: LinearKernel | MoEKernel, variant: Variant, got: torch.Tensor, source: SourceWeight, what: str
) -> None:
    want = source.dequantize()
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    if not variant.exact:
        err = rel_err(got, want)
        assert err <= SOURCE_ROUNDING_REL_ERR, f"{what}: relative error {err:.2e} of a rounded source"
    elif variant.shard_scales and layout_key(kernel) in REQUANTIZES_FP8_SHARDS:
        assert isinstance(source, Fp8Weight), what
        scale = source.scale.max()
        bound = FP8_REQUANT_REL * want.abs() + FP8_REQUANT_SUBNORMAL_ABS * scale
        worst = float(((got - want).abs() - bound).max())
        assert worst <= 0, f"{what}: requantized shards off by {worst:.2e} beyond the bound"
    else:
        mismatched = int((got != want).sum())
        assert mismatched == 0, f"{what}: {mismatched} of {want.numel()} values differ from the source"


def check_stored_int_weight(
    got: IntWeight | None, source: SourceWeight, dequantized: torch.Tensor, what: str
) -> None:
    """The stored integer weight, where the layout has one, round-trips the source."""
    if got is None:
        return
    assert isinstance(source, IntWeight), f"{what}: an integer weight from a {type(source).__name__}"
    assert got.bits == source.bits and got.group_size == source.group_size, what
    assert torch.equal(got.codes, source.codes), f"{what}: codes"
    assert (got.zeros is None) == (source.zeros is None), f"{what}: zero points present or not"
    if got.zeros is not None and source.zeros is not None:
        assert torch.equal(got.zeros, source.zeros), f"{what}: zero points"
    assert (got.mins is None) == (source.mins is None), f"{what}: float minimums present or not"
    if got.mins is not None and source.mins is not None:  # stored in a float dtype, as the scales
        assert torch.equal(got.mins, source.mins.to(got.mins.dtype)), f"{what}: float minimums"
    assert torch.equal(got.group_index(), source.group_index()), f"{what}: group of each input channel"
    assert torch.equal(got.scales, source.scales.to(got.scales.dtype)), f"{what}: scales"
    assert torch.equal(got.dequantize(), dequantized), f"{what}: its dequantization is not `dequantize`'s"


def overrides(kernel: object, method: str, base: type) -> bool:
    """Whether `kernel`'s class replaces `base`'s `method`."""
    return getattr(type(kernel), method) is not getattr(base, method)


def applying(
    kernel: LinearKernel, tensors: dict[str, torch.Tensor], spec: LinearSpec
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`kernel.apply` bound to one layer (as `bind_apply` is)."""
    return lambda x: kernel.apply(x, tensors, spec)


def turn(variant: Variant, act_dtype: str) -> int:
    """0 or 1, alternating over source weights and act dtypes (to spread the interpreter's rows)."""
    return (VARIANTS.index(variant) + ACT_DTYPES.index(act_dtype)) % 2


def apply_device(target: Target) -> str | None:
    """Where `apply` runs for `target`: CPU tensors for the cpu target and, under the Triton
    interpreter (TRITON_INTERPRET=1), for GPU targets; a CUDA device that has the target's
    capability; else nowhere."""
    if target is Target.CPU or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "cpu"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if 10 * major + minor >= target.capability:
            return "cuda"
    return None


def apply_tolerance(
    table: dict[torch.dtype, float],
    x_dtype: torch.dtype,
    kernel: LinearKernel | MoEKernel,
    target: Target,
    tensors: dict[str, torch.Tensor],
) -> float:
    """`table`'s entry for the coarsest float dtype the computation sees: the activations', every
    stored float tensor's (a kernel computes in the dtype it stores its weight / scales in) and, on
    cpu, the kernel's `cpu_act_dtype` (its fast path converts x to it)."""
    dtypes = {x_dtype} | {t.dtype for t in tensors.values() if t.dtype in table}
    if target is Target.CPU:
        dtypes.add(kernel.cpu_act_dtype)
    return max(table[d] for d in dtypes)


def distinct_layouts(
    prepared: list[tuple[Target, dict[str, torch.Tensor]]],
) -> list[tuple[Target, dict[str, torch.Tensor]]]:
    """The first target of every distinct set of prepared tensors (apply does not see the target)."""
    out: list[tuple[Target, dict[str, torch.Tensor]]] = []
    for target, tensors in prepared:
        if not any(
            t.keys() == tensors.keys() and all(same_bytes(t[n], tensors[n]) for n in t) for _, t in out
        ):
            out.append((target, tensors))
    return out


# --------------------------------------------------------------------------------------------
# Coverage: no kernel or target without a case
# --------------------------------------------------------------------------------------------


def test_every_kernel_on_every_target_it_declares_is_swept() -> None:
    linear = {(c.kernel, c.target) for c in LINEAR_CASES}
    missing = [(n, t.value) for n, k in LINEAR_KERNELS.items() for t in k.targets if (n, t) not in linear]
    assert not missing, f"linear kernels with no accepted case (add a source weight they take): {missing}"
    moe = {(c.kernel, c.target) for c in MOE_CASES}
    missing = [(n, t.value) for n, k in MOE_KERNELS.items() for t in k.targets if (n, t) not in moe]
    assert not missing, f"expert-group kernels with no accepted case: {missing}"
    # every entry of the registry's lists is among the swept kernels
    assert set(BUILTIN_KERNELS) <= set(LINEAR_KERNELS)
    fused = {getattr(import_object(p), "name", None) for p in FUSED_MOE_KERNELS}
    assert fused | {f"{n}_experts" for n in BUILTIN_KERNELS} <= set(MOE_KERNELS)


def test_float_minimum_weights_reach_exactly_the_kernels_that_take_them() -> None:
    """Every (kernel, target) that takes integer weights and declares `takes_float_zeros` is swept with
    float-minimum weights, and no other accepts them; an expert group takes them exactly when the
    linear kernel whose layout it stacks does (the fused Marlin MoE kernel refuses them)."""
    takers = {
        (c.kernel, c.target)
        for c in LINEAR_CASES
        if c.variant.scheme == "int" and LINEAR_KERNELS[c.kernel].takes_float_zeros
    }
    assert {(c.kernel, c.target) for c in LINEAR_CASES if c.variant.float_zeros} == takers
    assert ("gptq_wna16", Target.SM80) in takers
    moe_takers = {
        (c.kernel, c.target)
        for c in MOE_CASES
        if c.variant.scheme == "int" and LINEAR_KERNELS[layout_key(MOE_KERNELS[c.kernel])].takes_float_zeros
    }
    assert {(c.kernel, c.target) for c in MOE_CASES if c.variant.float_zeros} == moe_takers
    assert ("gptq_wna16_experts", Target.SM80) in moe_takers
    assert not any(name == "marlin_moe_wna16" for name, _ in moe_takers)


# --------------------------------------------------------------------------------------------
# Linear kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
def test_linear_layout_contract(case: LinearCase, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, target = LINEAR_KERNELS[case.kernel], case.target
    spec, weight = case.spec(), case.weight()
    monkeypatch.setattr(kernel_base, "ROW_BLOCK_ELEMENTS", 1)  # row blocks of 64 rows: several per layer
    tensors = kernel.prepare(weight, spec, target)
    # 1. the declaration, and the bias as given
    check_declared(kernel.stored_tensors(spec, target), tensors)
    if weight.bias is not None:
        assert torch.equal(tensors["bias"].float(), weight.bias.float()), "bias"
    # 2. the layout round trip, whole and in the row blocks verification reads
    dequantized = kernel.dequantize(tensors, spec)
    check_dequantized(kernel, case.variant, dequantized, weight, "dequantize")
    blocks = list(kernel.dequantized_rows(tensors, spec))
    assert [rows for rows, _ in blocks] == kernel_base.row_block_slices(spec.n, spec.k)
    assert torch.equal(torch.cat([b.to(dequantized.device) for _, b in blocks]), dequantized), (
        "dequantized_rows"
    )
    # 3. the stored integer weight
    check_stored_int_weight(kernel.stored_int_weight(tensors, spec), weight, dequantized, "stored_int_weight")
    # 4. the twin computes the layer: x @ W.T + b in fp32
    x = torch.randn(5, spec.k, generator=torch.Generator().manual_seed(1))
    expected = x @ dequantized.T + (weight.bias.float() if weight.bias is not None else 0.0)
    y = kernel.reference(x, tensors, spec)
    assert y.dtype == torch.float32 and y.shape == (5, spec.n)
    tol = ACT_QUANT_REL_ERR if overrides(kernel, "reference", LinearKernel) else FP32_REL_ERR
    assert rel_err(y, expected) < tol, f"reference: relative error {rel_err(y, expected):.2e}"


def _linear_apply_groups() -> list[tuple[str, list[LinearCase]]]:
    groups: dict[tuple[str, str, str, int, int], list[LinearCase]] = defaultdict(list)
    for c in LINEAR_CASES:
        groups[(c.kernel, c.variant.label, c.act_dtype, c.n, c.k)].append(c)
    return [(f"{k[0]}-{k[1]}-{k[2]}", cases) for k, cases in groups.items()]


LINEAR_APPLY_GROUPS = _linear_apply_groups()


@pytest.mark.parametrize("cases", [pytest.param(g, id=name) for name, g in LINEAR_APPLY_GROUPS])
def test_linear_apply_matches_reference(cases: list[LinearCase]) -> None:
    kernel = LINEAR_KERNELS[cases[0].kernel]
    spec, weight = cases[0].spec(), cases[0].weight()
    runnable = [c.target for c in cases if apply_device(c.target) is not None]
    if not runnable:
        pytest.skip("no device runs these targets (GPU targets need CUDA or TRITON_INTERPRET=1)")
    layouts = distinct_layouts([(t, kernel.prepare(weight, spec, t)) for t in runnable])
    gen = torch.Generator().manual_seed(7)
    parity = turn(cases[0].variant, cases[0].act_dtype)
    for target, prepared in layouts:
        device = apply_device(target)
        assert device is not None
        tensors = {n: t.to(device) for n, t in prepared.items()}
        leads = CPU_LEADS if target is Target.CPU else GPU_LEADS[parity]
        runs = [("apply", applying(kernel, tensors, spec))]
        if overrides(kernel, "bind_apply", LinearKernel):  # the runtime's hot path, where it has its own
            runs.append(("bind_apply", kernel.bind_apply(tensors, spec)))
        for dtype in sorted(kernel.act_dtypes(spec, target), key=str):
            tol = apply_tolerance(APPLY_REL_TOL, dtype, kernel, target, tensors)
            for lead in leads:
                x = torch.randn(*lead, spec.k, generator=gen).to(device=device, dtype=dtype)
                ref = kernel.reference(x, tensors, spec).cpu()
                for how, run in runs:
                    y = run(x)
                    what = f"{how} on {target.value}, x {tuple(x.shape)} {dtype}"
                    assert y.shape == (*lead, spec.n) and y.dtype == dtype and y.device == x.device, what
                    err = rel_err(y.cpu(), ref)
                    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"


# --------------------------------------------------------------------------------------------
# Expert-group kernels
# --------------------------------------------------------------------------------------------


def prepare_group(
    kernel: MoEKernel, spec: MoESpec, experts: list[tuple[SourceWeight, SourceWeight]], target: Target
) -> dict[str, torch.Tensor]:
    """prepare_expert per expert, checked against the declaration, stacked as the converter does."""
    declared = kernel.stored_tensors(spec, target)
    slices = [kernel.prepare_expert(w13, w2, spec, target) for w13, w2 in experts]
    for e, s in enumerate(slices):
        check_declared(declared, s, stacked=spec.num_experts)
        assert s.keys() == slices[0].keys(), f"expert {e} stores other tensors than expert 0"
    tensors = {name: torch.stack([s[name] for s in slices]) for name in slices[0]}
    for name, t in tensors.items():
        assert (tuple(t.shape), t.dtype) == (declared[name].shape, declared[name].dtype), name
    return tensors


def routes(tokens: int, spec: MoESpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, top_k) distinct expert ids per token and normalized routing weights."""
    ids = torch.stack([torch.randperm(spec.num_experts, generator=gen)[: spec.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, spec.top_k, generator=gen) + 0.1
    return ids + spec.first_expert, weights / weights.sum(-1, keepdim=True)


def moe_expected(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The expert MLP token by token in fp32: sum_k weight * down(silu(gate(x)) * up(x))."""
    out = torch.zeros(x.shape[0], experts[0][1].shape[0])
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            w13, w2 = experts[int(ids[t, slot])]
            gate, up = (x[t] @ w13.T).chunk(2)
            out[t] += weights[t, slot] * ((F.silu(gate) * up) @ w2.T)
    return out


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: c.id)
def test_moe_layout_contract(case: MoECase) -> None:
    kernel, target = MOE_KERNELS[case.kernel], case.target
    spec, experts = case.spec(), case.experts()
    # 1. every expert's slices are what the declaration states, stacked to it
    tensors = prepare_group(kernel, spec, experts, target)
    dequantized = []
    for e, (w13, w2) in enumerate(experts):
        # 2. the layout round trip, expert by expert
        d13, d2 = kernel.dequantize_expert(tensors, spec, e)
        check_dequantized(kernel, case.variant, d13, w13, f"expert {e} w13")
        check_dequantized(kernel, case.variant, d2, w2, f"expert {e} w2")
        dequantized.append((d13, d2))
        # 3. the stored integer weights
        i13, i2 = kernel.stored_int_weights(tensors, spec, e)
        check_stored_int_weight(i13, w13, d13, f"expert {e} w13")
        check_stored_int_weight(i2, w2, d2, f"expert {e} w2")
    # 4. the twin computes the expert MLP in fp32
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, spec.hidden, generator=gen)
    ids, weights = routes(6, spec, gen)
    y = kernel.reference(x, ids, weights, tensors, spec)
    assert y.dtype == torch.float32 and y.shape == (6, spec.hidden)
    expected = moe_expected(x, ids, weights, dequantized)
    tol = MOE_ACT_QUANT_REL_ERR if quantizes_activations(kernel) else FP32_REL_ERR
    assert rel_err(y, expected) < tol, f"reference: relative error {rel_err(y, expected):.2e}"


def quantizes_activations(kernel: MoEKernel) -> bool:
    """Its twin quantizes activations per token: a fused W8A8 group's own twin, or a stacked group
    (`inner`: the linear kernel whose layout it stacks) of a W8A8 linear kernel."""
    inner = getattr(kernel, "inner", None)
    if isinstance(inner, LinearKernel):
        return overrides(inner, "reference", LinearKernel)
    return overrides(kernel, "expert_twin", MoEKernel)


def _moe_apply_groups() -> list[tuple[str, list[MoECase]]]:
    """(kernel, weight, act dtype) groups of cases over their targets. Groups on GPU targets only
    (the Triton interpreter: two interpreted GEMMs per expert or group) run one act dtype per
    source weight, alternating over the weights; the layout tests cover every act dtype."""
    groups: dict[tuple[str, str, str, int, int], list[MoECase]] = defaultdict(list)
    for c in MOE_CASES:
        groups[(c.kernel, c.variant.label, c.act_dtype, c.hidden, c.inter)].append(c)
    acts: dict[tuple[str, str], list[str]] = defaultdict(list)
    for kernel, label, act, _, _ in groups:
        acts[(kernel, label)].append(act)
    out = []
    for key, cases in groups.items():
        kernel, label, act = key[:3]
        turn = [v.label for v in VARIANTS].index(label) % len(acts[(kernel, label)])
        if all(c.target.is_gpu for c in cases) and act != acts[(kernel, label)][turn]:
            continue
        out.append((f"{kernel}-{label}-{act}", cases))
    return out


MOE_APPLY_GROUPS = _moe_apply_groups()


@pytest.mark.parametrize("cases", [pytest.param(g, id=name) for name, g in MOE_APPLY_GROUPS])
def test_moe_apply_matches_reference(cases: list[MoECase]) -> None:
    kernel = MOE_KERNELS[cases[0].kernel]
    spec, experts = cases[0].spec(), cases[0].experts()
    runnable = [c.target for c in cases if apply_device(c.target) is not None]
    if not runnable:
        pytest.skip("no device runs these targets (GPU targets need CUDA or TRITON_INTERPRET=1)")
    layouts = distinct_layouts([(t, prepare_group(kernel, spec, experts, t)) for t in runnable])
    gen = torch.Generator().manual_seed(7)
    parity = turn(cases[0].variant, cases[0].act_dtype)
    for target, prepared in layouts:
        device = apply_device(target)
        assert device is not None
        tensors = {n: t.to(device) for n, t in prepared.items()}
        token_counts = MOE_CPU_TOKENS if target is Target.CPU else MOE_GPU_TOKENS[parity]
        for dtype in sorted(kernel.act_dtypes(spec, target), key=str):
            for tokens in token_counts:
                x = torch.randn(tokens, spec.hidden, generator=gen).to(device=device, dtype=dtype)
                ids, weights = (t.to(device) for t in routes(tokens, spec, gen))
                y = kernel.apply(x, ids, weights, tensors, spec)
                what = f"{target.value} x {dtype} T={tokens}"
                assert y.shape == (tokens, spec.hidden) and y.dtype == dtype and y.device == x.device, what
                err = rel_err(y.cpu(), kernel.reference(x, ids, weights, tensors, spec).cpu())
                tol = apply_tolerance(MOE_APPLY_REL_TOL, dtype, kernel, target, tensors)
                assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"
