"""Bounded memory: a ≥ 2 GB bf16 checkpoint converts in a subprocess whose peak RSS stays below the
checkpoint's size (tensors stream layer by layer from memory-mapped files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIG_CHECKPOINT = REPO / ".cache" / "kiln-test" / "synthetic-2g"
BIG_BYTES = 2_100_000_000

CHILD = """
import json, resource, sys
from services.convert.library import ConversionRequest, convert
(r,) = convert(ConversionRequest(sys.argv[1], [sys.argv[2]], method=sys.argv[3], out=sys.argv[4]))
print(json.dumps({"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "ok": r.manifest.verification.ok, "layers": len(r.manifest.layers)}))
"""


def ensure_big_checkpoint(path: Path = BIG_CHECKPOINT) -> Path:
    """The synthetic ≥ 2 GB bf16 Llama (written once, cached under .cache/kiln-test)."""
    if not (path / "config.json").exists():
        from tests.helpers.synthetic import dims_for_bytes, write_dense_checkpoint

        tmp = path.with_name(path.name + ".partial")
        write_dense_checkpoint(tmp, dims_for_bytes(BIG_BYTES))
        tmp.rename(path)
    return path


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def run_child(src: Path, target: str, method: str, out: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), target, method, str(out)],
        capture_output=True, text=True, env=env, check=False, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_stays_below_checkpoint_size(tmp_path: Path) -> None:
    src = ensure_big_checkpoint()
    size = checkpoint_bytes(src)
    assert size >= 2_000_000_000
    result = run_child(src, "sm80", "auto", tmp_path / "out")
    assert result["ok"] is True
    assert int(result["maxrss_bytes"]) < size, f"peak RSS {result['maxrss_bytes']} >= checkpoint {size}"
