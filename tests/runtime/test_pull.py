"""`pull` against a real S3-protocol server (moto on loopback): ranged, resumable, verified, atomic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import boto3
import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import write_artifact
from runtime.artifact.manifest import MANIFEST_NAME, Manifest
from runtime.artifact.pull import PROGRESS_SUFFIX, PullError, PullProgress, pull
from runtime.loader import load_model
from runtime.settings import RuntimeSettings as Settings
from tests.fixtures.s3 import upload_artifact

CHUNK = 64 << 10  # small ranges so that every rank file takes several GETs


def _client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


class Recorder:
    def __init__(self, fail_after: int | None = None) -> None:
        self.events: list[PullProgress] = []
        self.fail_after = fail_after

    def __call__(self, event: PullProgress) -> None:
        self.events.append(event)
        if self.fail_after is not None and len(self.events) >= self.fail_after:
            raise KeyboardInterrupt("simulated crash mid-pull")

    @property
    def fetched(self) -> int:
        return max((e.bytes_fetched for e in self.events), default=0)


def test_pull_verifies_publishes_and_reuses_the_cache(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    rec = Recorder()
    dest = pull(uri, tmp_path / "cache", settings=Settings(), chunk_size=CHUNK, progress=rec)
    assert dest == tmp_path / "cache" / src.name
    for entry in Manifest.load(src).files:
        assert (dest / entry.name).read_bytes() == (src / entry.name).read_bytes()
    assert (dest / MANIFEST_NAME).read_bytes() == (src / MANIFEST_NAME).read_bytes()
    assert not list(dest.glob("*.part*"))
    assert rec.fetched == sum(e.size for e in Manifest.load(src).files)
    assert len(rec.events) > len(Manifest.load(src).files)  # several ranges per rank file
    load_model(dest)

    # Cached: the second pull needs no network at all (the bucket is emptied first).
    client = _client(s3_server)
    for obj in client.list_objects_v2(Bucket=s3_bucket)["Contents"]:
        client.delete_object(Bucket=s3_bucket, Key=obj["Key"])
    again = Recorder()
    assert pull(uri, tmp_path / "cache", settings=Settings(), progress=again) == dest
    assert again.fetched == 0


def test_a_rank_pulls_only_its_own_files(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = write_artifact(llama_artifact[0], tmp_path / "src", tp=2)
    uri = upload_artifact(s3_server, s3_bucket, src)
    dest = pull(uri, tmp_path / "cache", rank=1, settings=Settings(), chunk_size=CHUNK)
    assert (dest / "rank1.safetensors").is_file() and not (dest / "rank0.safetensors").exists()
    assert (dest / "config.json").is_file() and (dest / "tokenizer.json").is_file()
    rec = Recorder()
    pull(uri, tmp_path / "cache", rank=0, settings=Settings(), chunk_size=CHUNK, progress=rec)
    assert rec.fetched == (src / "rank0.safetensors").stat().st_size  # rank 0's file only
    with pytest.raises(PullError, match="rank 2 does not exist"):
        pull(uri, tmp_path / "other", rank=2, settings=Settings())


def test_an_interrupted_pull_resumes_where_it_stopped(
    tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    crash = Recorder(fail_after=3)
    with pytest.raises(KeyboardInterrupt):
        pull(uri, tmp_path / "cache", settings=Settings(), chunk_size=CHUNK, progress=crash, workers=1)
    dest = tmp_path / "cache" / src.name
    assert not (dest / MANIFEST_NAME).exists() and not (dest / "rank0.safetensors").exists()
    record = json.loads((dest / f"rank0.safetensors{PROGRESS_SUFFIX}").read_text())
    kept = len(record["done"])
    assert kept >= 3  # the ranges written before the crash (a worker may finish one more)

    total = sum(e.size for e in Manifest.load(src).files)
    resumed = Recorder()
    pull(uri, tmp_path / "cache", settings=Settings(), chunk_size=CHUNK, progress=resumed)
    assert resumed.fetched == total - kept * CHUNK  # only the missing ranges are fetched
    assert (dest / "rank0.safetensors").read_bytes() == (src / "rank0.safetensors").read_bytes()


@pytest.mark.parametrize("damage", ["tampered", "truncated"])
def test_tampered_or_truncated_files_are_refused(
    damage: str, tmp_path: Path, s3_server: str, s3_bucket: str, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = llama_artifact[1]
    uri = upload_artifact(s3_server, s3_bucket, src)
    data = bytearray((src / "rank0.safetensors").read_bytes())
    if damage == "tampered":
        data[len(data) // 2] ^= 0xFF
        match = "rank0.safetensors: sha256 mismatch: expected [0-9a-f]{64}, got [0-9a-f]{64}"
    else:
        data = data[: len(data) - 1000]
        match = "rank0.safetensors.*truncated"
    _client(s3_server).put_object(
        Bucket=s3_bucket, Key=f"artifacts/{src.name}/rank0.safetensors", Body=bytes(data)
    )
    with pytest.raises(PullError, match=match):
        pull(uri, tmp_path / "cache", settings=Settings(), chunk_size=CHUNK)
    dest = tmp_path / "cache" / src.name
    assert not (dest / "rank0.safetensors").exists() and not (dest / MANIFEST_NAME).exists()
    assert not list(dest.glob("rank0.safetensors.part*"))


def test_local_directories_are_verified_in_place(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    src = llama_artifact[1]
    assert pull(str(src), tmp_path / "cache") == src
    assert not (tmp_path / "cache").exists()  # nothing copied
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = bytearray((bad / "rank0.safetensors").read_bytes())
    data[-1] ^= 0x01
    (bad / "rank0.safetensors").write_bytes(bytes(data))
    with pytest.raises(PullError, match="sha256 mismatch"):
        pull(str(bad), tmp_path / "cache")
