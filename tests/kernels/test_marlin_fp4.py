"""marlin_fp4: the layout against vLLM 0.32's own Marlin FP4 preparation (byte for byte, in vLLM's
venv), its exact inverse, the refusals, and the Triton kernel through the interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) against the fp32 dequantized reference.

In vLLM's venv (one subprocess for the module, `vllm_prepared`), vLLM's own functions prepare the
same weights: `prepare_fp4_layer_for_marlin` (linear) and `prepare_moe_fp4_layer_for_marlin` (an
expert group), which call its `marlin_permute_scales`, `nvfp4_marlin_process_scales`,
`nvfp4_marlin_process_global_scale`, `mxfp4_marlin_process_scales` and `marlin_permute_bias`.
`gptq_marlin_repack` is a CUDA op absent from the CPU build: it is replaced there by vLLM's own pure
Python test helper (`marlin_utils_test.marlin_weights` with `get_weight_perm`) applied to the codes
(tests/vllm_plugin/vllm_host.py `MARLIN_REPACK_PRELUDE`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kernels.base import Fp4Format, Fp4Weight, LinearSpec, ShardSpec, Target
from kernels.codecs.fp4 import pack_fp4
from kernels.errors import LayoutError
from kernels.launch import GemmConfig
from kernels.marlin_fp4 import (
    MarlinFp4Kernel,
    group_scale_factor,
    marlin_fp4_gemm,
    nvfp4_scale_factor,
)
from kernels.marlin_layout import marlin_permute_scales
from kernels.moe_base import MoESpec
from kernels.registry import MOE_KERNELS, choose_kernel
from services.convert.verify import FP4_MARLIN_FLUSH_REL_BOUND, compare
from tests.helpers.numerics import rel_err
from tests.vllm_plugin.vllm_host import MARLIN_REPACK_PRELUDE, run_in_vllm, vllm_python

# apply vs the fp32 dequantized reference (relative Frobenius error): the kernel's dequantized weight
# is exact in the act dtype, so only the output rounding (bf16 8 significant bits, fp16 11) and the
# summation order differ.
GEMM_REL_TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
KERNEL = MarlinFp4Kernel()
GLOBAL = 1.0 / 3 * 2.0**-8  # amax / (6 * 448)-like, not a power of two
EXPERTS, HIDDEN, INTER = 3, 128, 128

# Runs in vLLM's venv: argv[1] the cases (torch.save), argv[2] where to write vLLM's tensors.
VLLM_SCRIPT = (
    MARLIN_REPACK_PRELUDE
    + r"""
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as fp4
P = lambda t: torch.nn.Parameter(t, requires_grad=False)
out = {}
for name, c in torch.load(sys.argv[1], weights_only=True).items():
    act = getattr(torch, c["act"])
    if c["kind"] == "linear":
        n, k = c["weight"].shape[0], c["weight"].shape[1] * 2
        layer = types.SimpleNamespace(
            weight=P(c["weight"]), weight_scale=P(c["scales"]), output_size_per_partition=n,
            input_size_per_partition=k, params_dtype=act, bias=None,
        )
        if "global" in c:
            layer.weight_global_scale = P(c["global"])
        if "bias" in c:
            layer.bias = P(c["bias"].to(act))
        fp4.prepare_fp4_layer_for_marlin(layer)
        keys = ("weight", "weight_scale", "weight_global_scale", "bias")
    else:
        e, two_i, h = c["w13_weight"].shape[0], c["w13_weight"].shape[1], c["w13_weight"].shape[2] * 2
        cfg = types.SimpleNamespace(
            num_local_experts=e, hidden_dim=h, intermediate_size_per_partition=two_i // 2
        )
        layer = types.SimpleNamespace(moe_config=cfg, params_dtype=act)
        for key, t in c.items():
            if isinstance(t, torch.Tensor):
                setattr(layer, key, P(t))
        fp4.prepare_moe_fp4_layer_for_marlin(layer)
        keys = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2",
                "w2_weight_scale_2")
    out[name] = {key: getattr(layer, key).data for key in keys if getattr(layer, key, None) is not None}
torch.save(out, sys.argv[2])
"""
)


# --------------------------------------------------------------------------------------------
# Source weights
# --------------------------------------------------------------------------------------------


def nvfp4_scales(n: int, groups: int, gen: torch.Generator, top: float) -> torch.Tensor:
    """Positive E4M3 scales up to `top`, with a row of small ones (E4M3 subnormals 2^-9..2^-7, which
    vLLM's processing flushes unless sf lifts them), a zero and a -0.0."""
    s = torch.rand(n, groups, generator=gen) * top + top / 64
    s[0] = 2.0 ** -torch.randint(7, 10, (groups,), generator=gen).float()
    s[1, 0], s[1, 1] = 0.0, -0.0
    return s.to(torch.float8_e4m3fn)


def fp4_weight(
    fmt: Fp4Format, n: int, k: int, seed: int, *, top: float = 448.0, bias: bool = False, g: float = GLOBAL
) -> Fp4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    b = torch.randn(n, generator=gen) if bias else None
    if fmt == "mxfp4":
        scales = torch.randint(100, 140, (n, k // 32), generator=gen, dtype=torch.uint8)
        scales[0, :4] = torch.tensor([0, 1, 127, 160], dtype=torch.uint8)  # 2^-127 (fp32 subnormal) .. 2^33
        return Fp4Weight(codes, scales, "mxfp4", bias=b)
    return Fp4Weight(codes, nvfp4_scales(n, k // 16, gen, top), "nvfp4", torch.tensor([g]), bias=b)


def spec_for(w: Fp4Weight, act: str, *, name: str = "model.layers.0.mlp.down_proj") -> LinearSpec:
    n, k = w.codes.shape
    return LinearSpec(
        name=name, scheme="fp4", n=n, k=k, bits=4, group_size=w.group_size, has_bias=w.bias is not None,
        act_dtype=act, fp4_format=w.fmt,
    )  # fmt: skip


# name -> (weight, act dtype). "unnormalized": a global of 1 and scales up to 3 (sf = 2^7 in bf16).
LINEAR_CASES: dict[str, tuple[Fp4Weight, str]] = {
    "nvfp4-bf16-bias": (fp4_weight("nvfp4", 128, 256, 1, bias=True), "bfloat16"),
    "nvfp4-fp16": (fp4_weight("nvfp4", 128, 256, 2), "float16"),
    "nvfp4-bf16-unnormalized": (fp4_weight("nvfp4", 128, 256, 3, top=3.0, g=1.0), "bfloat16"),
    "nvfp4-fp16-unnormalized": (fp4_weight("nvfp4", 64, 128, 4, top=3.0, g=1.0), "float16"),
    "nvfp4-bf16-k192": (fp4_weight("nvfp4", 128, 192, 5, top=40.0), "bfloat16"),  # the N % 128, K % 64 family
    "mxfp4-bf16-bias": (fp4_weight("mxfp4", 64, 256, 6, bias=True), "bfloat16"),
}


def moe_experts(fmt: Fp4Format, seed: int) -> list[tuple[Fp4Weight, Fp4Weight]]:
    """(w13 (2I, H), w2 (H, I)) per expert; NVFP4 experts' largest scales span several powers of two
    (so the group's sf differs from each expert's own) and their globals differ."""
    tops = (448.0, 30.0, 3.0)
    out = []
    for e in range(EXPERTS):
        g = GLOBAL * (e + 1)
        w13 = fp4_weight(fmt, 2 * INTER, HIDDEN, seed + 2 * e, top=tops[e], g=g)
        w2 = fp4_weight(fmt, HIDDEN, INTER, seed + 2 * e + 1, top=tops[::-1][e], g=g / 2)
        out.append((w13, w2))
    return out


MOE_CASES: dict[str, tuple[list[tuple[Fp4Weight, Fp4Weight]], str]] = {
    "moe-nvfp4-bf16": (moe_experts("nvfp4", 10), "bfloat16"),
    "moe-nvfp4-fp16": (moe_experts("nvfp4", 20), "float16"),
    "moe-mxfp4-bf16": (moe_experts("mxfp4", 30), "bfloat16"),
}


def _linear_input(w: Fp4Weight, act: str) -> dict[str, Any]:
    c: dict[str, Any] = {"kind": "linear", "act": act, "weight": pack_fp4(w.codes), "scales": w.scales}
    if w.global_scale is not None:
        c["global"] = w.global_scale.reshape(())  # vLLM's loaders leave one 0-d fp32 multiplier
    if w.bias is not None:
        c["bias"] = w.bias
    return c


def _moe_input(experts: list[tuple[Fp4Weight, Fp4Weight]], act: str) -> dict[str, Any]:
    c: dict[str, Any] = {"kind": "moe", "act": act}
    for part, i in (("w13", 0), ("w2", 1)):
        ws = [pair[i] for pair in experts]
        c[f"{part}_weight"] = torch.stack([pack_fp4(w.codes) for w in ws])
        c[f"{part}_weight_scale"] = torch.stack([w.scales for w in ws])
        if ws[0].global_scale is not None:
            c[f"{part}_weight_scale_2"] = torch.cat([w.global_scale for w in ws])
    return c


@pytest.fixture(scope="module")
def vllm_prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """vLLM's prepared tensors of every case, from one run of vLLM's venv."""
    vllm_python()  # skips without the venv, before any case is built
    cases = {name: _linear_input(w, act) for name, (w, act) in LINEAR_CASES.items()}
    cases |= {name: _moe_input(experts, act) for name, (experts, act) in MOE_CASES.items()}
    return run_in_vllm(VLLM_SCRIPT, cases, tmp_path_factory.mktemp("vllm_fp4"))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# --------------------------------------------------------------------------------------------
# Byte identity with vLLM
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_linear_bytes_are_vllms(name: str, vllm_prepared: dict[str, dict[str, torch.Tensor]]) -> None:
    w, act = LINEAR_CASES[name]
    spec = spec_for(w, act)
    ours, theirs = KERNEL.prepare(w, spec, Target.SM80), vllm_prepared[name]
    assert same_bytes(ours["qweight"], theirs["weight"]), "qweight"
    assert same_bytes(ours["scales"], theirs["weight_scale"]), "scales"
    if w.fmt == "nvfp4":
        assert theirs["weight_global_scale"].dtype == torch.float32
        assert same_bytes(ours["global_scale"].reshape(()), theirs["weight_global_scale"]), "global_scale"
    if w.bias is not None:  # vLLM permutes its bias for Marlin (the single scale permutation); Kiln does not
        permuted = marlin_permute_scales(ours["bias"][None], spec.k, spec.n, -1)[0]
        assert same_bytes(permuted, theirs["bias"]), "bias"


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_expert_group_bytes_are_vllms_with_the_groups_sf(
    name: str, vllm_prepared: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Per-expert `prepare_scaled` with the sf of the whole group (vLLM computes one per part over all
    experts) stacks to vLLM's prepare_moe_fp4_layer_for_marlin bytes."""
    experts, act = MOE_CASES[name]
    theirs = vllm_prepared[name]
    for part, i in (("w13", 0), ("w2", 1)):
        ws = [pair[i] for pair in experts]
        spec = spec_for(ws[0], act, name=f"experts.{part}")
        sf = group_scale_factor([w.scales for w in ws], DTYPES[act]) if ws[0].fmt == "nvfp4" else None
        slices = [KERNEL.prepare_scaled(w, spec, sf) for w in ws]
        ours = {key: torch.stack([s[key] for s in slices]) for key in slices[0]}
        assert same_bytes(ours["qweight"], theirs[f"{part}_weight"]), f"{part} qweight"
        assert same_bytes(ours["scales"], theirs[f"{part}_weight_scale"]), f"{part} scales"
        if "global_scale" in ours:
            assert same_bytes(ours["global_scale"].reshape(-1), theirs[f"{part}_weight_scale_2"]), part


def test_stacked_experts_take_the_groups_sf_as_the_converter_shares_it() -> None:
    """`marlin_fp4_experts` as the converter runs it: every expert's share of the group statistic
    (its largest block scale per part), the max over the group into the spec
    (`with_group_statistics`), then `prepare_expert` per expert — the bytes of the group's sf, i.e.
    vLLM's MoE prepare, even where experts' own sfs differ (1, 8 and 128 here)."""
    kernel = MOE_KERNELS["marlin_fp4_experts"]
    experts, act = MOE_CASES["moe-nvfp4-bf16"]
    w13s = [pair[0] for pair in experts]
    spec = MoESpec(
        "experts", EXPERTS, 2, spec_for(w13s[0], act, name="w13"), spec_for(experts[0][1], act, name="w2")
    )
    assert kernel.needs_group_statistics(spec)
    assert [nvfp4_scale_factor(w.scales.float(), torch.bfloat16) for w in w13s] == [1.0, 8.0, 128.0]
    shares = [kernel.group_statistics(w13, w2, spec) for w13, w2 in experts]
    shared = kernel.with_group_statistics(spec, (max(a for a, _ in shares), max(b for _, b in shares)))
    sf13 = group_scale_factor([w.scales for w in w13s], torch.bfloat16)
    sf2 = group_scale_factor([pair[1].scales for pair in experts], torch.bfloat16)
    assert (shared.w13.group_scale_factor, shared.w2.group_scale_factor) == (sf13, sf2)
    assert LinearSpec.from_json(shared.w13.to_json()) == shared.w13  # the manifest keeps it
    for w13, w2 in experts:
        got = kernel.prepare_expert(w13, w2, shared, Target.SM80)
        for part, w, linear, sf in (("w13", w13, spec.w13, sf13), ("w2", w2, spec.w2, sf2)):
            want = KERNEL.prepare_scaled(w, linear, sf)
            for key, value in want.items():
                assert same_bytes(got[f"{part}.{key}"], value), (part, key)
    fp16 = MoESpec("experts", EXPERTS, 2, spec_for(w13s[0], "float16"), spec_for(experts[0][1], "float16"))
    assert not kernel.needs_group_statistics(fp16)  # vLLM's sf is 1 in fp16


# --------------------------------------------------------------------------------------------
# The layout's inverse, verification, refusals
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_dequantize_inverts_the_layout(name: str) -> None:
    """Exact where no block scale was flushed; the flushed rows (row 0's tiny scales: 2^-9..2^-7
    times sf * 2^7 below 2) within the verification bound."""
    w, act = LINEAR_CASES[name]
    spec = spec_for(w, act)
    tensors = KERNEL.prepare(w, spec, Target.SM86)
    got, want = KERNEL.dequantize(tensors, spec), w.dequantize()
    assert torch.equal(torch.cat([b for _, b in KERNEL.dequantized_rows(tensors, spec)]), got)
    assert torch.equal(got[1:], want[1:])
    sf = nvfp4_scale_factor(w.scales.float(), DTYPES[act]) if w.fmt == "nvfp4" else 1.0
    flushed = w.fmt == "nvfp4" and float(w.scales[0].float().min()) * sf * 2**7 < 2
    assert torch.equal(got[0], want[0]) != flushed
    check = compare(KERNEL.dequantized_rows(tensors, spec), w, DTYPES[act])
    assert (check.metric == "exact") != flushed, check
    # fp16 has no sf: a checkpoint whose largest scale is small loses more than the bound, and fails
    assert check.ok == (name != "nvfp4-fp16-unnormalized"), check
    assert check.value <= FP4_MARLIN_FLUSH_REL_BOUND or not check.ok


def test_s0e5m3_decode_covers_every_e4m3_scale() -> None:
    """Every non-negative E4M3 value (0x00 .. 0x7e) as a block scale, both act dtypes: the stored byte
    shifted into an fp16 is s * sf * 2^7 (0 below 2), the global carries 2^(bias - 7) / sf."""
    gen = torch.Generator().manual_seed(0)
    values = torch.arange(0, 128, dtype=torch.uint8).clamp_max(0x7E).view(torch.float8_e4m3fn)  # 448 twice
    scales = torch.stack([values[torch.randperm(128, generator=gen)] for _ in range(64)])  # (64, 128)
    codes = torch.full((64, 128 * 16), 2, dtype=torch.uint8)  # E2M1 1.0
    w = Fp4Weight(codes, scales, "nvfp4", torch.tensor([0.75]))
    s = scales.float().repeat_interleave(16, 1)
    kept = s * 2**7 >= 2  # sf = 1: 448 is among the scales
    for act in DTYPES:
        spec = spec_for(w, act)
        got = KERNEL.dequantize(KERNEL.prepare(w, spec, Target.SM90), spec)
        assert torch.equal(got[kept], s[kept] * 0.75) and bool((got[~kept] == 0).all()), act


def test_refusals_and_registry() -> None:
    nv = spec_for(fp4_weight("nvfp4", 128, 256, 0), "bfloat16")
    mx = spec_for(fp4_weight("mxfp4", 128, 256, 0), "float16")
    ok, why = KERNEL.can_implement(mx, Target.SM80)
    assert not ok and "E8M0" in why and "bfloat16" in why
    for n, k in ((96, 256), (64, 192), (128, 96)):
        ok, why = KERNEL.can_implement(dataclasses.replace(nv, n=n, k=k), Target.SM80)
        assert not ok and "tile family" in why, (n, k)
    ok, why = KERNEL.can_implement(nv, Target.CPU)
    assert not ok and "cpu_fp4" in why
    assert choose_kernel(nv, Target.SM80).kernel.name == "marlin_fp4"
    assert choose_kernel(nv, Target.CPU).kernel.name == "cpu_fp4"


def test_fused_shards_with_different_globals_are_refused() -> None:
    w = fp4_weight("nvfp4", 128, 256, 0)
    shards = (ShardSpec("q", 64), ShardSpec("k", 32), ShardSpec("v", 32))
    spec = dataclasses.replace(spec_for(w, "bfloat16"), shards=shards)
    w.shard_sizes = (64, 32, 32)
    w.global_scale = torch.tensor([GLOBAL] * 3)
    assert torch.equal(KERNEL.dequantize(KERNEL.prepare(w, spec, Target.SM80), spec)[1:], w.dequantize()[1:])
    w.global_scale = torch.tensor([GLOBAL, GLOBAL * 2, GLOBAL])
    with pytest.raises(LayoutError, match=r"different global scales.*compressed-tensors"):
        KERNEL.prepare(w, spec, Target.SM80)
    w.global_scale, w.shard_sizes = torch.tensor([GLOBAL]), ()
    w.scales = (-w.scales.float()).to(torch.float8_e4m3fn)
    with pytest.raises(LayoutError, match="negative"):
        KERNEL.prepare(w, spec, Target.SM80)


# --------------------------------------------------------------------------------------------
# The Triton kernel (interpreter on CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "m"), [(n, (1, 33)[i % 2]) for i, n in enumerate(LINEAR_CASES)])
def test_apply_matches_the_dequantized_reference(name: str, m: int) -> None:
    w, act = LINEAR_CASES[name]
    spec, dtype = spec_for(w, act), DTYPES[act]
    tensors = KERNEL.prepare(w, spec, Target.SM80)
    x = torch.randn(m, spec.k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = KERNEL.apply(x, tensors, spec)
    want = x.float() @ KERNEL.dequantize(tensors, spec).T + (
        w.bias.to(dtype).float() if w.bias is not None else 0
    )
    assert y.shape == (m, spec.n) and y.dtype == dtype
    assert rel_err(y, want) < GEMM_REL_TOL[dtype]


def test_split_k_and_batched_input() -> None:
    w, act = LINEAR_CASES["nvfp4-fp16"]
    spec = spec_for(w, act)
    tensors = KERNEL.prepare(w, spec, Target.SM80)
    x = torch.randn(2, 3, spec.k, generator=torch.Generator().manual_seed(3)).half()
    y = marlin_fp4_gemm(x, tensors, spec, GemmConfig(16, 64, 64, split_k=2))
    assert y.shape == (2, 3, spec.n) and y.dtype == torch.float16
    assert rel_err(y, KERNEL.reference(x, tensors, spec)) < GEMM_REL_TOL[torch.float16]
    with pytest.raises(LayoutError, match="exponent bias"):
        marlin_fp4_gemm(x.bfloat16(), tensors, spec)


def test_apply_falls_back_to_reference_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w, act = LINEAR_CASES["mxfp4-bf16-bias"]
    spec = spec_for(w, act)
    tensors = KERNEL.prepare(w, spec, Target.SM80)
    x = torch.randn(4, spec.k).bfloat16()
    assert torch.equal(KERNEL.apply(x, tensors, spec), KERNEL.reference(x, tensors, spec))
