"""The pull cache's own files (`.part`, `.part.progress`, `*.tmp`) against a real pull from the S3 test
server: links planted at their paths are never followed or written through, and a manifest may not
list a file under a name the cache reserves for them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
from transformers import PreTrainedModel

from runtime.artifact.manifest import MANIFEST_NAME, Manifest, ManifestError
from runtime.artifact.pull import pull
from runtime.settings import RuntimeSettings as Settings
from tests.fixtures.s3 import s3_test_env, upload_artifact

CHUNK = 64 << 10
VICTIM = b"a file outside the cache that a pull must never write\n"


def _victim(path: Path) -> Path:
    path.write_bytes(VICTIM)
    return path


def _entry(artifact: Path, name: str) -> dict[str, Any]:
    doc = json.loads((artifact / MANIFEST_NAME).read_text())
    return next(f for f in doc["files"] if f["name"] == name)


def _assert_published(dest: Path, src: Path) -> None:
    for entry in Manifest.load(src).files:
        assert (dest / entry.name).read_bytes() == (src / entry.name).read_bytes(), entry.name
    assert not [p.name for p in dest.iterdir() if p.is_symlink() or ".part" in p.name or p.suffix == ".tmp"]


def test_symlinks_planted_at_temporary_paths_are_not_followed(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    """Symlinks at `<name>.part.progress.tmp`, `manifest.json.tmp` and `<name>.part` are replaced by the
    pull's own fresh files: the files they point to stay as they were and the pull completes."""
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    dest = tmp_path / "cache" / src.name
    dest.mkdir(parents=True)
    planted = {
        "rank0.safetensors.part.progress.tmp": _victim(tmp_path / "progress-victim"),
        f"{MANIFEST_NAME}.tmp": _victim(tmp_path / "manifest-victim"),
        "config.json.part": _victim(tmp_path / "part-victim"),
    }
    for name, victim in planted.items():
        os.symlink(victim, dest / name)

    assert pull(uri, tmp_path / "cache", settings=Settings(), chunk_size=CHUNK) == dest
    for victim in planted.values():
        assert victim.read_bytes() == VICTIM
    _assert_published(dest, src)


def test_a_hard_link_planted_at_a_part_file_is_not_written_through(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    """A `.part` hard-linked to another file, with a progress record inviting the pull to resume into
    it, is not resumed: the pull starts that file afresh and the linked file keeps its bytes."""
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    dest = tmp_path / "cache" / src.name
    dest.mkdir(parents=True)
    entry = _entry(src, "rank0.safetensors")
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * entry["size"])
    os.link(victim, dest / "rank0.safetensors.part")
    record = {"sha256": entry["sha256"], "size": entry["size"], "chunk_size": CHUNK, "done": []}
    (dest / "rank0.safetensors.part.progress").write_text(json.dumps(record))

    pull(uri, tmp_path / "cache", settings=Settings(), chunk_size=CHUNK)
    assert victim.read_bytes() == b"\0" * entry["size"]
    _assert_published(dest, src)


def _upload_listing(endpoint: str, bucket: str, src: Path, name: str, payload: bytes) -> str:
    """`src` uploaded with one more file, `name`, listed in its manifest with its true size and digest."""
    uri = upload_artifact(endpoint, bucket, src)
    doc = json.loads((src / MANIFEST_NAME).read_text())
    doc["files"].append(
        {"name": name, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "rank": None}
    )
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    prefix = f"artifacts/{src.name}"
    client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=payload)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}", Body=json.dumps(doc).encode())
    return uri


RESERVED_NAMES = [
    "rank0.safetensors.part.progress",
    "rank0.safetensors.part",
    "config.json.tmp",
    "manifest.json.tmp",
]


@pytest.mark.parametrize("name", RESERVED_NAMES)
def test_a_manifest_listing_a_reserved_name_is_refused_before_anything_is_written(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path], name: str
) -> None:
    src = llama_artifact[1]
    uri = _upload_listing(s3_server, s3_bucket, src, name, b"listed under a reserved name\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ManifestError, match=rf"{name.replace('.', '[.]')}.* reserves"):
        pull(uri, cache, settings=Settings(), chunk_size=CHUNK)
    assert list(cache.iterdir()) == []


def test_kiln_pull_of_such_a_manifest_fails_with_one_line_and_exit_code_1(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    uri = _upload_listing(s3_server, s3_bucket, llama_artifact[1], "rank0.safetensors.part.progress", b"x")
    cache = tmp_path / "cache"
    env = {**os.environ, **s3_test_env(s3_server), "KILN_CACHE_DIR": str(cache)}
    kiln = Path(sys.executable).with_name("kiln")
    r = subprocess.run([str(kiln), "pull", uri], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "rank0.safetensors.part.progress" in last and "reserves" in last
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not cache.exists() or list(cache.iterdir()) == []
