"""Acceptance on real checkpoints: SmolLM2-135M-Instruct saved as bf16, quantized by llm-compressor
(GPTQ W4A16 g64, FP8_DYNAMIC) and packed in AWQ-GEMM format by AutoAWQ, converted for cpu and sm80.

Checkpoints and artifacts are cached (tests/fixtures/checkpoints.py); a converted artifact must
verify every layer, choose the expected kernel, and keep its id when converted again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from devtools.builders import smollm2
from runtime.artifact.manifest import Manifest
from services.convert.library import ConversionRequest, convert

NUM_LAYERS = 30
FUSED_LINEARS_PER_LAYER = 4  # qkv_proj, o_proj, gate_up_proj, down_proj
RUNTIME_LINEARS = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}

# Marlin needs K % 128 == 0 per rank: SmolLM2's K=576 layers (qkv, o, gate_up) fall back on sm80,
# down_proj (K=1536) takes Marlin.
MARLIN_K_MULTIPLE = 128
SMOLLM2_K = {
    "self_attn.qkv_proj": 576,
    "self_attn.o_proj": 576,
    "mlp.gate_up_proj": 576,
    "mlp.down_proj": 1536,
}
INT4_SM80 = {s: "marlin_wna16" if k % MARLIN_K_MULTIPLE == 0 else "gptq_wna16" for s, k in SMOLLM2_K.items()}
FP8_SM80 = {s: "fp8_marlin" if k % MARLIN_K_MULTIPLE == 0 else "fp8_w8a16" for s, k in SMOLLM2_K.items()}
FALLBACK_KERNELS = {"gptq_wna16", "fp8_w8a16"}  # what the K=576 layers fall back to on sm80


def _everywhere(kernel: str) -> dict[str, str]:
    return dict.fromkeys(SMOLLM2_K, kernel)


# case -> (checkpoint fixture, method, detected source format, {linear: kernel} on cpu, on sm80)
CASES: dict[str, tuple[str, str, str, dict[str, str], dict[str, str]]] = {
    "bf16": ("smollm2_bf16", "auto", "dense", _everywhere("dense"), _everywhere("dense")),
    "bf16-online-fp8": ("smollm2_bf16", "fp8", "dense", _everywhere("cpu_fp8"), FP8_SM80),
    "fp8-dynamic": (
        "smollm2_fp8_dynamic",
        "auto",
        "compressed-tensors",
        _everywhere("cpu_fp8"),
        FP8_SM80,
    ),
    # a 4-bit checkpoint's cpu defaults: int8 activations (cpu_w4a8) and the int8 head (cpu_int8)
    "gptq-w4a16": ("smollm2_gptq", "auto", "compressed-tensors", _everywhere("cpu_w4a8"), INT4_SM80),
    "awq-gemm": ("smollm2_awq_packed", "auto", "awq", _everywhere("cpu_w4a8"), INT4_SM80),
}
HEAD = "lm_head"
HEAD_DEFAULT_KERNEL = "cpu_int8"  # the quantized head the cpu defaults add to a 4-bit checkpoint


def _params() -> list:
    return [pytest.param(case, target, id=f"{case}-{target}") for case in CASES for target in ("cpu", "sm80")]


# Every verified layer of an integer source is bit-exact after dequantization; FP8 requantization
# (online FP8 from bf16) is bounded by half an e4m3 step: 2^-4 relative.
FP8_REQUANT_REL_BOUND = 2.0**-4


@pytest.mark.parametrize(("case", "target"), _params())
def test_real_checkpoint_converts_and_verifies(
    case: str, target: str, request: pytest.FixtureRequest
) -> None:
    fixture, method, source_format, cpu_kernels, sm80_kernels = CASES[case]
    source: Path = request.getfixturevalue(fixture)
    artifact = smollm2.build_artifact(source, target, method=method)
    manifest = Manifest.load(artifact)

    assert manifest.target == target
    assert manifest.method == method
    assert manifest.architecture == "LlamaForCausalLM"
    assert manifest.source.format == source_format
    assert manifest.artifact_id == artifact.name

    expected_layers = {f"model.layers.{i}.{s}" for i in range(NUM_LAYERS) for s in RUNTIME_LINEARS}
    head = target == "cpu" and cpu_kernels == _everywhere("cpu_w4a8")
    # the tied lm_head stays the embedding, but for the int8 head of a 4-bit checkpoint on cpu
    assert set(manifest.layers) == expected_layers | ({HEAD} if head else set())
    assert len(manifest.layers) == NUM_LAYERS * FUSED_LINEARS_PER_LAYER + head
    if head:
        assert manifest.layers[HEAD].kernel == HEAD_DEFAULT_KERNEL
        assert manifest.options == {"quantize_head": "int8", "int8_activations": "4-bit"}
        expected_layers.add(HEAD)
    expected = cpu_kernels if target == "cpu" else sm80_kernels
    for name, entry in manifest.layers.items():
        if name == HEAD:
            continue
        linear = name.split(".", 3)[3]  # model.layers.{i}.<linear>
        assert entry.kernel == expected[linear], f"{name}: {entry.kernel}, rejected: {entry.rejected}"
        assert entry.fallback == (entry.kernel in FALLBACK_KERNELS), name

    assert manifest.verification.ok
    assert manifest.verification.layers_checked == len(expected_layers)
    for name, entry in manifest.layers.items():
        v = entry.verification
        assert v is not None and v.ok, f"{name}: {v}"
        assert v.value <= v.bound, f"{name}: {v.value} > {v.bound}"
        if method == "fp8":
            assert v.value <= FP8_REQUANT_REL_BOUND
    if method == "auto" and source_format != "dense":
        assert manifest.source.quantization is not None

    # every file the manifest names is there with its size
    for f in manifest.files:
        assert (artifact / f.name).stat().st_size == f.size, f.name


@pytest.mark.parametrize("case", ["gptq-w4a16", "awq-gemm"])
def test_real_checkpoint_conversion_is_a_stable_noop(case: str, request: pytest.FixtureRequest) -> None:
    fixture, method, *_ = CASES[case]
    source: Path = request.getfixturevalue(fixture)
    first = smollm2.build_artifact(source, "cpu", method=method)
    (again,) = convert(
        ConversionRequest(source=str(source), targets=["cpu"], method=method, out=str(first.parent))
    )
    assert again.reused
    assert again.artifact_id == first.name


# --- the checkpoints themselves are what they claim to be ------------------------------------------


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_bf16_checkpoint_matches_smollm2(smollm2_bf16: Path) -> None:
    cfg = _config(smollm2_bf16)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    gen = json.loads((smollm2_bf16 / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    assert (smollm2_bf16 / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (smollm2_bf16 / "tokenizer_config.json").read_text()
    )
    with safe_open(str(smollm2_bf16 / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


def test_gptq_checkpoint_is_pack_quantized_w4a16_g64(smollm2_gptq: Path) -> None:
    q = _config(smollm2_gptq)["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == "pack-quantized"
    (group,) = q["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (
        4,
        "int",
        True,
        "group",
        64,
    )
    with safe_open(str(smollm2_gptq / "model.safetensors"), "pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (576, 1536 // 8)  # (N, K / 8)
    assert tuple(scale.shape) == (576, 1536 // 64)  # (N, K / group)


def test_fp8_dynamic_checkpoint_is_channel_e4m3(smollm2_fp8_dynamic: Path) -> None:
    q = _config(smollm2_fp8_dynamic)["quantization_config"]
    assert q["format"] == "float-quantized"
    (group,) = q["config_groups"].values()
    assert group["weights"]["strategy"] == "channel" and group["weights"]["type"] == "float"
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["strategy"] == "token"
    with safe_open(str(smollm2_fp8_dynamic / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert w.dtype == torch.float8_e4m3fn and tuple(s.shape) == (576, 1)


def test_awq_checkpoint_dequantizes_to_the_awq_recipe(smollm2_awq_packed: Path, smollm2_bf16: Path) -> None:
    """AutoAWQ's own dequantizer reads back exactly the AWQ round-to-nearest weights of the bf16 source,
    and those are within one quantization step of the source weights (half a step from rounding, up
    to a full step where the zero point's own rounding pushes the group's max code past 15)."""
    from awq.utils.packing_utils import dequantize_gemm

    q = _config(smollm2_awq_packed)["quantization_config"]
    assert q == {
        **q,
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    }
    name = "model.layers.3.mlp.gate_proj"
    with safe_open(str(smollm2_awq_packed / "model.safetensors"), "pt") as f:
        qweight, qzeros, scales = (f.get_tensor(f"{name}.{s}") for s in ("qweight", "qzeros", "scales"))
    with safe_open(str(smollm2_bf16 / "model.safetensors"), "pt") as f:
        source = f.get_tensor(f"{name}.weight").float()  # (N, K)
    assert tuple(qweight.shape) == (576, 1536 // 8)  # (K, N / 8)
    assert tuple(qzeros.shape) == (576 // 64, 1536 // 8) and tuple(scales.shape) == (576 // 64, 1536)

    unpacked = dequantize_gemm(qweight, qzeros, scales.float(), 4, 64).t()  # (N, K)
    w_hat, _, _ = smollm2.awq_pseudo_quantize(source)
    assert torch.equal(unpacked, w_hat)
    step = scales.float().t().repeat_interleave(64, dim=1)  # (N, K)
    assert bool(((source - w_hat).abs() <= step * (1 + 1e-3)).all())
