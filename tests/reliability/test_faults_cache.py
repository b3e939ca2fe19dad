"""An I/O error while pulling (the cache's filesystem fills up mid-pull) leaves the cache as it was:
the artifact pulled before is untouched, nothing of the failed pull stays, and the error names the
cache directory and what to do. The full filesystem is a small tmpfs (needs root to mount)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import write_artifact
from runtime.artifact.pull import PullError, pull
from runtime.loader import load_model
from runtime.settings import RuntimeSettings as Settings
from tests.fixtures.s3 import upload_artifact

TMPFS_SIZE = "8m"
HEADROOM_BYTES = 256 << 10  # free space left for the second pull: far less than it needs
CHUNK = 64 << 10


def _mount(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "cache-fs"
    mnt.mkdir()
    r = _mount(["-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt)])
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the disk-full fault needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def test_disk_full_mid_pull_leaves_the_cache_as_it_was(
    small_fs: Path,
    tmp_path: Path,
    s3_server: str,
    s3_bucket: str,
    llama_artifact: tuple[PreTrainedModel, Path],
) -> None:
    model, first_src = llama_artifact
    second_src = write_artifact(model, tmp_path / "second", tp=2)
    assert second_src.name != first_src.name
    first = pull(
        upload_artifact(s3_server, s3_bucket, first_src), small_fs, settings=Settings(), chunk_size=CHUNK
    )
    second_uri = upload_artifact(s3_server, s3_bucket, second_src)

    st = os.statvfs(small_fs)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    r = _mount(["-o", f"remount,size={used + HEADROOM_BYTES}", str(small_fs)])
    assert r.returncode == 0, r.stderr
    before = _snapshot(small_fs)

    expected = r"cannot write into the cache at .*No space left.*KILN_CACHE_DIR"
    with pytest.raises(PullError, match=expected) as e:
        pull(second_uri, small_fs, settings=Settings(), chunk_size=CHUNK)
    assert str(small_fs / second_src.name) in str(e.value)
    assert _snapshot(small_fs) == before  # nothing added, nothing removed, nothing changed
    load_model(first)  # the artifact pulled before still loads (its files verified)

    # With space again, the same pull succeeds from scratch.
    assert _mount(["-o", f"remount,size={TMPFS_SIZE}", str(small_fs)]).returncode == 0
    second = pull(second_uri, small_fs, rank=0, settings=Settings(), chunk_size=CHUNK)
    assert (second / "rank0.safetensors").read_bytes() == (second_src / "rank0.safetensors").read_bytes()
