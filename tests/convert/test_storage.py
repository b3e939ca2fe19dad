"""Artifact stores and sources: local directory and S3 (moto's server on loopback, real boto3)."""

from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path

import pytest

from services.settings import ServiceSettings as Settings
from services.storage import ArtifactExistsError, NotFoundError, StorageError, open_source, open_store
from services.storage.keys import check_artifact_id, check_name
from services.storage.local import LocalStore
from services.storage.s3 import S3Store


@pytest.mark.parametrize("bad", ["..", "../x", "a/b", "", "a\0b", "/abs", ".hidden", "a..b"])
def test_artifact_ids_cannot_escape(bad: str) -> None:
    with pytest.raises(StorageError):
        check_artifact_id(bad)


@pytest.mark.parametrize("bad", ["../x", "a/../b", "/etc/passwd", "a\0b", "", "a//b", "a\\b", "./a"])
def test_names_cannot_escape(bad: str) -> None:
    with pytest.raises(StorageError):
        check_name(bad)


def test_good_names_pass() -> None:
    assert check_artifact_id("ka-0123abc") == "ka-0123abc"
    assert check_name("tokenizer/vocab.json") == "tokenizer/vocab.json"


def test_local_store_commit_is_atomic_and_exclusive(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    w = store.begin("ka-1")
    src = tmp_path / "blob"
    src.write_bytes(b"x" * 1000)
    size, digest = w.put_file("rank0.safetensors", src)
    assert (size, digest) == (1000, hashlib.sha256(b"x" * 1000).hexdigest())
    w.put_bytes("config.json", b"{}")
    assert not store.exists("ka-1") and store.list_ids() == []
    w.commit(b'{"m": 1}')
    assert store.exists("ka-1") and store.list_ids() == ["ka-1"]
    assert store.read_manifest("ka-1") == b'{"m": 1}'
    assert store.staging_entries() == []
    assert set(store.presigned_urls("ka-1")) == {"rank0.safetensors", "config.json", "manifest.json"}

    second = store.begin("ka-1")
    second.put_bytes("config.json", b"other")
    with pytest.raises(ArtifactExistsError):
        second.commit(b'{"m": 2}')
    assert store.read_manifest("ka-1") == b'{"m": 1}'
    assert store.staging_entries() == []

    aborted = store.begin("ka-2")
    aborted.put_bytes("config.json", b"{}")
    aborted.abort()
    assert not store.exists("ka-2") and store.staging_entries() == []

    store.delete("ka-1")
    assert store.list_ids() == []
    with pytest.raises(NotFoundError):
        store.read_manifest("ka-1")


def test_local_source_reads_ranges(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(bytes(range(100)))
    src = open_source(str(tmp_path))
    assert src.list() == ["a.bin"]
    assert src.read_range("a.bin", 10, 20) == bytes(range(10, 20))
    assert src.sha256("a.bin") == hashlib.sha256(bytes(range(100))).hexdigest()
    with pytest.raises(StorageError):
        src.read_range("../a.bin", 0, 1)


def _settings(**kw: object) -> Settings:
    return Settings(**kw)  # KILN_S3_* come from the s3_bucket fixture's environment


def test_s3_store_multipart_commit_presign_and_cleanup(s3_bucket: str, tmp_path: Path) -> None:
    settings = _settings(s3_multipart_chunk_mb=5)
    store = open_store(f"s3://{s3_bucket}/artifacts", settings)
    assert isinstance(store, S3Store)
    blob = tmp_path / "rank0.safetensors"
    data = bytes(range(256)) * (11 * 4096 + 7)  # ≈ 11.5 MB: three multipart parts
    blob.write_bytes(data)
    w = store.begin("ka-s3")
    assert w.put_file("rank0.safetensors", blob) == (len(data), hashlib.sha256(data).hexdigest())
    w.put_bytes("config.json", b"{}")
    assert not store.exists("ka-s3")
    assert store.staging_keys()  # staged, invisible
    w.commit(b'{"files": [{"name": "rank0.safetensors"}, {"name": "config.json"}]}')
    assert store.exists("ka-s3") and store.list_ids() == ["ka-s3"]
    assert store.staging_keys() == []
    urls = store.presigned_urls("ka-s3")
    assert set(urls) == {"manifest.json", "rank0.safetensors", "config.json"}
    with urllib.request.urlopen(urls["rank0.safetensors"], timeout=30) as resp:
        assert hashlib.sha256(resp.read()).hexdigest() == hashlib.sha256(data).hexdigest()

    loser = store.begin("ka-s3")
    loser.put_bytes("config.json", b"loser")
    with pytest.raises(ArtifactExistsError):
        loser.commit(b"{}")
    assert store.read_manifest("ka-s3").startswith(b'{"files"')
    assert store.staging_keys() == []

    aborted = store.begin("ka-gone")
    aborted.put_bytes("config.json", b"{}")
    aborted.abort()
    assert store.staging_keys() == [] and not store.exists("ka-gone")

    store.delete("ka-s3")
    assert store.list_ids() == []


def test_s3_source_streams_ranges(s3_bucket: str) -> None:
    settings = _settings()
    store = open_store(f"s3://{s3_bucket}/x", settings)
    assert isinstance(store, S3Store)
    store.client.put_object(Bucket=s3_bucket, Key="ckpt/model.bin", Body=bytes(range(200)))
    src = open_source(f"s3://{s3_bucket}/ckpt", settings)
    assert src.list() == ["model.bin"] and src.size("model.bin") == 200
    assert src.read_range("model.bin", 50, 60) == bytes(range(50, 60))
    assert src.sha256("model.bin") == hashlib.sha256(bytes(range(200))).hexdigest()
    with pytest.raises(NotFoundError):
        open_source(f"s3://{s3_bucket}/nothing-here", settings).list()


def test_discard_staged_removes_a_dead_writers_files(tmp_path: Path, s3_bucket: str) -> None:
    local = LocalStore(tmp_path / "store")
    s3 = open_store(f"s3://{s3_bucket}/a", _settings())
    assert isinstance(s3, S3Store)
    for store in (local, s3):
        dead = store.begin("ka-dead")  # a writer whose process was killed: never commits nor aborts
        dead.put_bytes("rank0.safetensors", b"partial")
        other = store.begin("ka-other")
        other.put_bytes("config.json", b"{}")
        assert store.discard_staged("ka-dead") == 1
        assert not store.exists("ka-dead")
        other.abort()
    assert local.staging_entries() == [] and s3.staging_keys() == []
