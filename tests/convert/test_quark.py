"""AMD Quark FP8 checkpoints. amd-quark 0.13's exporter needs onnx / onnxscript / evaluate / plotly
and friends, which the test environment does not install, so `write_quark_fp8` writes the format from
Quark's documented export layout (config.json `quantization_config` with quant_method "quark",
`global_quant_config`, `exclude`; per module `weight` e4m3, `weight_scale`, static `input_scale`),
the one vLLM's QuarkConfig reads as QuarkW8A8Fp8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from devtools.builders.tiny_artifacts import save_checkpoint, tiny_hf_model
from kernels.errors import UnsupportedError
from services.convert.library import ConversionRequest, convert, plan
from tests.helpers.producers import served_log_prob_delta, with_weights

FP8_MAX = 448.0
LOGPROB_MEAN_ABS_TOL = 0.05  # bf16 / per-token FP8 activations against the fp32 reference
PROMPT = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 65]]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _spec(qscheme: str) -> dict[str, object]:
    return {"dtype": "fp8_e4m3", "qscheme": qscheme, "ch_axis": 0 if qscheme == "per_channel" else None,
            "group_size": None, "symmetric": True, "is_dynamic": False, "round_method": "half_even",
            "scale_type": "float", "observer_cls": "PerTensorMinMaxObserver"}  # fmt: skip


def write_quark_fp8(model: torch.nn.Module, out: Path, qscheme: str) -> dict[str, torch.Tensor]:
    """`model` (bf16) saved as Quark exports FP8 W8A8 with `qscheme` weights; returns every quantized
    module's dequantized fp32 weight (e4m3 * weight_scale)."""
    save_checkpoint(model, out)
    tensors = load_file(str(out / "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED]:
        w = tensors[name].float()
        amax = w.abs().amax(dim=1) if qscheme == "per_channel" else w.abs().amax()
        scale = (amax / FP8_MAX).float()
        q = (w / (scale[:, None] if qscheme == "per_channel" else scale)).to(torch.float8_e4m3fn)
        module = name.removesuffix(".weight")
        tensors[name] = q
        tensors[f"{module}.weight_scale"] = (
            scale.reshape(-1) if qscheme == "per_channel" else scale.reshape(())
        )
        tensors[f"{module}.input_scale"] = torch.tensor(0.02, dtype=torch.float32)
        dequantized[module] = q.float() * (scale[:, None] if qscheme == "per_channel" else scale)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "quark",
        "global_quant_config": {
            "weight": _spec(qscheme),
            "input_tensors": _spec("per_tensor"),
            "output_tensors": None,
            "bias": None,
        },
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["lm_head"],
        "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized"},
        "quant_mode": "eager_mode",
        "version": "0.13",
    }
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.mark.parametrize("qscheme", ["per_tensor", "per_channel"])
def test_quark_fp8_plans_everywhere_converts_exactly_and_serves(tmp_path: Path, qscheme: str) -> None:
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to(
        torch.bfloat16
    )
    weights = write_quark_fp8(model, tmp_path / "quark", qscheme)
    strategy = qscheme.removeprefix("per_")
    kernels = {"sm80": "fp8_marlin", "sm90": "fp8_w8a8", "cpu": "cpu_fp8"}
    for target, kernel in kernels.items():
        p = plan(str(tmp_path / "quark"), target)
        qkv = next(r for r in p.rows if r.layer == "model.layers.0.self_attn.qkv_proj")
        assert (qkv.scheme, qkv.kernel) == (f"fp8 {strategy}", kernel), (target, qkv)
        assert any("input_scale" in n for n in p.notes), p.notes
    results = convert(ConversionRequest(str(tmp_path / "quark"), ["cpu", "sm90"], out=str(tmp_path / "out")))
    for r in results:
        v = r.manifest.verification
        assert v.ok and v.layers_checked == 9 and r.manifest.source.format == "quark", v
    reference = with_weights(model, weights)
    cpu = next(r for r in results if r.target.value == "cpu")
    assert served_log_prob_delta(cpu.uri, reference, PROMPT) <= LOGPROB_MEAN_ABS_TOL


@pytest.mark.parametrize(
    ("edit", "match"),
    [({"layer_quant_config": {"*down_proj": {}}}, "layer_quant_config"),
     ({"global_quant_config": {"weight": {"dtype": "uint4", "qscheme": "per_group"}}}, "'uint4'")],
)  # fmt: skip
def test_quark_schemes_kiln_does_not_read_are_refused_with_the_supported_list(
    tmp_path: Path, edit: dict[str, object], match: str
) -> None:
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to(
        torch.bfloat16
    )
    write_quark_fp8(model, tmp_path / "quark", "per_tensor")
    config = json.loads((tmp_path / "quark" / "config.json").read_text())
    config["quantization_config"].update(edit)
    (tmp_path / "quark" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match=match) as info:
        plan(str(tmp_path / "quark"), "sm80")
    assert "Kiln supports:" in str(info.value)
