"""Conversion throughput (GB/s of source bytes) and peak RSS, against a peer measured in the same run.

Peer: a plain safetensors round trip of the same checkpoint (`load_file` + `save_file`, file by
file) — the least work any converter does that reads and writes every byte. Each run is a fresh
subprocess (peak RSS: its VmHWM, devtools/process_memory.py). Checkpoints: the synthetic ≥ 2 GB
bf16 Llama (written once to .cache/kiln-test/synthetic-2g) and SmolLM2-135M bf16 if present
(--smollm2 DIR or .cache/kiln-test/smollm2-bf16).

    python bench/convert.py [--smollm2 DIR] [--skip-fp8] [--omp-threads N] [--gguf-only | --skip-gguf]
                            [--gguf-repeats 5] [--gguf-big-repeats 1]

GGUF (issue 27: "peak RSS while converting a GGUF ≤ 0.5× the file size plus one layer"): SmolLM2's
Q4_1 file and a synthetic ≈1.1 GB Q4_0 Llama of wide layers (written once, tensor by tensor, to
.cache/kiln-test/synthetic-1g-q4_0.gguf), each converted for cpu in a fresh child. Reported: the
child's RSS right after its imports (the baseline), its peak RSS (VmHWM), the file size, the largest
layer and plain tensor (in the file and as stored), (peak − baseline) / file, and the goal met or not.
The peak varies from run to run (which freed blocks glibc keeps): each file is converted
--gguf-repeats times (the synthetic one --gguf-big-repeats times) and the worst run's figures are
shown, with every run's. RSS after every progress report is saved too.

--omp-threads sets OMP_NUM_THREADS for the conversion children (default: torch's own default). On a
heavily shared 2-core machine, torch's OpenMP teams spend most of their time waiting for a core;
`--omp-threads 1` shows how much.
Results: printed, and saved to bench/results/convert.json (a section not run keeps its saved results).
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


# A GGUF into the cpu kernels: RSS right after imports (the baseline), every progress report's RSS,
# peak RSS (VmHWM) when `convert` returns, then (outside the peak) each layer's and each plain tensor's
# bytes in the file and in the artifact. argv: FILE OUT.
GGUF_CHILD = """
import json, sys, time
from pathlib import Path
from devtools.process_memory import peak_rss_bytes
from kernels.registry import BUILTIN_KERNELS, builtin_kernel
from services.convert.library import ConversionRequest, convert, open_and_detect
for name in BUILTIN_KERNELS:
    builtin_kernel(name)

def status():
    fields = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines() if ":" in ln)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

trace = []
def progress(p):
    trace.append({"stage": p.stage, "message": p.message, **status()})

baseline = status()
t = time.perf_counter()
(r,) = convert(ConversionRequest(sys.argv[1], ["cpu"], out=sys.argv[2]), progress=progress)
seconds = time.perf_counter() - t
peak = peak_rss_bytes()
ckpt, _ = open_and_detect(sys.argv[1])
stored = {}
for f in Path(r.uri.removeprefix("file://")).glob("*.safetensors"):
    with f.open("rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    stored.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if "dtype" in v})
layers = [[name, sum(ckpt.info(s).nbytes for s in e.source_tensors),
           sum(stored.get(f"{name}.{s}", 0) for s in e.tensors)] for name, e in r.manifest.layers.items()]
plain = [[n, ckpt.info(n).nbytes, b] for n, b in stored.items() if n in ckpt.tensors]
print(json.dumps({"seconds": seconds, "baseline": baseline, "peak_rss_bytes": peak, "trace": trace,
                  "ok": r.manifest.verification.ok, "artifact_bytes": sum(f.size for f in r.manifest.files),
                  "kernels": sorted({e.kernel for e in r.manifest.layers.values()}),
                  "layers": layers, "plain": plain}))
"""

# Writes the synthetic GGUF tensor by tensor (devtools/builders/gguf_files.py); argv: PATH.
GGUF_WRITER_CHILD = """
import json, sys, time
from pathlib import Path
from devtools.builders.gguf_files import write_large_llama_gguf
from devtools.process_memory import peak_rss_bytes
base = peak_rss_bytes()
t = time.perf_counter()
write_large_llama_gguf(Path(sys.argv[1]), **json.loads(sys.argv[2]))
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "maxrss_bytes": peak_rss_bytes(), "import_rss_bytes": base}))
"""
# ≈1.10 GB: 5 layers of 390 M Q4_0 weights (the fused gate_up layer: 201 M of them, 113 MB)
BIG_GGUF_DIMS = {"hidden": 6144, "intermediate": 16384, "layers": 5, "heads": 48, "kv_heads": 8}
BIG_GGUF = REPO / ".cache" / "kiln-test" / "synthetic-1g-q4_0.gguf"
GGUF_PEAK_FRACTION = 0.5  # issue 27: peak RSS ≤ 0.5 × the file + one layer

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


def ensure_big_gguf(path: Path = BIG_GGUF) -> tuple[Path, dict]:
    """The synthetic ≥ 1 GB Q4_0 Llama GGUF, written once (in a child, whose peak RSS is the writer's
    own), and what writing it cost."""
    info = path.with_name(path.name + ".writer.json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        print(f"writing {path} (once) ...", flush=True)
        w = _child(GGUF_WRITER_CHILD, str(tmp), json.dumps(BIG_GGUF_DIMS))
        info.write_text(json.dumps({**w, "dims": BIG_GGUF_DIMS}) + "\n")
        tmp.rename(path)
    return path, json.loads(info.read_text()) if info.exists() else {}


def _largest(rows: list[list], default: str) -> dict:
    """The [name, source bytes, stored bytes] row of the most bytes, either way."""
    name, src, st = max(rows, key=lambda r: max(r[1], r[2]), default=[default, 0, 0])
    return {"name": name, "source_bytes": src, "stored_bytes": st}


def gguf_figures(r: dict, size: int) -> dict:
    """The goal's figures from one GGUF child's report (`GGUF_CHILD`)."""
    base, peak = r["baseline"]["VmRSS"], r["peak_rss_bytes"]
    layer, plain = _largest(r["layers"], "-"), _largest(r["plain"], "-")
    one = max(layer["source_bytes"], layer["stored_bytes"], plain["source_bytes"], plain["stored_bytes"])
    allowance = GGUF_PEAK_FRACTION * size + one
    units = [e for e in r["trace"] if e["stage"] == "converting"] or [r["baseline"]]
    at_peak = next((f"{e['stage']}: {e['message']}" for e in r["trace"] if e["VmHWM"] >= peak), None)
    return {
        "seconds": round(r["seconds"], 2),
        "gb_per_s": round(size / r["seconds"] / 1e9, 4),
        "baseline_rss_bytes": base,
        "baseline_hwm_bytes": r["baseline"]["VmHWM"],
        "peak_rss_bytes": peak,
        "peak_minus_baseline_bytes": peak - base,
        "peak_minus_baseline_over_file": round((peak - base) / size, 3),
        "largest_layer": layer,
        "largest_plain_tensor": plain,
        "one_layer_bytes": one,
        "allowance_bytes": int(allowance),
        "met": peak - base <= allowance,
        "rss_after_units_bytes": [units[0]["VmRSS"], units[-1]["VmRSS"]],  # the first unit, the last
        "anon_after_units_bytes": [units[0]["RssAnon"], units[-1]["RssAnon"]],
        "peak_in_step_ending_at": at_peak or "after the last progress report",
        "verified": r["ok"],
        "kernels": r["kernels"],
        "artifact_bytes": r["artifact_bytes"],
        "trace": [[e["stage"], e["message"], e["VmRSS"], e["VmHWM"], e["RssAnon"]] for e in r["trace"]],
    }


def bench_gguf(name: str, path: Path, repeats: int, writer: dict | None = None) -> dict:
    """`name` converted for cpu `repeats` times, each in a fresh child. The peak varies from run to run:
    the figures are the worst run's."""
    size = path.stat().st_size
    figures = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
            figures.append(gguf_figures(_child(GGUF_CHILD, str(path), tmp), size))
    worst = max(figures, key=lambda f: f["peak_minus_baseline_bytes"])
    run = {**worst, "runs_peak_minus_baseline_bytes": [f["peak_minus_baseline_bytes"] for f in figures]}
    return {"checkpoint": name, "path": str(path), "file_bytes": size, "writer": writer, "run": run}


MB = 1e6
GGUF_COLUMNS = ("case", "file MB", "base MB", "peak MB", "peak-base MB", "(peak-base)/file", "layer MB",
                "allowance MB", "goal", "s", "peak-base of the runs MB")  # fmt: skip
GGUF_ROW = "{:<44} {:>8} {:>8} {:>8} {:>12} {:>16} {:>9} {:>12} {:>8} {:>6}  {}"


def _gguf_row(name: str, size: int, f: dict) -> str:
    mbs = (size, f["baseline_rss_bytes"], f["peak_rss_bytes"], f["peak_minus_baseline_bytes"])
    return GGUF_ROW.format(
        name,
        *(f"{b / MB:.1f}" for b in mbs),
        f"{f['peak_minus_baseline_over_file']:.3f}x",
        f"{f['one_layer_bytes'] / MB:.1f}",
        f"{f['allowance_bytes'] / MB:.1f}",
        "met" if f["met"] else "NOT MET",
        f"{f['seconds']:.1f}",
        " ".join(f"{b / MB:.0f}" for b in f["runs_peak_minus_baseline_bytes"]),
    )


def _gguf_details(res: dict) -> None:
    f = res["run"]
    kernels = ", ".join(f["kernels"])
    print(f"\n{res['checkpoint']}: {kernels}, verified={f['verified']}, {f['gb_per_s']:.3f} GB/s")
    for what in ("largest_layer", "largest_plain_tensor"):
        t = f[what]
        print(f"  {what.replace('_', ' ')}: {t['name']}: {t['source_bytes'] / MB:.1f} MB in the file, "
              f"{t['stored_bytes'] / MB:.1f} MB stored")  # fmt: skip
    (first, last), (anon_first, anon_last) = f["rss_after_units_bytes"], f["anon_after_units_bytes"]
    print(f"  RSS after the first unit {first / MB:.0f} MB, after the last {last / MB:.0f} MB "
          f"(anonymous {anon_first / MB:.0f} -> {anon_last / MB:.0f} MB); peak reached in the step "
          f"ending at '{f['peak_in_step_ending_at']}'")  # fmt: skip
    if res["writer"]:
        w = res["writer"]
        imports = (
            f" ({w['import_rss_bytes'] / MB:.0f} MB after its imports)" if "import_rss_bytes" in w else ""
        )
        print(f"  file written once, tensor by tensor: {w['seconds']:.0f} s, "
              f"writer peak RSS {w['maxrss_bytes'] / MB:.0f} MB{imports}")  # fmt: skip


def print_gguf(results: list[dict]) -> None:
    print("\nGGUF -> cpu: peak RSS while converting (a fresh child each; base: its RSS after imports)")
    print("goal (issue 27): peak - base <= 0.5 x file + one layer (the largest layer or plain tensor, in "
          "the file or stored, whichever is more)")  # fmt: skip
    print("every figure is the worst run's (the last column: every run's)")
    print(GGUF_ROW.format(*GGUF_COLUMNS))
    for res in results:
        print(_gguf_row(res["checkpoint"], res["file_bytes"], res["run"]))
    for res in results:
        _gguf_details(res)


def run_gguf(repeats: int, big_repeats: int) -> list[dict]:
    from devtools.builders import smollm2

    results = [bench_gguf("smollm2-135m-q4_1.gguf", smollm2.gguf_file(), repeats)]
    big, writer = ensure_big_gguf()
    results.append(bench_gguf("synthetic-llama-1.1gb-q4_0.gguf", big, big_repeats, writer))
    print_gguf(results)
    return results


def run_safetensors(args: argparse.Namespace) -> list[dict]:
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
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2 bf16 checkpoint directory")
    ap.add_argument("--skip-fp8", action="store_true", help="skip the (slower) online-FP8 runs")
    ap.add_argument("--omp-threads", type=int, default=None, help="OMP_NUM_THREADS for the children")
    ap.add_argument("--gguf-repeats", type=int, default=5, help="conversions of SmolLM2's GGUF, each way")
    ap.add_argument("--gguf-big-repeats", type=int, default=1, help="conversions of the synthetic GGUF")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--gguf-only", action="store_true", help="only the GGUF cases")
    only.add_argument("--skip-gguf", action="store_true", help="only the safetensors cases")
    args = ap.parse_args()
    if args.omp_threads:
        OMP_THREADS["OMP_NUM_THREADS"] = str(args.omp_threads)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "omp_threads": args.omp_threads, "load_avg": os.getloadavg()}  # fmt: skip
    out = REPO / "bench" / "results" / "convert.json"
    saved = json.loads(out.read_text()) if out.exists() else {}  # a section not run this time is kept
    if not args.gguf_only:
        saved.update(meta=meta, results=run_safetensors(args))
    if not args.skip_gguf:
        gguf = run_gguf(args.gguf_repeats, args.gguf_big_repeats)
        saved.update(gguf_meta={**meta, "load_avg_after": os.getloadavg()}, gguf=gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
