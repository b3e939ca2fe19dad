"""A tampered artifact is refused at load, before anything is served: every layer's spec is checked
against the model config, every tensor's shape and dtype against what its kernel declares, and
`--verify` hashes every file (a flipped bit in a weight is otherwise invisible)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from devtools.builders.synthetic import Dims, write_checkpoint
from runtime.artifact.manifest import MANIFEST_NAME
from runtime.artifact.pull import PullError, verify_local
from runtime.loader import LoadError, load_model
from services.convert.library import ConversionRequest, convert

INT4_DIMS = Dims(hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1, head_dim=64, vocab=64)
QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPTQ int4 g64 checkpoint converted for cpu weight-only (cpu_int4 layers)."""
    work = tmp_path_factory.mktemp("int4")
    src = write_checkpoint(work / "src", "gptq", dims=INT4_DIMS, group_size=64)
    request = ConversionRequest(str(src), ["cpu"], out=str(work / "out"), int8_activations=False)
    result = convert(request)[0]
    return Path(result.uri)


def _tampered(artifact: Path, dest: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    out = dest / artifact.name
    shutil.copytree(artifact, out)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    edit(doc)
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    return out


def _set_shards(doc: dict[str, Any]) -> None:
    shards = doc["layers"][QKV]["spec"]["shards"]
    shards[0]["size"] -= 64
    shards[1]["size"] += 64


def _set_hidden(doc: dict[str, Any]) -> None:
    doc["hf_config"]["hidden_size"] *= 2


def _set_kernel(kernel: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["layers"][QKV]["kernel"] = kernel

    return edit


def _set_spec(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["layers"][QKV]["spec"].update(fields)

    return edit


def _set_vocab(doc: dict[str, Any]) -> None:
    doc["hf_config"]["vocab_size"] += 16


TAMPERS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "shard sizes": (_set_shards, "shard sizes"),
    "hidden size": (_set_hidden, r"hidden_size = 256 make model\.embed_tokens\.weight \(64, 256\)"),
    "kernel int4 -> int8": (_set_kernel("cpu_int8"), "cpu_int8 takes 8-bit weights only"),
    "kernel int4 -> gptq": (_set_kernel("gptq_wna16"), r"gptq_wna16 runs on the .* targets only"),
    "group size": (_set_spec(group_size=32), "scales_and_zeros"),
    "N": (_set_spec(n=192), "model config gives"),
    "asymmetric": (_set_spec(symmetric=False), "zero_offsets"),
    "vocab": (_set_vocab, r"vocab_size = 80, .* but rank 0's files hold it as \(64, 128\)"),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_tampered_manifests_are_refused_at_load(int4_artifact: Path, tmp_path: Path, case: str) -> None:
    load_model(int4_artifact, with_tokenizer=False)  # the untouched artifact loads
    edit, message = TAMPERS[case]
    with pytest.raises(LoadError, match=message):
        load_model(_tampered(int4_artifact, tmp_path, edit), with_tokenizer=False)


def test_a_rank_file_tensor_of_the_wrong_dtype_is_refused(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = tmp_path / llama_artifact[1].name
    shutil.copytree(llama_artifact[1], art)
    tensors = load_file(str(art / "rank0.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float16)
    save_file(tensors, str(art / "rank0.safetensors"))
    doc = json.loads((art / MANIFEST_NAME).read_text())
    entry = next(f for f in doc["files"] if f["name"] == "rank0.safetensors")
    entry["size"] = (art / "rank0.safetensors").stat().st_size
    (art / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(LoadError, match=r"down_proj.*weight is .* float16, expected .* float32"):
        load_model(art)


def test_verify_finds_a_flipped_bit_that_loading_does_not(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = tmp_path / llama_artifact[1].name
    shutil.copytree(llama_artifact[1], art)
    rank0 = art / "rank0.safetensors"
    data = bytearray(rank0.read_bytes())
    data[-5] ^= 0x10  # a weight byte near the end: the header and sizes stay valid
    rank0.write_bytes(bytes(data))
    load_model(art)  # shapes, sizes and headers are fine: only hashing sees it
    seen: list[int] = []
    with pytest.raises(PullError, match=r"rank0\.safetensors: sha256 mismatch"):
        verify_local(art, progress=lambda p: seen.append(p.bytes_done))
    verify_local(llama_artifact[1], progress=lambda p: seen.append(p.bytes_done))
    assert (
        seen
        and seen[-1]
        == sum(f.stat().st_size for f in llama_artifact[1].iterdir())
        - (llama_artifact[1] / MANIFEST_NAME).stat().st_size
    )
