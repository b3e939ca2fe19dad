"""CPU kernels (cpu_int4, cpu_int8, cpu_w8a8, cpu_fp8) and the dense kernel: layouts exact, GEMMs vs
the fp32 twin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import base as kernel_base
from kernels.base import DenseWeight, Fp8Weight, IntWeight, LinearSpec, Target
from kernels.codecs.fp8 import quantize_fp8
from kernels.codecs.int8 import MIN_AMAX, quantize_per_token_int8
from kernels.cpu_fp8 import CpuFp8Kernel
from kernels.cpu_int4 import (
    PACK_FORMATS,
    CpuInt4Kernel,
    pack_for_this_cpu,
    pack_int4,
    runtime_pack_format,
    unpack_int4,
)
from kernels.cpu_int8 import DEQUANT_MIN_M, DEQUANT_MIN_M_FP32, CpuInt8Kernel
from kernels.cpu_w8a8 import EXACT_FP32_K, FP32_MIN_M, CpuW8A8Kernel, int8_gemm_in_fp32
from kernels.dense import GPU_QUANTIZED_REASON, DenseKernel
from kernels.errors import LayoutError
from tests.helpers.numerics import rel_err

REPO = Path(__file__).resolve().parents[2]

# Relative Frobenius error of apply vs the reference twin when activations / outputs are bf16:
# both round the output to bf16 (≤ 2^-8 relative) and accumulate in a different order.
BF16_GEMM_REL_ERR = 1e-2
# Same with fp32 activations through an fp32 GEMM (dense on cpu, cpu_fp8 with fp32 storage).
FP32_GEMM_REL_ERR = 1e-5
# The int kernels round checkpoint scales to bf16 (exact for bf16 scales): |s_bf16 - s| <= 2^-8 |s|.
BF16_SCALE_REL_ERR = 2.0**-8

MS = (1, 7, 16, 33)
SHAPES = ((576, 1536), (192, 576))  # (N, K): SmolLM2 down_proj, a non-power-of-two small layer


def int_weight(
    n: int,
    k: int,
    *,
    bits: int = 4,
    group_size: int = 64,
    symmetric: bool = True,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
    bias: bool = True,
    seed: int = 0,
) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    g = 1 if group_size == -1 else k // group_size
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    return IntWeight(
        codes=torch.randint(0, 1 << bits, (n, k), generator=gen).to(torch.uint8),
        scales=(torch.rand(g, n, generator=gen) * 0.02 + 1e-3).to(scale_dtype),
        bits=bits,
        group_size=group_size,
        zeros=None if symmetric else torch.randint(0, 1 << bits, (g, n), generator=gen).to(torch.uint8),
        g_idx=g_idx,
        bias=torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None,
    )


def int_spec(w: IntWeight, *, act_order: bool = False, **kw: object) -> LinearSpec:
    n, k = w.codes.shape
    return LinearSpec(
        name="model.layers.0.mlp.down_proj",
        scheme="int",
        n=n,
        k=k,
        bits=w.bits,
        group_size=w.group_size,
        symmetric=w.zeros is None,
        act_order=act_order,
        has_bias=w.bias is not None,
        **kw,  # type: ignore[arg-type]
    )


def check_apply(kernel: object, tensors: dict[str, torch.Tensor], spec: LinearSpec, tol: float) -> None:
    for m in MS:
        x = torch.randn(m, spec.k).to(torch.bfloat16)
        y = kernel.apply(x, tensors, spec)  # type: ignore[attr-defined]
        ref = kernel.reference(x, tensors, spec)  # type: ignore[attr-defined]
        assert y.shape == (m, spec.n) and y.dtype == torch.bfloat16
        assert rel_err(y, ref) < tol, f"M={m}: rel err {rel_err(y, ref):.2e}"


# ----------------------------------------------------------------------------------------------
# cpu_int4
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [64, -1])
def test_int4_apply_matches_reference(n: int, k: int, symmetric: bool, group_size: int) -> None:
    w = int_weight(n, k, group_size=group_size, symmetric=symmetric)
    spec = int_spec(w)
    kernel = CpuInt4Kernel()
    assert kernel.can_implement(spec, Target.CPU) == (True, "")
    tensors = kernel.prepare(w, spec, Target.CPU)
    check_apply(kernel, tensors, spec, BF16_GEMM_REL_ERR)
    # the kernel computes exactly the checkpoint's layer, not just its own twin
    x = torch.randn(5, k)
    direct = x @ w.dequantize().T + w.bias.float()  # type: ignore[union-attr]
    assert rel_err(kernel.apply(x, tensors, spec), direct) < BF16_GEMM_REL_ERR


@pytest.mark.parametrize(
    "group_size,symmetric,act_order",
    [(64, True, False), (64, False, False), (-1, True, False), (-1, False, False), (128, False, True)],
)
def test_int4_dequantize_is_exact_for_bf16_scales(group_size: int, symmetric: bool, act_order: bool) -> None:
    w = int_weight(192, 768, group_size=group_size, symmetric=symmetric, act_order=act_order)
    spec = int_spec(w, act_order=act_order)
    tensors = CpuInt4Kernel().prepare(w, spec, Target.CPU)
    assert tensors["qweight"].dtype == torch.uint8 and tuple(tensors["qweight"].shape) == (192, 384)
    assert torch.equal(CpuInt4Kernel().dequantize(tensors, spec), w.dequantize())


def test_int4_asymmetric_zero_is_exact_offset_not_in_the_bf16_zero_column() -> None:
    w = int_weight(64, 256, group_size=64, symmetric=False, scale_dtype=torch.float16)
    tensors = CpuInt4Kernel().prepare(w, int_spec(w), Target.CPU)
    sz = tensors["scales_and_zeros"]
    assert sz.dtype == torch.bfloat16 and tuple(sz.shape) == (4, 64, 2)
    assert torch.equal(sz[..., 1], torch.zeros_like(sz[..., 1]))
    assert w.zeros is not None
    expected = (8 - w.zeros.float()) * w.scales.float()  # w = (q - z) s = (q - 8) s + (8 - z) s
    assert torch.equal(tensors["zero_offsets"], expected)


def test_int4_fp16_scales_round_to_bf16_within_bound() -> None:
    w = int_weight(128, 512, group_size=128, symmetric=True, scale_dtype=torch.float16)
    spec = int_spec(w)
    deq = CpuInt4Kernel().dequantize(CpuInt4Kernel().prepare(w, spec, Target.CPU), spec)
    exact = w.dequantize()
    assert torch.all((deq - exact).abs() <= BF16_SCALE_REL_ERR * exact.abs())
    assert not torch.equal(deq, exact)  # fp16 scales are not all bf16-representable


def test_int4_channelwise_repeats_scale_over_op_groups() -> None:
    w = int_weight(64, 576, group_size=-1, symmetric=True)  # 576 = 9 * 64: op groups of 64
    spec = int_spec(w)
    tensors = CpuInt4Kernel().prepare(w, spec, Target.CPU)
    sz = tensors["scales_and_zeros"]
    assert tuple(sz.shape) == (9, 64, 2)
    assert torch.equal(sz[..., 0], w.scales.to(torch.bfloat16).expand(9, 64))


def test_int4_act_order_permutes_k_once() -> None:
    w = int_weight(192, 576, group_size=64, symmetric=False, act_order=True, seed=3)
    spec = int_spec(w, act_order=True)
    kernel = CpuInt4Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    assert w.g_idx is not None
    perm = tensors["perm"]
    assert perm.dtype == torch.int32 and torch.equal(perm.long(), torch.argsort(w.g_idx.long(), stable=True))
    assert torch.equal(w.g_idx[perm.long()].long(), torch.arange(576) // 64)  # groups now contiguous
    fmt = runtime_pack_format()
    assert torch.equal(unpack_int4(tensors["qweight"], 192, 576, *fmt), w.codes[:, perm.long()])
    check_apply(kernel, tensors, spec, BF16_GEMM_REL_ERR)
    x = torch.randn(3, 576)
    assert rel_err(kernel.apply(x, tensors, spec), x @ w.dequantize().T + w.bias.float()) < BF16_GEMM_REL_ERR  # type: ignore[union-attr]


def test_int4_act_order_with_uneven_groups_is_refused() -> None:
    w = int_weight(64, 256, group_size=64, act_order=True)
    assert w.g_idx is not None
    g_idx = w.g_idx.clone()
    g_idx[g_idx == 1] = torch.tensor(0, dtype=g_idx.dtype)  # group 0 gets 128 members, group 1 none
    w.g_idx = g_idx
    with pytest.raises(LayoutError, match="exactly 64"):
        CpuInt4Kernel().prepare(w, int_spec(w, act_order=True), Target.CPU)


def test_int4_prepare_rejects_out_of_range_codes() -> None:
    w = int_weight(64, 128)
    w.codes[3, 5] = 16
    with pytest.raises(LayoutError, match="codes >= 16"):
        CpuInt4Kernel().prepare(w, int_spec(w), Target.CPU)


def test_int4_handles_fp32_and_batched_activations() -> None:
    w = int_weight(64, 256, group_size=64, symmetric=False)
    spec = int_spec(w)
    kernel = CpuInt4Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    x = torch.randn(2, 3, 256)
    y = kernel.apply(x, tensors, spec)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    assert rel_err(y, kernel.reference(x, tensors, spec)) < BF16_GEMM_REL_ERR
    assert kernel.apply(torch.randn(0, 256).bfloat16(), tensors, spec).shape == (0, 64)


@pytest.mark.parametrize("fmt", PACK_FORMATS)
@pytest.mark.parametrize("n", [16, 48, 112, 192])
def test_int4_pack_roundtrip(fmt: tuple[int, bool], n: int) -> None:
    codes = torch.randint(0, 16, (n, 96), dtype=torch.uint8)
    packed = pack_int4(codes, *fmt)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (n, 48)
    assert torch.equal(unpack_int4(packed, n, 96, *fmt), codes)


@pytest.mark.parametrize("n,k", [(16, 64), (48, 32), (112, 128), (576, 1536), (1536, 576)])
def test_int4_pure_torch_pack_matches_torch_op(n: int, k: int) -> None:
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    op = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(pack_int4(codes, *runtime_pack_format()), op)


def test_int4_pack_in_row_blocks_equals_one_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_int4 packs a layer in row blocks of whole pack blocks (64-row multiples), so the int32 copy
    the op takes stays a block's size: the bytes are the single op call's, tail block included."""
    codes = torch.randint(
        0, 16, (3 * 64 + 48, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
    )
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    monkeypatch.setattr(kernel_base, "ROW_BLOCK_ELEMENTS", 1)  # 64-row blocks: four of them
    assert len(kernel_base.row_block_slices(240, 96)) == 4
    assert torch.equal(pack_for_this_cpu(codes), whole.view(240, 48))


OTHER_CPU_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from safetensors.torch import load_file, save_file
    from kernels.base import IntWeight, LinearSpec, Target
    from kernels.cpu_int4 import CpuInt4Kernel, runtime_pack_format
    t = load_file(sys.argv[1])
    meta = json.loads(open(sys.argv[2]).read())
    w = IntWeight(
        codes=t["codes"], scales=t["scales"], zeros=t["zeros"], bits=4, group_size=meta["group_size"]
    )
    tensors = CpuInt4Kernel().prepare(w, LinearSpec.from_json(meta["spec"]), Target.CPU)
    save_file(tensors, sys.argv[3])
    fmt = runtime_pack_format()
    info = {"format": [fmt[0], bool(fmt[1])], "capability": torch.backends.cpu.get_cpu_capability()}
    open(sys.argv[3] + ".json", "w").write(json.dumps(info))
    """
)


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_int4_artifact_packed_on_another_cpu_is_repacked_once(capability: str, tmp_path: Path) -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs an x86 CPU with AVX2 to emulate another capability")
    w = int_weight(80, 256, group_size=64, symmetric=False)  # 80 rows: a full block plus a tail
    spec = int_spec(w)
    # No pickle anywhere: tensors travel as safetensors, the rest as JSON.
    assert w.zeros is not None
    save_file({"codes": w.codes, "scales": w.scales, "zeros": w.zeros}, tmp_path / "w.safetensors")
    (tmp_path / "spec.json").write_text(json.dumps({"group_size": w.group_size, "spec": spec.to_json()}))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower(), "PYTHONPATH": str(REPO)}
    subprocess.run(
        [
            sys.executable,
            "-c",
            OTHER_CPU_SCRIPT,
            *(str(tmp_path / f) for f in ("w.safetensors", "spec.json", "out.safetensors")),
        ],
        env=env,
        check=True,
        timeout=120,
    )
    out = json.loads((tmp_path / "out.safetensors.json").read_text())
    assert out["capability"] == capability
    tensors = load_file(tmp_path / "out.safetensors")
    assert tuple(tensors["pack_format"].tolist()) == (out["format"][0], int(out["format"][1]))
    kernel = CpuInt4Kernel()
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())  # unpacks the other layout
    here = runtime_pack_format()
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = kernel.apply(x, tensors, spec)  # repacks in place when the layouts differ
    assert tuple(tensors["pack_format"].tolist()) == (here[0], int(here[1]))
    assert rel_err(y, kernel.reference(x, tensors, spec)) < BF16_GEMM_REL_ERR
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())


@pytest.mark.parametrize(
    "spec_kw,target,reason",
    [
        ({}, Target.SM80, "cpu target only"),
        ({"scheme": "fp8", "fp8_strategy": "channel", "bits": 8}, Target.CPU, "integer weights only"),
        ({"bits": 8}, Target.CPU, "4-bit weights only"),
        ({"bits": 3}, Target.CPU, "4-bit weights only"),
        ({"n": 40}, Target.CPU, "multiple of 16"),
        ({"group_size": 16}, Target.CPU, "32/64/128/256"),
        ({"group_size": -1, "k": 560}, Target.CPU, "K=560"),
        ({"group_size": 48, "k": 576}, Target.CPU, "32/64/128/256"),
        ({"k": 600}, Target.CPU, "not a multiple of group size"),
        ({"act_order": True, "k": 768, "k_full": 1536, "row_parallel": True}, Target.CPU, "row-parallel"),
    ],
)
def test_int4_refusals_name_the_reason(spec_kw: dict[str, object], target: Target, reason: str) -> None:
    base: dict[str, object] = {"name": "l", "scheme": "int", "n": 576, "k": 1536, "bits": 4, "group_size": 64}
    ok, why = CpuInt4Kernel().can_implement(LinearSpec(**{**base, **spec_kw}), target)  # type: ignore[arg-type]
    assert not ok and reason in why


def test_int4_group_192_runs_as_op_groups_of_64() -> None:
    assert CpuInt4Kernel().can_implement(LinearSpec("l", "int", 64, 576, bits=4, group_size=192), Target.CPU)[
        0
    ]
    w = int_weight(64, 576, group_size=192, symmetric=False)
    spec = int_spec(w)
    tensors = CpuInt4Kernel().prepare(w, spec, Target.CPU)
    assert tuple(tensors["scales_and_zeros"].shape) == (9, 64, 2)
    assert torch.equal(CpuInt4Kernel().dequantize(tensors, spec), w.dequantize())


# ----------------------------------------------------------------------------------------------
# cpu_int8
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_apply_matches_reference(
    n: int, k: int, native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op, and the widened GEMM (bf16 from DEQUANT_MIN_M rows with native bf16, else fp32 from
    DEQUANT_MIN_M_FP32), against the twin."""
    monkeypatch.setattr("kernels.cpu_int8.has_native_bf16", lambda: native_bf16)
    w = int_weight(n, k, bits=8, group_size=-1)
    spec = int_spec(w)
    kernel = CpuInt8Kernel()
    assert kernel.can_implement(spec, Target.CPU) == (True, "")
    tensors = kernel.prepare(w, spec, Target.CPU)
    check_apply(kernel, tensors, spec, BF16_GEMM_REL_ERR)
    for m in (DEQUANT_MIN_M + 3, DEQUANT_MIN_M_FP32 + 3):
        x = torch.randn(m, k).to(torch.bfloat16)
        assert rel_err(kernel.apply(x, tensors, spec), kernel.reference(x, tensors, spec)) < BF16_GEMM_REL_ERR


@pytest.mark.parametrize("offset", [8, 40])
def test_int8_takes_a_weight_mapped_at_an_8_byte_offset(offset: int) -> None:
    """An artifact's rank file aligns tensors to 8 bytes; torch's op segfaults from 4 rows on when the
    weight is not 16-byte aligned, so the kernel must never hand it one."""
    kernel, n, k = CpuInt8Kernel(), 192, 576
    w = int_weight(n, k, bits=8, group_size=-1)
    spec = int_spec(w)
    tensors = kernel.prepare(w, spec, Target.CPU)
    buf = torch.empty(n * k + 64 + offset, dtype=torch.int8)
    start = (-buf.data_ptr()) % 64 + offset
    mapped = buf[start : start + n * k].view(n, k)
    mapped.copy_(tensors["qweight"])
    assert mapped.data_ptr() % 16 == 8
    tensors = {**tensors, "qweight": mapped}
    x = torch.randn(5, k).to(torch.bfloat16)
    ref = kernel.reference(x, tensors, spec)
    assert rel_err(kernel.apply(x, tensors, spec), ref) < BF16_GEMM_REL_ERR
    assert rel_err(kernel.bind_apply(tensors, spec)(x), ref) < BF16_GEMM_REL_ERR


def test_int8_layout_is_code_minus_128_and_exact() -> None:
    w = int_weight(64, 96, bits=8, group_size=-1)
    spec = int_spec(w)
    tensors = CpuInt8Kernel().prepare(w, spec, Target.CPU)
    assert tensors["qweight"].dtype == torch.int8
    assert torch.equal(tensors["qweight"].to(torch.int16), w.codes.to(torch.int16) - 128)
    assert torch.equal(CpuInt8Kernel().dequantize(tensors, spec), w.dequantize())


@pytest.mark.parametrize(
    "spec_kw,target,reason",
    [
        ({}, Target.SM90, "cpu target only"),
        ({"bits": 4}, Target.CPU, "8-bit weights only"),
        ({"group_size": 64}, Target.CPU, "channelwise 8-bit only"),
        ({"symmetric": False}, Target.CPU, "symmetric 8-bit only"),
        ({"scheme": "dense", "bits": 16}, Target.CPU, "integer weights only"),
    ],
)
def test_int8_refusals_name_the_reason(spec_kw: dict[str, object], target: Target, reason: str) -> None:
    base: dict[str, object] = {"name": "l", "scheme": "int", "n": 192, "k": 576, "bits": 8, "group_size": -1}
    ok, why = CpuInt8Kernel().can_implement(LinearSpec(**{**base, **spec_kw}), target)  # type: ignore[arg-type]
    assert not ok and reason in why


def test_int8_prepare_rejects_asymmetric_zero_points() -> None:
    w = int_weight(64, 96, bits=8, group_size=-1, symmetric=False)
    with pytest.raises(LayoutError, match="asymmetric"):
        CpuInt8Kernel().prepare(w, int_spec(w), Target.CPU)


# ----------------------------------------------------------------------------------------------
# cpu_w8a8
# ----------------------------------------------------------------------------------------------

# cpu_w8a8 vs its twin: the int32 accumulator is exact and both quantize activations identically, so
# only the fp32 epilogue's order and the bf16 output rounding (half an ulp, 2^-9) remain.
W8A8_TWIN_REL_ERR = 2.0**-8
# against unquantized activations: a rounding step of amax / 127.5 per token row.
W8A8_ACT_QUANT_REL_ERR = 2e-2


def w8a8_case(
    n: int, k: int, **kw: object
) -> tuple[CpuW8A8Kernel, dict[str, torch.Tensor], LinearSpec, IntWeight]:
    w = int_weight(n, k, bits=8, group_size=-1, **kw)  # type: ignore[arg-type]
    spec = int_spec(w, int8_activations=True)
    kernel = CpuW8A8Kernel()
    assert kernel.can_implement(spec, Target.CPU) == (True, "")
    return kernel, kernel.prepare(w, spec, Target.CPU), spec, w


@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a8_apply_matches_reference_and_unquantized_activations(n: int, k: int) -> None:
    kernel, tensors, spec, w = w8a8_case(n, k)
    check_apply(kernel, tensors, spec, W8A8_TWIN_REL_ERR)
    x = torch.randn(2, 5, k).to(torch.bfloat16)  # batched leading dims
    y = kernel.apply(x, tensors, spec)
    assert y.shape == (2, 5, n)
    expected = x.float() @ w.dequantize().T + w.bias.float()  # type: ignore[union-attr]
    assert rel_err(y, expected) < W8A8_ACT_QUANT_REL_ERR
    assert kernel.apply(x[:0, :0], tensors, spec).shape == (0, 0, n)


def test_int8_gemm_in_fp32_is_int_mms_exact_integer_product() -> None:
    """The path for CPUs without int8 dot products: chunks of EXACT_FP32_K hold the worst case exactly
    (every product 128 * 128, summed to 2^24), and random K = 2560 (three chunks) equals _int_mm."""
    worst = torch.full((2, EXACT_FP32_K), -128, dtype=torch.int8)
    assert torch.equal(int8_gemm_in_fp32(worst, worst), torch.full((2, 2), 2.0**24))
    gen = torch.Generator().manual_seed(5)
    xq = torch.randint(-128, 128, (16, 2560), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (96, 2560), generator=gen, dtype=torch.int8)
    assert torch.equal(int8_gemm_in_fp32(xq, w), torch._int_mm(xq, w.t()).float())


@pytest.mark.parametrize("int8_dot_products", [True, False])
def test_w8a8_paths_agree_with_and_without_int8_dot_products(
    int8_dot_products: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the _int_mm path and the fp32 one (from FP32_MIN_M rows, CPUs without VNNI / AMX) give the
    twin's result; the CPU's features are read when the layer is bound."""
    monkeypatch.setattr("kernels.cpu_w8a8.has_int8_dot_products", lambda: int8_dot_products)
    kernel, tensors, spec, _ = w8a8_case(192, 576)
    run = kernel.bind_apply(tensors, spec)
    for m in (1, FP32_MIN_M, 40):
        x = torch.randn(m, 576).to(torch.bfloat16)
        assert rel_err(run(x), kernel.reference(x, tensors, spec)) < W8A8_TWIN_REL_ERR


def test_w8a8_layout_is_cpu_int8s_with_exact_fp32_scales() -> None:
    kernel, tensors, spec, w = w8a8_case(64, 96, scale_dtype=torch.float32)
    assert tensors["scales"].dtype == torch.float32
    assert torch.equal(tensors["qweight"], CpuInt8Kernel().prepare(w, spec, Target.CPU)["qweight"])
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())  # fp32 scales: nothing rounds


def test_per_token_int8_quantization_follows_compressed_tensors() -> None:
    """scale = amax / 127.5, halves round to even, the top half-step clamps to 127; zero rows stay 0."""
    x = torch.tensor([[127.5, -127.5, 0.5, 1.5, -2.5, 0.0], [0.0] * 6])
    q, s = quantize_per_token_int8(x)
    assert torch.equal(s, torch.tensor([127.5, MIN_AMAX]).div(127.5))
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, -128, 0, 2, -2, 0], [0] * 6]


def test_w8a8_only_takes_layers_calibrated_for_int8_activations() -> None:
    w = int_weight(192, 576, bits=8, group_size=-1)
    ok, why = CpuW8A8Kernel().can_implement(int_spec(w), Target.CPU)
    assert not ok and "int8 activations" in why
    ok, why = CpuW8A8Kernel().can_implement(int_spec(w, int8_activations=True), Target.SM80)
    assert not ok and "cpu target only" in why


# ----------------------------------------------------------------------------------------------
# cpu_fp8
# ----------------------------------------------------------------------------------------------


def fp8_weight(n: int, k: int, strategy: str, *, seed: int = 0) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    if strategy == "channel":
        scale = w.abs().amax(1) / 448.0
        return Fp8Weight((w / scale[:, None]).to(torch.float8_e4m3fn), scale, "channel", bias=bias)
    if strategy == "tensor":  # two fused shards, one scale each
        sizes = (n // 3, n - n // 3)
        scale = torch.stack([part.abs().max() / 448.0 for part in torch.split(w, sizes)])
        full = torch.repeat_interleave(scale, torch.tensor(sizes))[:, None]
        return Fp8Weight((w / full).to(torch.float8_e4m3fn), scale, "tensor", shard_sizes=sizes, bias=bias)
    bn, bk = 128, 128
    blocks = w.new_zeros((n + bn - 1) // bn, (k + bk - 1) // bk)
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            blocks[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448.0
    full = blocks.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return Fp8Weight((w / full).to(torch.float8_e4m3fn), blocks, "block", block_size=(bn, bk), bias=bias)


def fp8_spec(w: Fp8Weight, act_dtype: str = "bfloat16") -> LinearSpec:
    n, k = w.weight.shape
    return LinearSpec(
        name="model.layers.0.self_attn.qkv_proj",
        scheme="fp8",
        n=n,
        k=k,
        bits=8,
        fp8_strategy=w.strategy,
        block_size=w.block_size,
        has_bias=True,
        act_dtype=act_dtype,
    )


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_apply_matches_reference_and_dequantize_is_bit_exact(n: int, k: int, strategy: str) -> None:
    w = fp8_weight(n, k, strategy)
    spec = fp8_spec(w)
    kernel = CpuFp8Kernel()
    assert kernel.can_implement(spec, Target.CPU) == (True, "")
    tensors = kernel.prepare(w, spec, Target.CPU)
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())  # lossless
    if strategy == "block":
        assert tensors["weight"].dtype == torch.float32 and "scale" not in tensors
    else:  # the GEMM sees exactly the e4m3 values
        assert tensors["weight"].dtype == torch.bfloat16
        assert torch.equal(tensors["weight"].float(), w.weight.float())
    check_apply(kernel, tensors, spec, BF16_GEMM_REL_ERR)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_weights_from_the_codec_stay_lossless(strategy: str) -> None:
    w = torch.randn(192, 576) * 0.05
    w[7] = 0.0  # a zero row: scale 0 for channel strategy
    q = quantize_fp8(w, strategy, shard_sizes=(64, 128) if strategy == "tensor" else ())  # type: ignore[arg-type]
    spec = fp8_spec(q)
    tensors = CpuFp8Kernel().prepare(q, spec, Target.CPU)
    assert torch.equal(CpuFp8Kernel().dequantize(tensors, spec), q.dequantize())
    x = torch.randn(5, 576).to(torch.bfloat16)
    y = CpuFp8Kernel().apply(x, tensors, spec)
    assert torch.isfinite(y).all()
    assert rel_err(y, x.float() @ q.dequantize().T) < BF16_GEMM_REL_ERR


def test_fp8_fp32_activations_store_fp32_and_keep_precision() -> None:
    w = fp8_weight(192, 576, "channel")
    spec = fp8_spec(w, act_dtype="float32")
    kernel = CpuFp8Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    assert tensors["weight"].dtype == torch.float32
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())
    x = torch.randn(7, 576)
    y = kernel.apply(x, tensors, spec)
    assert y.dtype == torch.float32
    assert rel_err(y, x @ w.dequantize().T + w.bias.float()) < FP32_GEMM_REL_ERR  # type: ignore[union-attr]


def test_fp8_refusals() -> None:
    spec = LinearSpec("l", "fp8", 64, 64, bits=8, fp8_strategy="channel")
    assert CpuFp8Kernel().can_implement(spec, Target.SM89)[1].startswith("cpu_fp8 runs on the cpu target")
    ok, why = CpuFp8Kernel().can_implement(LinearSpec("l", "int", 64, 64, bits=4), Target.CPU)
    assert not ok and "fp8 weights only" in why
    with pytest.raises(LayoutError, match="Fp8Weight"):
        CpuFp8Kernel().prepare(int_weight(64, 64), spec, Target.CPU)


# ----------------------------------------------------------------------------------------------
# dense
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", SHAPES)
def test_dense_cpu_stores_fp32_exactly_and_matches_reference(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = DenseWeight(
        torch.randn(n, k, generator=gen).to(torch.bfloat16), bias=torch.randn(n).to(torch.bfloat16)
    )
    spec = LinearSpec("model.lm_head", "dense", n, k, has_bias=True)
    kernel = DenseKernel()
    assert kernel.can_implement(spec, Target.CPU) == (True, "")
    tensors = kernel.prepare(w, spec, target=Target.CPU)
    assert tensors["weight"].dtype == torch.float32 and tensors["bias"].dtype == torch.float32
    assert torch.equal(kernel.dequantize(tensors, spec), w.dequantize())
    check_apply(kernel, tensors, spec, BF16_GEMM_REL_ERR)
    x = torch.randn(4, k)
    assert rel_err(kernel.apply(x, tensors, spec), kernel.reference(x, tensors, spec)) < FP32_GEMM_REL_ERR


@pytest.mark.parametrize(
    "target,act_dtype,dtype",
    [
        (Target.SM90, "bfloat16", torch.bfloat16),
        (Target.SM80, "float16", torch.float16),
        (Target.SM75, "bfloat16", torch.float16),
    ],
)
def test_dense_gpu_stores_in_activation_dtype(target: Target, act_dtype: str, dtype: torch.dtype) -> None:
    w = DenseWeight(torch.randn(64, 96))
    spec = LinearSpec("l", "dense", 64, 96, act_dtype=act_dtype)
    assert DenseKernel().can_implement(spec, target) == (True, "")
    tensors = DenseKernel().prepare(w, spec, target=target)
    assert tensors["weight"].dtype == dtype
    assert torch.equal(tensors["weight"], w.weight.to(dtype))


@pytest.mark.parametrize(
    "weight,spec",
    [
        (int_weight(64, 192, bits=8, group_size=64), int_spec(int_weight(64, 192, bits=8, group_size=64))),
        (
            int_weight(64, 192, bits=8, group_size=-1, symmetric=False),
            int_spec(int_weight(64, 192, bits=8, group_size=-1, symmetric=False)),
        ),
        (int_weight(64, 192, bits=3, group_size=64), int_spec(int_weight(64, 192, bits=3, group_size=64))),
        (int_weight(40, 192, bits=4, group_size=64), int_spec(int_weight(40, 192, bits=4, group_size=64))),
        (fp8_weight(64, 192, "block"), fp8_spec(fp8_weight(64, 192, "block"))),
    ],
    ids=["int8-grouped", "int8-asym", "int3", "int4-n40", "fp8-block"],
)
def test_dense_is_the_lossless_cpu_fallback(weight: IntWeight | Fp8Weight, spec: LinearSpec) -> None:
    kernel = DenseKernel()
    assert kernel.can_implement(spec, Target.CPU) == (True, "")
    tensors = kernel.prepare(weight, spec, Target.CPU)
    assert tensors["weight"].dtype == torch.float32
    assert torch.equal(kernel.dequantize(tensors, spec), weight.dequantize())
    check_apply(kernel, tensors, spec, BF16_GEMM_REL_ERR)


@pytest.mark.parametrize("target", [Target.SM75, Target.SM80, Target.SM86, Target.SM89, Target.SM90])
def test_dense_refuses_quantized_layers_on_gpu(target: Target) -> None:
    w = int_weight(64, 128)
    spec = int_spec(w)
    assert DenseKernel().can_implement(spec, target) == (False, GPU_QUANTIZED_REASON)
    assert (
        DenseKernel().can_implement(fp8_spec(fp8_weight(64, 128, "channel")), target)[1]
        == GPU_QUANTIZED_REASON
    )
    with pytest.raises(LayoutError, match="dense fallback would multiply memory"):
        DenseKernel().prepare(w, spec, target=target)


def test_dense_rejects_a_weight_of_the_wrong_scheme() -> None:
    with pytest.raises(LayoutError, match="scheme dense but got IntWeight"):
        DenseKernel().prepare(int_weight(64, 64), LinearSpec("l", "dense", 64, 64), Target.CPU)


# ----------------------------------------------------------------------------------------------
# where the CPU kernels' torch ops round an fp32 model's activations (bf16_op_rows)
# ----------------------------------------------------------------------------------------------


def _bf16_exact(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).float())


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("kernel_name", ["cpu_int4", "cpu_int8", "cpu_w8a8"])
def test_bf16_op_rows_says_where_the_op_rounds_fp32_activations(
    kernel_name: str, native_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native decode step rounds an fp32 model's activations where `bf16_op_rows` says the
    kernel's op does: below it, fp32 input gives the bf16-rounded input's result and the product is
    a bf16 value; from it on (or never, 0), fp32 input is multiplied as it comes."""
    monkeypatch.setattr("kernels.cpu_int8.has_native_bf16", lambda: native_bf16)
    bits = 4 if kernel_name == "cpu_int4" else 8
    w = int_weight(192, 576, bits=bits, group_size=64 if bits == 4 else -1, bias=False, seed=12)
    spec = int_spec(w, int8_activations=kernel_name == "cpu_w8a8")
    kernel = {"cpu_int4": CpuInt4Kernel, "cpu_int8": CpuInt8Kernel, "cpu_w8a8": CpuW8A8Kernel}[kernel_name]()
    tensors = kernel.prepare(w, spec, Target.CPU)
    run = kernel.bind_apply(tensors, spec)
    rows = kernel.bf16_op_rows()
    gen = torch.Generator().manual_seed(13)
    for m in sorted({1, 4, DEQUANT_MIN_M_FP32 + 1} | ({rows - 1, rows} if 1 < rows < 1024 else set())):
        x = torch.randn(m, spec.k, generator=gen)
        y = run(x)
        if m < rows:
            assert torch.equal(y, run(x.to(torch.bfloat16).float())), (kernel_name, m)
            # cpu_int8's widened bf16 GEMM (native bf16, from DEQUANT_MIN_M rows) rounds its sum
            # before the channel scale, the step after it: one rounding apart
            widened = kernel_name == "cpu_int8" and native_bf16 and m >= DEQUANT_MIN_M
            assert widened or _bf16_exact(y), (kernel_name, m)
        else:
            assert not _bf16_exact(y), (kernel_name, m)
