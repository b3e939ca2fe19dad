"""The loader binds tensors straight from the memory-mapped files and refuses artifacts it can't run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from runtime.artifact.manifest import MANIFEST_NAME, ManifestError
from runtime.loader import LoadError, TargetMismatchError, load_model

# RSS may grow by at most this fraction of the weights' bytes right after load (module objects,
# tokenizer, page tables: a fixed few MB, not the weights).
RSS_GROWTH_MAX_FRACTION = 0.25


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def medium_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """≈60 MB of fp32 weights: large enough that a copy would show in RSS."""
    model = tiny_hf_model(
        "llama",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    return write_artifact(model, tmp_path_factory.mktemp("medium"))


def test_tensors_point_into_the_mapping_and_rss_does_not_grow(medium_artifact: Path) -> None:
    load_model(medium_artifact)  # warm-up: first-time imports and tokenizer caches are not the weights
    weights_bytes = sum((medium_artifact / f).stat().st_size for f in ["rank0.safetensors"])
    before = _rss_bytes()
    lm = load_model(medium_artifact)
    grown = _rss_bytes() - before
    assert grown < RSS_GROWTH_MAX_FRACTION * weights_bytes, f"RSS grew by {grown} for {weights_bytes} bytes"

    ranges = [f.address_range for f in lm.files]
    tensors = [*lm.model.parameters(), *lm.model.buffers()]
    assert len(tensors) == len(lm.files[0].tensors)  # every tensor of the file is bound, none twice
    for t in tensors:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        assert any(lo <= start and end <= hi for lo, hi in ranges), "tensor outside the file mapping (a copy)"
    assert lm.model.lm_head is not None  # untied: an lm_head layer, its tensors among those checked above


def test_refuses_gpu_target_without_cuda(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    path = write_artifact(llama_artifact[0], tmp_path, target="sm90")
    with pytest.raises(
        TargetMismatchError,
        match="built for sm90; this machine has no CUDA device — convert with --target cpu",
    ):
        load_model(path)


def test_refuses_unknown_schema_version(tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    path = tmp_path / "a"
    shutil.copytree(llama_artifact[1], path)
    data = json.loads((path / MANIFEST_NAME).read_text())
    data["schema_version"] = 99
    (path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="schema_version 99 is not supported"):
        load_model(path)


def test_refuses_truncated_rank_file_and_wrong_tp(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    path = tmp_path / "a"
    shutil.copytree(llama_artifact[1], path)
    with pytest.raises(LoadError, match="sharded for tp=1"):
        load_model(path, rank=0, world_size=2)
    rank_file = path / "rank0.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])
    with pytest.raises(LoadError, match=r"rank0\.safetensors has .* bytes, the manifest says .*truncated"):
        load_model(path)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_cpu_activation_dtype_follows_the_cpu_or_the_setting(
    tmp_path: Path,
    llama_artifact: tuple[PreTrainedModel, Path],
    native_bf16: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "auto": bf16 where the CPU multiplies bf16 natively and every kernel prefers it; KILN_CPU_ACT_DTYPE
    (or load_model's cpu_act_dtype) forces fp32 anywhere and bf16 wherever the kernels take it, so one
    machine runs the other kind's path. A dense artifact (fp32 CPU weights) stays fp32."""
    from devtools.builders.synthetic import write_checkpoint
    from runtime import settings as settings_module
    from services.convert.library import ConversionRequest, convert

    monkeypatch.setattr("runtime.loader.has_native_bf16", lambda: native_bf16)
    source = write_checkpoint(tmp_path / "src", "gptq")
    # its lm_head as cpu_int8: every layer's kernel prefers bf16
    [int4] = convert(ConversionRequest(str(source), ["cpu"], out=str(tmp_path), quantize_head="int8"))
    auto = torch.bfloat16 if native_bf16 else torch.float32
    for setting, want in (("auto", auto), ("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        assert load_model(int4.uri, with_tokenizer=False, cpu_act_dtype=setting).dtype == want, setting
        monkeypatch.setenv("KILN_CPU_ACT_DTYPE", setting)
        monkeypatch.setattr(settings_module, "_current", None)
        assert load_model(int4.uri, with_tokenizer=False).dtype == want, setting
        assert load_model(llama_artifact[1], with_tokenizer=False).dtype == torch.float32, setting
