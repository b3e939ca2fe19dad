"""Paths that would escape their directory or prefix are refused with a clear error: `..` and
absolute names in a sharded index, symlinks out of a source directory, S3 keys and artifact ids."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from devtools.builders.synthetic import Dims, write_checkpoint
from services.convert.errors import ConversionError
from services.convert.library import ConversionRequest, convert, open_and_detect
from services.settings import ServiceSettings as Settings
from services.storage import open_store
from services.storage.errors import StorageError
from services.storage.keys import check_artifact_id, check_name, join_prefix
from services.storage.local import LocalSource, LocalStore
from services.storage.s3 import S3Store, parse_s3_url

SMALL = Dims(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=64)
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("paths") / "sharded", "dense", dims=SMALL, sharded=True)


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _point_index(ckpt: Path, target: str) -> str:
    index = json.loads((ckpt / INDEX).read_text())
    tensor = next(iter(index["weight_map"]))
    index["weight_map"][tensor] = target
    (ckpt / INDEX).write_text(json.dumps(index))
    return tensor


def _assert_store_empty(out: Path) -> None:
    if out.exists():
        store = LocalStore(out)
        assert store.list_ids() == [] and store.staging_entries() == []


@pytest.mark.parametrize("target", ["../outside/model.safetensors", "/etc/passwd", "a/../../b.safetensors"])
def test_index_pointing_outside_is_refused(sharded: Path, tmp_path: Path, target: str) -> None:
    src = _copy(sharded, tmp_path / "src")
    tensor = _point_index(src, target)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        convert(ConversionRequest(str(src), ["cpu"], out=str(out)))
    msg = str(info.value)
    assert INDEX in msg and repr(target) in msg and tensor in msg and "outside the checkpoint" in msg
    _assert_store_empty(out)


def test_index_with_non_string_file_is_refused(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path / "src")
    index = json.loads((src / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = 7
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"weight_map\['model.norm.weight'\] must be a file name"):
        open_and_detect(str(src))


@pytest.mark.parametrize("name", ["tokenizer.json", "model-00001-of-00002.safetensors", "config.json"])
def test_symlink_out_of_the_source_is_refused(sharded: Path, tmp_path: Path, name: str) -> None:
    src = _copy(sharded, tmp_path / "src")
    outside = tmp_path / "secret"
    outside.write_bytes((src / name).read_bytes() if (src / name).exists() else b'{"secret": 1}')
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(outside)
    out = tmp_path / "out"
    with pytest.raises(StorageError) as info:
        convert(ConversionRequest(str(src), ["cpu"], out=str(out)))
    msg = str(info.value)
    assert name in msg and "outside the checkpoint directory" in msg and "copy the file" in msg
    _assert_store_empty(out)


def test_tokenizer_symlink_to_etc_passwd_is_refused(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path / "src")
    (src / "tokenizer.json").symlink_to("/etc/passwd")
    with pytest.raises(StorageError, match=r"tokenizer\.json resolves to /etc/passwd, outside"):
        open_and_detect(str(src))
    with pytest.raises(StorageError, match="outside the checkpoint directory"):
        LocalSource(src).read_range("tokenizer.json", 0, 10)


def test_symlink_loop_is_refused(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path / "src")
    os.symlink("loop_b", src / "loop_a")
    os.symlink("loop_a", src / "loop_b")
    with pytest.raises(StorageError, match="loop_a"):
        LocalSource(src).local_path("loop_a")


def test_symlinks_inside_the_source_and_hf_cache_layout_are_accepted(sharded: Path, tmp_path: Path) -> None:
    """The hub cache stores snapshots/<rev>/<file> as symlinks to ../../blobs/<sha>: allowed."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(sharded.iterdir()):
        blob = blobs / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    (snap / "generation_config.json").unlink()
    (snap / "generation_config.json").symlink_to("config.json")  # inside the directory itself
    ckpt, fmt = open_and_detect(str(snap))
    assert fmt.name == "dense" and "model.norm.weight" in ckpt.tensors
    assert ckpt.read_one("model.norm.weight").shape == (SMALL.hidden,)


@pytest.mark.parametrize(
    "name", ["../x", "/abs", "a/../../b", "a//b", "./a", "a\\b", "a\0b", "", "a/", "..", "a/./b"]
)
def test_object_names_that_escape_are_refused(name: str) -> None:
    with pytest.raises(StorageError, match="invalid file name"):
        check_name(name)


def test_valid_object_names_join_under_their_prefix() -> None:
    key = join_prefix("artifacts/", "ka-1", check_name("rank0.safetensors"))
    assert key == "artifacts/ka-1/rank0.safetensors"
    assert check_name("sub/dir/file..txt") == "sub/dir/file..txt"


@pytest.mark.parametrize(
    "aid", ["../x", "..", "a/b", "/abs", "", ".hidden", "ka-..-x", "a\0", "x" * 129, "a b", "-a"]
)
def test_artifact_ids_that_escape_are_refused(aid: str, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="invalid artifact id"):
        check_artifact_id(aid)
    store = LocalStore(tmp_path / "store")
    for op in (store.begin, store.read_manifest, store.delete, store.exists):
        with pytest.raises(StorageError, match="invalid artifact id"):
            op(aid)
    assert list((tmp_path / "store").iterdir()) == []


@pytest.mark.parametrize("url", ["s3://b/../x", "s3://b/a/../../x", "s3://b/a//b", "s3:///x", "s3://b/a/./b"])
def test_s3_urls_that_escape_are_refused(url: str) -> None:
    with pytest.raises(StorageError):
        parse_s3_url(url)


def test_s3_keys_and_ids_stay_under_their_prefix(s3_bucket: str, sharded: Path) -> None:
    settings = Settings()
    store = open_store(f"s3://{s3_bucket}/artifacts", settings)
    assert isinstance(store, S3Store)
    for aid in ("../checkpoints", "a/b", ".."):
        with pytest.raises(StorageError, match="invalid artifact id"):
            store.begin(aid)
        with pytest.raises(StorageError, match="invalid artifact id"):
            store.read_manifest(aid)
    writer = store.begin("ka-ok")
    for name in ("../../checkpoints/x", "/etc/passwd"):
        with pytest.raises(StorageError, match="invalid file name"):
            writer.put_bytes(name, b"x")
    writer.abort()
    # an index under one prefix naming a shard under a sibling prefix is refused
    client = store.client
    for f in sorted(sharded.iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"checkpoints/tiny/{f.name}", Body=f.read_bytes())
        client.put_object(Bucket=s3_bucket, Key=f"checkpoints/other/{f.name}", Body=f.read_bytes())
    index = json.loads((sharded / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../other/model-00001-of-00002.safetensors"
    client.put_object(Bucket=s3_bucket, Key=f"checkpoints/tiny/{INDEX}", Body=json.dumps(index).encode())
    with pytest.raises(ConversionError, match="outside the checkpoint directory"):
        open_and_detect(f"s3://{s3_bucket}/checkpoints/tiny", settings)
    assert store.list_ids() == [] and store.staging_keys() == []
