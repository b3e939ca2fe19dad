"""TorchAO checkpoints quantized and saved by transformers + torchao 0.18 on CPU: int4 weight-only
(`IntxWeightOnlyConfig`, symmetric and asymmetric, per group) and `Int8WeightOnlyConfig`. Each plans
for sm80, sm90 and cpu; every layer of the artifacts equals torchao's own `dequantize()` of the
tensor subclass; the CPU artifact serves the log-probs transformers computes in fp32 on those weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from devtools.builders.tiny_artifacts import save_checkpoint, tiny_hf_model
from services.convert.library import ConversionRequest, convert, plan
from tests.helpers.producers import producer_rows, served_log_prob_delta, stored_layers, with_weights

torchao = pytest.importorskip("torchao")

GROUP = 64
LOGPROB_MEAN_ABS_TOL = 0.05  # bf16 activations against the fp32 reference
PROMPT = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 65]]
KINDS = {"int4-sym": ("int4 g64 sym", "marlin_wna16"), "int4-asym": ("int4 g64 asym", "marlin_wna16"),
         "int8": ("int8 channel sym", "marlin_wna16")}  # fmt: skip


def _config(kind: str):  # a torchao config object
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, MappingType, PerGroup

    if kind == "int8":
        return Int8WeightOnlyConfig()
    mapping = MappingType.SYMMETRIC if kind == "int4-sym" else MappingType.ASYMMETRIC
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(GROUP), mapping_type=mapping)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("torchao")
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return save_checkpoint(model.to(torch.bfloat16), root / "bf16"), model


@pytest.mark.parametrize("kind", list(KINDS))
def test_torchao_checkpoints_plan_everywhere_and_equal_torchaos_dequantization(
    tiny: tuple[Path, torch.nn.Module], kind: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, TorchAoConfig

    src, model = tiny
    quantized = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=TorchAoConfig(_config(kind)), device_map="cpu", dtype=torch.bfloat16
    )
    quantized.save_pretrained(str(tmp_path / "ao"), safe_serialization=True)
    (tmp_path / "ao" / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (tmp_path / "ao" / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    producer = {
        name: module.weight.dequantize().float()
        for name, module in quantized.named_modules()
        if isinstance(module, torch.nn.Linear) and hasattr(module.weight, "qdata")
    }
    scheme, gpu_kernel = KINDS[kind]
    for target in ("sm80", "sm90", "cpu"):
        qkv = next(
            r for r in plan(str(tmp_path / "ao"), target).rows if r.layer.endswith("0.self_attn.qkv_proj")
        )
        assert qkv.scheme.startswith(scheme), (target, qkv)
        assert target == "cpu" or qkv.kernel == gpu_kernel, (target, qkv)
    weight_only = {"quantize_head": "none", "int8_activations": False}
    results = convert(
        ConversionRequest(str(tmp_path / "ao"), ["cpu", "sm80"], out=str(tmp_path / "out"), **weight_only)
    )  # type: ignore[arg-type]
    for r in results:
        assert r.manifest.verification.ok and r.manifest.source.format == "torchao"
        for layer, spec, got in stored_layers(r):
            want = producer_rows(producer, spec, layer)
            # torchao dequantizes into its bf16 dtype; the kernels keep its bf16 scales (cpu_int4: the
            # asymmetric offset exact in fp32 beside them): within bf16 steps of the row's largest weight
            bound = 2.0**-7 * want.abs().amax(dim=1, keepdim=True)
            assert bool(((got - want).abs() <= bound).all()), (r.target, layer)
    reference = with_weights(model, producer)
    cpu = next(r for r in results if r.target.value == "cpu")
    assert served_log_prob_delta(cpu.uri, reference, PROMPT) <= LOGPROB_MEAN_ABS_TOL


def test_torchao_configs_kiln_does_not_read_are_refused_with_the_supported_list(
    tiny: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    import json
    import shutil

    from kernels.errors import UnsupportedError

    ckpt = shutil.copytree(tiny[0], tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "torchao",
        "quant_type": {
            "default": {"_type": "Int4WeightOnlyConfig", "_version": 2, "_data": {"group_size": 128}}
        },
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="Int4WeightOnlyConfig") as info:
        plan(str(ckpt), "sm80")
    assert "Kiln supports:" in str(info.value)
