"""What the plugin refuses, before any weight is read, and the config.json mark that makes vLLM pick
Kiln's quantization config. These run without vLLM: the checks live in vLLM-free modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from devtools.builders.synthetic import QWEN3_MOE_TINY, write_checkpoint
from runtime.artifact.hf_config import KILN_QUANT_METHOD
from runtime.artifact.manifest import Manifest
from runtime.loader import LoadError, TargetMismatchError, checked_linear_layers, map_rank_files
from runtime.model_layout import ModelConfig
from runtime.vllm_plugin.artifact import PluginError, VllmArtifact, open_artifact
from runtime.vllm_plugin.compat import ALLOW_UNTESTED_ENV, UnsupportedVllmError, check_vllm_version
from services.convert.library import ConversionRequest, convert


def _convert(tmp_path: Path, fmt: str, target: str, tp: int = 1, **kw: object) -> Path:
    """The checkpoint converted for vLLM: its 16-bit head kept (what the plugin serves)."""
    src = write_checkpoint(tmp_path / f"src-{fmt}", fmt, **kw)  # type: ignore[arg-type]
    request = ConversionRequest(str(src), [target], tp=tp, out=str(tmp_path / "out"), quantize_head="none")
    return Path(convert(request)[0].uri)


def test_config_json_names_kilns_quantization_and_the_manifest_keeps_the_source(tmp_path: Path) -> None:
    artifact = _convert(tmp_path, "gptq", "cpu")
    config = json.loads((artifact / "config.json").read_text())
    manifest = Manifest.load(artifact)
    assert config["quantization_config"] == {
        "quant_method": KILN_QUANT_METHOD,
        "artifact_id": manifest.artifact_id,
        "target": "cpu",
        "source_format": "gptq",
    }
    assert manifest.hf_config["quantization_config"]["quant_method"] == "gptq"
    assert {k: v for k, v in config.items() if k != "quantization_config"} == {
        k: v for k, v in manifest.hf_config.items() if k != "quantization_config"
    }


def test_a_gpu_artifact_is_refused_on_cpu_naming_the_target_to_convert_for(tmp_path: Path) -> None:
    artifact = _convert(tmp_path, "gptq", "sm80")
    with pytest.raises(TargetMismatchError, match="convert with --target cpu"):
        open_artifact(artifact, device="cpu", rank=0, world_size=1, verify=False)


def test_a_tp_mismatch_is_refused_naming_the_flag(tmp_path: Path) -> None:
    artifact = _convert(tmp_path, "dense", "cpu", tp=2)
    with pytest.raises(LoadError, match=r"--tensor-parallel-size 2, or convert with --tp 1"):
        open_artifact(artifact, device="cpu", rank=0, world_size=1, verify=False)


def test_the_int8_head_of_the_cpu_defaults_is_refused_naming_the_option(tmp_path: Path) -> None:
    """A 4-bit checkpoint's default cpu conversion quantizes lm_head, which vLLM's lm_head cannot take."""
    src = write_checkpoint(tmp_path / "src", "gptq")
    [result] = convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out")))
    assert result.manifest.layers["lm_head"].kernel == "cpu_int8"
    with pytest.raises(PluginError, match=r"lm_head is stored for kernel cpu_int8.*--quantize-head none"):
        open_artifact(result.uri, device="cpu", rank=0, world_size=1, verify=False)


def test_a_moe_artifact_opens_with_every_expert_group_checked(tmp_path: Path) -> None:
    artifact = _convert(tmp_path, "gptq", "cpu", dims=QWEN3_MOE_TINY, group_size=32)
    opened = open_artifact(artifact, device="cpu", rank=0, world_size=1, verify=False)
    assert set(opened.expert_groups) == set(opened.manifest.expert_groups) != set()
    group = next(iter(opened.expert_groups.values()))
    assert group.spec.num_experts == QWEN3_MOE_TINY.num_experts
    assert all(name.startswith(("w13.", "w2.")) for name in group.tensors)
    with pytest.raises(PluginError, match="mixture-of-experts layer"):
        opened.expert_group("model.layers.9.mlp.experts")


def test_open_maps_the_rank_files_and_checks_every_layer(tmp_path: Path) -> None:
    artifact = _convert(tmp_path, "gptq", "cpu")
    opened = open_artifact(artifact, device="cpu", rank=0, world_size=1, verify=True)
    assert set(opened.linears) == set(opened.manifest.layers)
    lo, hi = opened.address_ranges()[0]
    assert all(lo <= t.data_ptr() < hi for t in opened.tensors.values())
    with pytest.raises(PluginError, match="does not have"):
        opened.linear("model.layers.0.mlp.not_a_layer")


def test_vllm_versions_outside_the_tested_range_are_refused_unless_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    with pytest.raises(UnsupportedVllmError, match=r"tested with vLLM 0\.32\.x; this is vLLM 0\.31\.1"):
        check_vllm_version("0.31.1")
    with pytest.raises(UnsupportedVllmError, match=r"this is vLLM 0\.34\.0"):
        check_vllm_version("0.34.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_vllm_version("0.34.0")


def test_vllm_0_33_whose_interfaces_were_compared_loads_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="runtime.vllm_plugin.compat"):
        check_vllm_version("0.33.0")
    assert "has not served an artifact" in caplog.text


def test_a_model_dtype_a_layer_cannot_take_is_refused_naming_layer_kernel_and_dtype(tmp_path: Path) -> None:
    """A GPU artifact's layers take its act dtype only (scales stored in it): another vLLM --dtype is
    refused before vLLM builds its model. Opened as the plugin opens it on a GPU host (this one has
    none, so the target check is left out); a CPU artifact takes every dtype."""
    gpu = _convert(tmp_path, "gptq", "sm80")  # a float16 checkpoint: float16 activations
    manifest = Manifest.load(gpu)
    cfg = ModelConfig.from_hf(manifest.hf_config, manifest.architecture)
    files = map_rank_files(gpu, manifest, 0)
    tensors = {name: t for mapped in files for name, t in mapped.tensors.items()}
    linears = {layer.name: layer for layer in checked_linear_layers(manifest, cfg, tensors, 0, 1)}
    opened = VllmArtifact(gpu, manifest, cfg, "cuda", 0, 1, files, tensors, linears, {})
    opened.check_model_dtype(torch.float16)
    with pytest.raises(
        PluginError,
        match=r"layer model\.layers\.0\.self_attn\.qkv_proj: kernel marlin_wna16 of this sm80 artifact takes "
        r"float16 activations, not vLLM's model dtype bfloat16: run vLLM with --dtype float16",
    ):
        opened.check_model_dtype(torch.bfloat16)

    cpu = open_artifact(_convert(tmp_path, "gptq", "cpu"), device="cpu", rank=0, world_size=1, verify=False)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cpu.check_model_dtype(dtype)


def test_every_vllm_kernel_a_kiln_kernel_names_has_a_call_in_the_plugin() -> None:
    """The plugin's GPU map is keyed by what the kernels declare (`LinearKernel.vllm_kernel`)."""
    from kernels.registry import candidates
    from kernels.targets import GPU_TARGETS
    from runtime.vllm_plugin.vllm_kernels import VLLM_KERNELS

    named = {k.vllm_kernel for t in GPU_TARGETS for k in candidates(t) if k.vllm_kernel}
    assert named == set(VLLM_KERNELS)
