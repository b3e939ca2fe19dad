"""File names from a manifest never reach outside the artifact: refused in `Manifest.parse` itself, and
again where pull / verify / load join them to a directory (symlinks out of the artifact included)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import boto3
import pytest
from transformers import PreTrainedModel

from runtime.artifact.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    UnsafeArtifactPathError,
    artifact_file,
)
from runtime.artifact.pull import PullError, pull
from runtime.loader import load_model
from runtime.settings import RuntimeSettings as Settings

TRAVERSAL_NAMES = [
    "../../escaped.txt",
    "../escaped.txt",
    "..",
    ".",
    "/tmp/kiln-escaped.txt",
    "sub/dir.safetensors",
    "sub\\dir.safetensors",
    "rank0.safetensors\0.txt",
    ".hidden",
    "",
    "a" * 300,
]


def _doc(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact / MANIFEST_NAME).read_text())


def _with_extra_file(doc: dict[str, Any], name: str, payload: bytes) -> bytes:
    doc = json.loads(json.dumps(doc))
    doc["files"].append(
        {"name": name, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "rank": None}
    )
    return json.dumps(doc).encode()


@pytest.mark.parametrize("name", TRAVERSAL_NAMES)
def test_manifest_parse_refuses_names_that_are_not_plain_file_names(
    llama_artifact: tuple[PreTrainedModel, Path], name: str
) -> None:
    raw = _with_extra_file(_doc(llama_artifact[1]), name, b"owned\n")
    with pytest.raises(ManifestError, match="not a plain file name"):
        Manifest.parse(raw)


def test_manifest_parse_refuses_bad_ids_digests_and_duplicates(
    llama_artifact: tuple[PreTrainedModel, Path],
) -> None:
    doc = _doc(llama_artifact[1])
    for edit, message in (
        (lambda d: d.update(artifact_id="../../x"), "artifact_id"),
        (lambda d: d["files"][0].update(sha256="zz"), "sha256"),
        (lambda d: d["files"][0].update(size=-1), "size"),
        (lambda d: d["files"].append(dict(d["files"][0])), "twice"),
        (lambda d: d["files"][0].update(rank=7), "rank"),
    ):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        with pytest.raises(ManifestError, match=message):
            Manifest.parse(json.dumps(bad))


def test_artifact_file_refuses_symlinks_leading_out(tmp_path: Path) -> None:
    art = tmp_path / "ka-art"
    art.mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (art / "config.json").symlink_to(outside)
    with pytest.raises(UnsafeArtifactPathError, match="symlink leading out"):
        artifact_file(art, "config.json")
    (art / "inside.json").write_text("{}")
    (art / "alias.json").symlink_to(art / "inside.json")
    assert artifact_file(art, "alias.json") == art / "alias.json"  # a link within the artifact is fine
    with pytest.raises(UnsafeArtifactPathError):
        artifact_file(art, "../secret.txt")


def _upload_raw(endpoint: str, bucket: str, artifact: Path, manifest: bytes, extra: dict[str, bytes]) -> str:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    prefix = f"artifacts/{artifact.name}"
    for path in sorted(artifact.iterdir()):
        if path.name != MANIFEST_NAME:
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    for key, payload in extra.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=payload)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}", Body=manifest)
    return f"s3://{bucket}/{prefix}"


@pytest.mark.parametrize("name", ["../../escaped.txt", "/tmp/kiln-pull-escaped.txt"])
def test_s3_pull_never_writes_outside_the_cache(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path], name: str
) -> None:
    """A hostile manifest naming `../../escaped.txt` (size and sha256 matching the object stored under
    that key) is refused before anything is written; the cache and its surroundings stay as they were."""
    art = llama_artifact[1]
    payload = b"owned\n"
    uri = _upload_raw(
        s3_server, s3_bucket, art, _with_extra_file(_doc(art), name, payload), {name.lstrip("/"): payload}
    )
    cache = tmp_path / "deep" / "cache"
    cache.mkdir(parents=True)
    Path("/tmp/kiln-pull-escaped.txt").unlink(missing_ok=True)
    with pytest.raises(ManifestError, match="not a plain file name"):
        pull(uri, cache, settings=Settings())
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [Path("deep"), Path("deep/cache")]
    assert not Path("/tmp/kiln-pull-escaped.txt").exists()


def test_s3_pull_refuses_uris_that_do_not_name_the_artifact(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = llama_artifact[1]
    with pytest.raises(PullError, match="artifact id"):
        pull(f"s3://{s3_bucket}/artifacts/..", tmp_path / "cache", settings=Settings())
    with pytest.raises(PullError, match="artifact id"):
        pull(f"s3://{s3_bucket}/artifacts/../{art.name}", tmp_path / "cache", settings=Settings())
    # The object under another artifact's id: its manifest names its own id, so it is refused.
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    other = "ka-" + "0" * 32
    client.put_object(
        Bucket=s3_bucket, Key=f"artifacts/{other}/{MANIFEST_NAME}", Body=(art / MANIFEST_NAME).read_bytes()
    )
    with pytest.raises(PullError, match=f"describes artifact {art.name}"):
        pull(f"s3://{s3_bucket}/artifacts/{other}", tmp_path / "cache", settings=Settings())
    assert not (tmp_path / "cache" / other).exists()


def _copy(artifact: Path, dest: Path) -> Path:
    out = dest / artifact.name
    shutil.copytree(artifact, out)
    return out


def test_local_pull_never_reads_outside_the_artifact(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    """`kiln pull <dir>` verifies in place: a manifest naming ../../../../etc/passwd (with its real
    size and digest) is refused, and so is a symlinked file that leads out of the artifact."""
    art = _copy(llama_artifact[1], tmp_path)
    passwd = Path("/etc/passwd").read_bytes()
    (art / MANIFEST_NAME).write_bytes(_with_extra_file(_doc(art), "../../../../etc/passwd", passwd))
    with pytest.raises(ManifestError, match="not a plain file name"):
        pull(str(art), tmp_path / "cache")

    art2 = _copy(llama_artifact[1], tmp_path / "second")
    (art2 / "config.json").unlink()
    os.symlink("/etc/passwd", art2 / "config.json")
    with pytest.raises(UnsafeArtifactPathError, match="symlink leading out"):
        pull(str(art2), tmp_path / "cache")
    with pytest.raises(UnsafeArtifactPathError, match="symlink leading out"):
        load_model(art2)
