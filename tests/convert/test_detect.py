"""Format detection and the one clear message for unsupported inputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.builders.synthetic import write_checkpoint
from kernels.errors import UnsupportedError
from services.convert.errors import ConversionError
from services.convert.library import open_and_detect, plan

SUPPORTED_HINT = "Kiln supports: GPTQ"


def _with_quant(path: Path, quant: dict[str, Any] | None) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quant is not None:
        cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    ("name", "fmt", "describe"),
    [
        ("gptq-w4-v1-sym", "gptq", "gptq (v1 zeros)"),
        ("gptq-w4-v2-asym", "gptq", "gptq (v2 zeros)"),
        ("gptq-w4-mislabeled-v2", "gptq", "gptq (v2 zeros)"),
        ("awq-gemm", "awq", "awq"),
        ("fp8-tensor", "fp8", "fp8"),
        ("ct-w4a16-sym", "compressed-tensors", "compressed-tensors"),
        ("ct-fp8-channel", "compressed-tensors", "compressed-tensors"),
        ("bf16", "dense", "dense"),
        ("bf16-sharded", "dense", "dense"),
    ],
)
def test_detects_format(ckpt: Callable[[str], Path], name: str, fmt: str, describe: str) -> None:
    checkpoint, detected = open_and_detect(str(ckpt(name)))
    assert detected.name == fmt and detected.describe() == describe
    assert checkpoint.tensors


def test_sharded_checkpoint_reads_every_file(ckpt: Callable[[str], Path]) -> None:
    checkpoint, _ = open_and_detect(str(ckpt("bf16-sharded")))
    assert len(checkpoint.weight_files) == 2
    assert {checkpoint.info(n).file for n in checkpoint.tensors} == set(checkpoint.weight_files)


def test_quantize_config_json_side_file(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "side", "gptq", quant_config_file="quantize_config.json")
    p = plan(str(path), "sm80")
    assert p.format == "gptq"
    assert any("quantize_config.json" in n for n in p.notes)
    assert {r.kernel for r in p.rows if r.layer != "lm_head"} == {"marlin_wna16"}


def test_awq_quant_config_json_legacy_keys(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "awq", "awq", quant_config_file="quant_config.json")
    (path / "quant_config.json").write_text(
        json.dumps({"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"})
    )
    assert plan(str(path), "sm80").format == "awq"


_GPTQ = {"quant_method": "gptq", "group_size": 128, "desc_act": False}
_CT_W4A8 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
            "input_activations": {"num_bits": 8, "type": "int"},
        }
    },
}
_CT_NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            # NVFP4 is groups of 16 (vLLM's rule): groups of 32 are no FP4 layout vLLM runs
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 32},
        }
    },
}
_AWQ_GEMV = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}


@pytest.mark.parametrize(
    ("base", "quant", "match"),
    [
        (
            "bf16",
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
            "'int4'",
        ),
        ("bf16", {"quant_method": "hqq"}, "HQQ"),
        ("bf16", {"quant_method": "mystery"}, "'mystery' is not supported"),
        ("awq-gemm", _AWQ_GEMV, "GEMV"),
        ("gptq-w4-v1-sym", {**_GPTQ, "bits": 4, "checkpoint_format": "marlin"}, "pre-packed"),
        ("gptq-w4-v1-sym", {**_GPTQ, "bits": 5}, "5 bits"),
        ("ct-w4a16-sym", _CT_W4A8, "not supported"),
        ("ct-w4a16-sym", _CT_NVFP4, "nvfp4"),
    ],
)
def test_unsupported_inputs_say_what_is_supported(
    ckpt: Callable[[str], Path], tmp_path: Path, base: str, quant: dict[str, Any], match: str
) -> None:
    import shutil

    path = shutil.copytree(ckpt(base), tmp_path / "c")
    _with_quant(path, quant)
    with pytest.raises(UnsupportedError, match=match) as err:
        plan(str(path), "sm80")
    assert SUPPORTED_HINT in str(err.value)


def test_a_truncated_gguf_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match=r"model\.Q4_0\.gguf"):
        plan(str(tmp_path), "cpu")


def test_three_bit_has_no_marlin_kernel(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "w3", "gptq", bits=3)
    with pytest.raises(UnsupportedError, match="3-bit") as err:
        plan(str(path), "sm80")
    assert "marlin_wna16" in str(err.value)
    # on cpu the dense fp32 path takes it (lossless)
    assert {r.kernel for r in plan(str(path), "cpu").rows} == {"dense"}


def test_fp8_pin_on_quantized_checkpoint_is_an_error(ckpt: Callable[[str], Path]) -> None:
    with pytest.raises(UnsupportedError, match="already quantized"):
        plan(str(ckpt("gptq-w4-v1-sym")), "sm90", method="fp8")


def test_bad_inputs(ckpt: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="unknown target"):
        plan(str(ckpt("bf16")), "sm100")
    with pytest.raises(UnsupportedError, match="method"):
        plan(str(ckpt("bf16")), "cpu", method="int4")
    with pytest.raises(ConversionError, match=r"no config\.json"):
        plan(str(tmp_path), "cpu")
    with pytest.raises(UnsupportedError, match="FP8 block"):
        plan(str(ckpt("fp8-block")), "sm80", tp=2)


def test_fused_shards_must_agree(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "gptq", "gptq", ignore=["model.layers.0.mlp.up_proj"])
    with pytest.raises(UnsupportedError, match=r"gate_proj: int4 g128 sym, .*up_proj: dense"):
        plan(str(path), "sm80")
