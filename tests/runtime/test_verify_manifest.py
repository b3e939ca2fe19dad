"""`--verify` and `kiln pull` cover the manifest itself: its id fields against its artifact id, its
model config's values, its sha256 against a pin in the URI (`…@sha256:<hex>`) and against the digest
the pull from S3 recorded in the cache (runtime/artifact/manifest_pin.py)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedModel

from devtools.builders.synthetic import QWEN3_MOE_TINY, Dims, write_checkpoint
from devtools.builders.tiny_artifacts import copy_artifact, edit_manifest
from runtime.artifact.manifest import MANIFEST_NAME, ManifestError
from runtime.artifact.manifest_pin import RECORD_NAME, ManifestPinError
from runtime.artifact.pull import pull, verify_local
from runtime.loader import load_model
from runtime.model_layout import ModelConfigError
from runtime.settings import RuntimeSettings as Settings
from services.convert.library import ConversionRequest, convert
from tests.fixtures.s3 import upload_artifact

Edit = Callable[[dict[str, Any]], None]
ID_FIELD_EDITS: dict[str, Edit] = {
    "method": lambda doc: doc.update(method="fp8"),
    "options": lambda doc: doc["options"].update(lm_head_layer=True),
    "target": lambda doc: doc.update(target="sm90"),
    "source file digest": lambda doc: doc["source"]["files"].update({"config.json": "0" * 64}),
    "source digest and files": lambda doc: doc["source"].update(
        files={}, digest=hashlib.sha256(b"").hexdigest()
    ),
    "layout version": lambda doc: next(iter(doc["layers"].values())).update(layout_version=99),
}


def _digest(artifact: Path) -> str:
    return hashlib.sha256((artifact / MANIFEST_NAME).read_bytes()).hexdigest()


@pytest.mark.parametrize("case", sorted(ID_FIELD_EDITS))
def test_verify_refuses_a_manifest_whose_id_fields_were_edited(
    case: str, tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    edit_manifest(art, ID_FIELD_EDITS[case])
    with pytest.raises(ManifestError, match=r"was altered"):
        verify_local(art)
    with pytest.raises(ManifestError, match=r"was altered"):
        pull(str(art), tmp_path / "cache")  # `kiln pull DIR`


def test_verify_refuses_manifest_values_before_hashing(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    edit_manifest(art, lambda doc: doc["hf_config"].update(rms_norm_eps=2.0))
    hashed: list[str] = []
    with pytest.raises(ModelConfigError, match=r"hf_config: rms_norm_eps = 2\.0"):
        verify_local(art, progress=lambda p: hashed.append(p.file))
    assert hashed == []


def test_a_pin_in_a_local_uri_is_checked(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    digest = _digest(art)
    assert pull(f"{art}@sha256:{digest}", tmp_path / "cache") == art
    edit_manifest(art, lambda doc: doc["hf_config"].update(rms_norm_eps=2e-5))  # a valid value
    verify_local(art)  # the edit is consistent, only the pin tells
    with pytest.raises(ManifestPinError, match=f"the URI pins {digest}"):
        pull(f"{art}@sha256:{digest}", tmp_path / "cache")
    with pytest.raises(ManifestPinError, match="64 lowercase hex digits"):
        pull(f"{art}@sha256:{digest[:10]}", tmp_path / "cache")


def test_an_s3_pull_records_the_manifest_digest_and_verify_compares(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    dest = pull(uri, tmp_path / "cache", settings=Settings())
    assert (dest / RECORD_NAME).read_text().strip() == _digest(src)
    verify_local(dest)

    edit_manifest(dest, lambda doc: doc["hf_config"].update(rms_norm_eps=2e-5))
    with pytest.raises(ManifestPinError, match="was changed in the cache"):
        verify_local(dest)
    # A pull finds the cached manifest changed and fetches it again; the edit is gone.
    assert pull(uri, tmp_path / "cache", settings=Settings()) == dest
    assert _digest(dest) == _digest(src)
    verify_local(dest)
    assert load_model(dest).config.rms_norm_eps == 1e-5


def test_an_s3_pull_with_a_pin_refuses_another_manifest(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    cache = tmp_path / "cache"
    cache.mkdir()
    wrong = "0" * 64
    with pytest.raises(ManifestPinError, match=f"the URI pins {wrong}"):
        pull(f"{uri}@sha256:{wrong}", cache, settings=Settings())
    assert list(cache.iterdir()) == []  # nothing downloaded
    dest = pull(f"{uri}@sha256:{_digest(src)}", cache, settings=Settings())
    verify_local(dest, manifest_sha256=_digest(src))
    with pytest.raises(ManifestPinError):  # a cached copy does not satisfy another pin either
        pull(f"{uri}@sha256:{wrong}", cache, settings=Settings())


@pytest.mark.parametrize(
    "dims", [Dims(hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1), QWEN3_MOE_TINY]
)
def test_converted_artifacts_pass_verify(tmp_path: Path, dims: Dims) -> None:
    """The converter's own manifests (dense GPTQ int4, and Qwen3-MoE expert groups) satisfy every
    check: their ids are the digest of their id fields, their values in range."""
    src = write_checkpoint(tmp_path / "src", "gptq", dims=dims, group_size=64)
    result = convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out")))[0]
    verify_local(Path(result.uri))


def test_kiln_pull_prints_the_manifest_digest_and_honours_a_pin(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    kiln = str(Path(sys.executable).with_name("kiln"))
    r = subprocess.run([kiln, "pull", str(art)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == str(art)
    assert f"manifest sha256 {_digest(art)} (pin it: {art}@sha256:{_digest(art)})" in r.stderr

    pinned = subprocess.run(
        [kiln, "pull", f"{art}@sha256:{_digest(art)}"], capture_output=True, text=True, timeout=300
    )
    assert pinned.returncode == 0, pinned.stderr
    wrong = subprocess.run(
        [kiln, "pull", f"{art}@sha256:{'1' * 64}"], capture_output=True, text=True, timeout=300
    )
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert wrong.stderr.strip().splitlines()[-1].startswith("error:") and "the URI pins 1111" in wrong.stderr


def test_kiln_generate_honours_a_pin_on_a_local_directory(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    kiln = str(Path(sys.executable).with_name("kiln"))
    args = ["--prompt", "hi", "--max-tokens", "1"]
    ok = subprocess.run(
        [kiln, "generate", f"{art}@sha256:{_digest(art)}", *args], capture_output=True, text=True, timeout=300
    )
    assert ok.returncode == 0, ok.stderr
    wrong = subprocess.run(
        [kiln, "generate", f"{art}@sha256:{'2' * 64}", *args], capture_output=True, text=True, timeout=300
    )
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
    assert "the URI pins 2222" in wrong.stderr
