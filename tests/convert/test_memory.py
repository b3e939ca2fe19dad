"""Bounded memory: a ≥ 2 GB bf16 checkpoint converts in a subprocess whose peak RSS stays below the
checkpoint's size (tensors stream layer by layer), and a ≥ 2 GB mixture-of-experts one below half
its size (experts are read, prepared and written one at a time)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIG_CHECKPOINT = REPO / ".cache" / "kiln-test" / "synthetic-2g"
BIG_MOE_CHECKPOINT = REPO / ".cache" / "kiln-test" / "synthetic-moe-2g"
BIG_BYTES = 2_100_000_000
MOE_PEAK_RSS_FRACTION = 0.5  # of the source checkpoint's size

CHILD = """
import json, sys
from devtools.process_memory import peak_rss_bytes
from services.convert.library import ConversionRequest, convert
(r,) = convert(ConversionRequest(sys.argv[1], [sys.argv[2]], method=sys.argv[3], out=sys.argv[4]))
print(json.dumps({"maxrss_bytes": peak_rss_bytes(),
                  "ok": r.manifest.verification.ok, "layers": len(r.manifest.layers),
                  "expert_groups": len(r.manifest.expert_groups)}))
"""


def ensure_big_checkpoint(path: Path = BIG_CHECKPOINT, **moe: object) -> Path:
    """The synthetic ≥ 2 GB bf16 Llama, or with `moe` a mixture-of-experts model (written once,
    cached under .cache/kiln-test)."""
    if not (path / "config.json").exists():
        from devtools.builders.synthetic import dims_for_bytes, write_large_checkpoint

        tmp = path.with_name(path.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        write_large_checkpoint(tmp, dims_for_bytes(BIG_BYTES, **moe))
        tmp.rename(path)
    return path


def ensure_big_moe_checkpoint() -> Path:
    """Qwen3-MoE, hidden 2048, 32 experts of I=768 top-4 in every layer (Marlin-compatible)."""
    return ensure_big_checkpoint(
        BIG_MOE_CHECKPOINT, architecture="Qwen3MoeForCausalLM", num_experts=32, top_k=4, moe_intermediate=768
    )


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


@pytest.mark.slow
@pytest.mark.parametrize(("target", "method"), [("sm80", "auto"), ("sm90", "fp8")])
def test_moe_peak_rss_stays_below_half_the_checkpoint(target: str, method: str, tmp_path: Path) -> None:
    """bf16 experts stacked for dense_experts (sm80) and quantized online to FP8 per expert (sm90):
    the case vLLM users report OOMs for at twice the repacked size."""
    src = ensure_big_moe_checkpoint()
    size = checkpoint_bytes(src)
    assert size >= 2_000_000_000
    result = run_child(src, target, method, tmp_path / "out")
    assert result["ok"] is True and int(result["expert_groups"]) > 0  # type: ignore[call-overload]
    peak = int(result["maxrss_bytes"])  # type: ignore[call-overload]
    print(f"\nMoE {target} {method}: peak RSS {peak / 1e9:.2f} GB = {peak / size:.3f} x {size / 1e9:.2f} GB")
    assert peak <= MOE_PEAK_RSS_FRACTION * size, (
        f"peak RSS {peak} > {MOE_PEAK_RSS_FRACTION} x checkpoint {size}"
    )
