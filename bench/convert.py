"""Conversion throughput (GB/s of source bytes) and peak RSS, against a peer measured in the same run.

Peer: a plain safetensors round trip of the same checkpoint (`load_file` + `save_file`, file by
file) — the least work any converter does that reads and writes every byte. Each run is a fresh
subprocess (peak RSS: its VmHWM, devtools/process_memory.py). Checkpoints: the synthetic ≥ 2 GB
bf16 Llama (written once to .cache/kiln-test/synthetic-2g) and SmolLM2-135M bf16 if present
(--smollm2 DIR or .cache/kiln-test/smollm2-bf16).

    python bench/convert.py [--smollm2 DIR] [--skip-fp8] [--omp-threads N]

--omp-threads sets OMP_NUM_THREADS for the conversion children (default: torch's own default). On a
heavily shared 2-core machine, torch's OpenMP teams spend most of their time waiting for a core;
`--omp-threads 1` shows how much.
Results: printed, and saved to bench/results/convert.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONVERT_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from devtools.process_memory import peak_rss_bytes
from kernels.registry import BUILTIN_KERNELS, builtin_kernel
from services.convert.library import ConversionRequest, convert
for name in BUILTIN_KERNELS:
    builtin_kernel(name)  # import cost (torch, triton) is reported apart from the conversion
t = time.perf_counter()
imports = t - t0
(r,) = convert(ConversionRequest(sys.argv[1], [sys.argv[2]], method=sys.argv[3], out=sys.argv[4]))
rss = peak_rss_bytes()
print(json.dumps({"seconds": time.perf_counter() - t, "import_seconds": imports, "maxrss_bytes": rss,
                  "ok": r.manifest.verification.ok,
                  "artifact_bytes": sum(f.size for f in r.manifest.files),
                  "kernels": sorted({e.kernel for e in r.manifest.layers.values()})}))
"""

PEER_CHILD = """
import json, sys, time
from pathlib import Path
from safetensors.torch import load_file, save_file
from devtools.process_memory import peak_rss_bytes
t = time.perf_counter()
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    save_file(load_file(str(f)), str(Path(sys.argv[2]) / f.name))
print(json.dumps({"seconds": time.perf_counter() - t, "maxrss_bytes": peak_rss_bytes()}))
"""


OMP_THREADS: dict[str, str] = {}  # set from --omp-threads


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", **OMP_THREADS}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def source_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def bench_checkpoint(name: str, path: Path, cases: list[tuple[str, str]]) -> dict:
    size = source_bytes(path)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        peer = _child(PEER_CHILD, str(path), tmp)
    peer_gbs = size / peer["seconds"] / 1e9
    print(f"\n{name}: {size / 1e9:.2f} GB  peer (safetensors load+save): {peer_gbs:.3f} GB/s, "
          f"peak RSS {peer['maxrss_bytes'] / 1e9:.2f} GB")  # fmt: skip
    runs = []
    for target, method in cases:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
            r = _child(CONVERT_CHILD, str(path), target, method, tmp)
        gbs = size / r["seconds"] / 1e9
        row = {
            "target": target, "method": method, "seconds": round(r["seconds"], 2), "gb_per_s": round(gbs, 4),
            "import_seconds": round(r["import_seconds"], 2),
            "vs_peer_throughput": round(gbs / peer_gbs, 3), "peak_rss_bytes": r["maxrss_bytes"],
            "peak_rss_over_source": round(r["maxrss_bytes"] / size, 3),
            "vs_peer_rss": round(r["maxrss_bytes"] / peer["maxrss_bytes"], 3), "verified": r["ok"],
            "artifact_bytes": r["artifact_bytes"], "kernels": r["kernels"],
        }  # fmt: skip
        runs.append(row)
        rss_gb = r["maxrss_bytes"] / 1e9
        print(f"  kiln convert --target {target} --method {method}: {gbs:.3f} GB/s "
              f"({row['vs_peer_throughput']}x peer), peak RSS {rss_gb:.2f} GB = "
              f"{row['peak_rss_over_source']}x source ({row['vs_peer_rss']}x peer), "
              f"verified={r['ok']}")  # fmt: skip
    return {
        "checkpoint": name, "path": str(path), "source_bytes": size,
        "peer": {"what": "safetensors load_file+save_file", "seconds": round(peer["seconds"], 2),
                 "gb_per_s": round(peer_gbs, 4), "peak_rss_bytes": peer["maxrss_bytes"]},
        "runs": runs,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2 bf16 checkpoint directory")
    ap.add_argument("--skip-fp8", action="store_true", help="skip the (slower) online-FP8 runs")
    ap.add_argument("--omp-threads", type=int, default=None, help="OMP_NUM_THREADS for the children")
    args = ap.parse_args()
    if args.omp_threads:
        OMP_THREADS["OMP_NUM_THREADS"] = str(args.omp_threads)
    from tests.convert.test_memory import ensure_big_checkpoint

    results = []
    fp8 = [] if args.skip_fp8 else [("cpu", "fp8")]
    cache = REPO / ".cache" / "kiln-test"
    found = [cache / "smollm2-bf16", *sorted(cache.glob("smollm2*bf16*"))]
    smol = args.smollm2 or next((p for p in found if (p / "config.json").exists()), cache / "smollm2-bf16")
    args.smollm2 = smol
    if (args.smollm2 / "config.json").exists():
        results.append(
            bench_checkpoint("smollm2-135m-bf16", args.smollm2, [("cpu", "auto"), ("sm80", "auto"), *fp8])
        )
    else:
        print(f"SmolLM2 bf16 checkpoint not found at {args.smollm2}: skipped (pass --smollm2 DIR)")
    big = ensure_big_checkpoint()
    results.append(bench_checkpoint("synthetic-llama-2.2gb-bf16", big, [("sm80", "auto"), *fp8]))
    out = REPO / "bench" / "results" / "convert.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "omp_threads": args.omp_threads, "load_avg": os.getloadavg()}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
