"""vLLM loading a GPTQ checkpoint as published vs the Kiln artifact of it, through Kiln's plugin.

For each model and vLLM compilation mode, in one run on this machine, a fresh vLLM OpenAI server
(`python -m vllm.entrypoints.openai.api_server`, vLLM's CPU build from its own venv) is started on

    (a) the compressed-tensors GPTQ W4A16 checkpoint: vLLM reads it and processes it at load
        (its CPU W4A16 kernel repacks every layer);
    (b) the Kiln cpu artifact converted from (a), `--load-format kiln`: bound as views of the mapping.

Measured per start: process start -> /health ready; the model runner's `load_model` (weights read
plus processing, or binding) and the worker's RSS around it, from a probe on the PYTHONPATH of the
vLLM processes (bench/vllm_probe/sitecustomize.py: timing only, vLLM unchanged); peak RSS (VmHWM)
of every vLLM process at ready; for SmolLM2, decode tok/s of one 128-token greedy request (batch 1).
Ratios (a)/(b): load speed-up (goal ≥ 5×) and peak RSS (goal: (b) no higher).

Models: SmolLM2-135M-Instruct GPTQ g64 (llm-compressor, .cache/kiln-test) and a synthetic
Llama-shaped 4096-wide GPTQ g128 checkpoint of ≥ 1 GB (written once to .cache/kiln-test, served
with --skip-tokenizer-init) and the tiny Qwen3-MoE GPTQ g128 checkpoint of the MoE tests (experts
bound as Kiln's stacked expert groups). A start that fails is recorded with its error, not fatal.

    .venv/bin/python bench/vllm_load.py [--vllm-python .venv-vllm/bin/python] [--modes eager,compiled]
                                        [--big-gb 1.0] [--skip-big] [--skip-smollm2] [--skip-moe]
                                        [--target cpu|auto|smXX]

Saves bench/results/vllm_load.json.
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "vllm_load.json"
from bench.served import free_port, vllm_api_command, vllm_env, wait_healthy  # noqa: E402  (after the path set-up)
from tests.vllm_plugin.vllm_host import stop  # noqa: E402

PROBE_DIR = REPO / "bench" / "vllm_probe"
DECODE_TOKENS = 128


def big_checkpoint(target_gb: float) -> Path:
    """A Llama-7B-shaped (4096 wide) compressed-tensors GPTQ g128 checkpoint of ≥ target_gb on disk."""
    from devtools.builders.smollm2 import cache_root, is_complete
    from devtools.builders.synthetic import TINY, write_large_checkpoint

    per_layer = (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 11008) // 2  # int4 bytes
    fixed = 2 * 32000 * 4096 * 2  # bf16 embeddings and lm_head
    layers = max(1, -(-(int(target_gb * 1e9) - fixed) // per_layer))
    dims = replace(
        TINY, hidden=4096, intermediate=11008, heads=32, kv_heads=8, head_dim=128, vocab=32000, layers=layers
    )
    path = cache_root() / f"synthetic-llama4096-gptq-g128-l{layers}-v1"
    if not is_complete(path):
        print(f"writing {path.name} ({layers} layers)...", flush=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
        write_large_checkpoint(tmp, dims, fmt="ct-pack", group_size=128)
        (tmp / ".kiln-complete").write_text("")
        os.replace(tmp, path)
    return path


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in descendants(k)]


def status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def start(
    vllm_python: Path, model: Path, mode: str, *, kiln: bool, tokenizer: bool, probe: Path, gpu: bool
) -> Any:
    port = free_port()
    cmd = vllm_api_command(vllm_python, model, port, mode, max_num_seqs=8)
    if kiln:
        cmd += ["--load-format", "kiln"]
    if not tokenizer:
        cmd.append("--skip-tokenizer-init")
    if gpu:
        cmd += ["--gpu-memory-utilization", "0.5"]
    env = vllm_env(gpu)
    env.update(
        KILN_BENCH_PROBE=str(probe),
        PYTHONPATH=os.pathsep.join([str(PROBE_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    log = probe.with_suffix(".log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


PROMPT_TEXT = "Write a story about a lighthouse keeper."
PROMPT_IDS = [1, 450, 3303, 338, 263, 1243, 310, 278, 11822, 29889]  # tokenizer-less models


def decode(base: str, tokenizer: bool) -> tuple[float, list[int]]:
    """Batch-1 greedy decode of DECODE_TOKENS tokens: tokens/s and the generated token ids."""
    body = {
        "model": "m",
        "prompt": PROMPT_TEXT if tokenizer else PROMPT_IDS,
        "max_tokens": DECODE_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 8}, timeout=300)  # warm-up
    t = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    seconds = time.perf_counter() - t
    choice = r.json()["choices"][0]
    return r.json()["usage"]["completion_tokens"] / seconds, list(choice.get("token_ids") or [])


def one_start(
    vllm_python: Path, model: Path, mode: str, *, kiln: bool, tokenizer: bool, work: Path, gpu: bool
) -> dict:
    probe = work / f"{model.name}-{mode}-{'kiln' if kiln else 'ckpt'}.jsonl"
    t0 = time.perf_counter()
    proc, base = start(vllm_python, model, mode, kiln=kiln, tokenizer=tokenizer, probe=probe, gpu=gpu)
    try:
        ready = wait_healthy(proc, base, probe.with_suffix(".log"), time.perf_counter())
        pids = [proc.pid, *descendants(proc.pid)]
        hwm = {pid: status_kb(pid, "VmHWM") for pid in pids}
        loads = [json.loads(line) for line in probe.read_text().splitlines()]
        tok_s, token_ids = decode(base, tokenizer)
    finally:
        stop(proc, timeout_s=60)
    (load,) = loads
    return {
        "ready_seconds": ready,
        "wall_seconds": time.perf_counter() - t0,
        "load_seconds": load["load_seconds"],
        "load_rss_delta_mb": (load["rss_after_kb"] - load["rss_before_kb"]) / 1024,
        "worker_hwm_after_load_mb": load["hwm_after_kb"] / 1024,
        "worker_hwm_at_ready_mb": hwm.get(load["pid"], 0) / 1024,
        "all_processes_hwm_at_ready_mb": sum(hwm.values()) / 1024,
        "decode_tok_s": tok_s,
        "greedy_token_ids": token_ids,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--big-gb", type=float, default=1.0)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true", help="only the synthetic checkpoint")
    ap.add_argument("--skip-moe", action="store_true", help="without the tiny Qwen3-MoE GPTQ checkpoint")
    ap.add_argument(
        "--target", default="cpu", help="cpu, or a GPU target (sm80, sm90, ...; 'auto': this GPU)"
    )
    args = ap.parse_args()
    if not args.vllm_python.exists():
        sys.exit(f"{args.vllm_python} not found: make vllm-venv")
    from devtools.builders.smollm2 import CheckpointUnavailable, build_artifact, build_gptq

    target = args.target
    if target == "auto":
        import torch

        target = "sm{}{}".format(*torch.cuda.get_device_capability())
    gpu = target != "cpu"
    models: list[tuple[str, Path, bool]] = []
    try:
        if not args.skip_smollm2:
            models.append(("smollm2-135m-gptq-g64", build_gptq(), True))
    except CheckpointUnavailable as e:
        print(f"SmolLM2 skipped: {e}")
    if not args.skip_big:
        models.append((f"llama4096-gptq-g128-{args.big_gb:g}gb", big_checkpoint(args.big_gb), False))
    if not args.skip_moe:
        from devtools.builders.moe import build_quantized

        models.append(("qwen3-moe-tiny-gptq-g128", build_quantized("qwen3-moe-marlin", "gptq-w4a16"), True))
    work = Path(tempfile.mkdtemp(prefix="kiln-vllm-load-"))
    results: dict[str, Any] = {
        "target": target,
        "machine": platform.processor() or platform.machine(),
        "cpu_flags": sorted(
            f
            for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
            if f in Path("/proc/cpuinfo").read_text()
        ),
        "models": {},
    }
    for name, checkpoint, tokenizer in models:
        t = time.perf_counter()
        artifact = build_artifact(checkpoint, target)
        entry: dict[str, Any] = {
            "checkpoint_gb": disk_bytes(checkpoint) / 1e9,
            "artifact_gb": disk_bytes(artifact) / 1e9,
            "convert_seconds_if_not_cached": time.perf_counter() - t,
        }
        for mode in args.modes.split(","):
            row = {}
            for kiln, label in ((False, "checkpoint"), (True, "kiln")):
                print(f"{name} {mode} {label}...", flush=True)
                model = artifact if kiln else checkpoint
                try:
                    row[label] = one_start(
                        args.vllm_python, model, mode, kiln=kiln, tokenizer=tokenizer, work=work, gpu=gpu
                    )
                except RuntimeError as e:  # e.g. vLLM refusing the original checkpoint: recorded, not fatal
                    row[label] = {"error": str(e)[-1500:]}
                    print(f"  failed: {str(e)[-300:]}")
            entry[mode] = row
            a, b = row["checkpoint"], row["kiln"]
            if "error" in a or "error" in b:
                continue
            row["ratios"] = {
                "load_speedup": a["load_seconds"] / b["load_seconds"],
                "ready_speedup": a["ready_seconds"] / b["ready_seconds"],
                "worker_peak_rss_kiln_over_checkpoint": b["worker_hwm_at_ready_mb"]
                / a["worker_hwm_at_ready_mb"],
                "load_rss_delta_kiln_over_checkpoint": b["load_rss_delta_mb"]
                / max(a["load_rss_delta_mb"], 1e-9),
            }
            row["ratios"]["decode_kiln_over_checkpoint"] = b["decode_tok_s"] / a["decode_tok_s"]
            same = 0
            for x, y in zip(a["greedy_token_ids"], b["greedy_token_ids"], strict=False):
                if x != y:
                    break
                same += 1
            row["greedy_tokens_identical_prefix"] = same
        results["models"][name] = entry
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    print(
        f"\nvLLM load, target {results['target']}, {results['machine']} ({', '.join(results['cpu_flags'])})"
    )
    head = (
        "model / mode / source          ready s   load s  load ΔRSS MB  worker peak MB  all procs MB  tok/s"
    )
    print(head)
    for name, entry in results["models"].items():
        for mode, row in entry.items():
            if not isinstance(row, dict) or "kiln" not in row:
                continue
            for label in ("checkpoint", "kiln"):
                r = row[label]
                if "error" in r:
                    print(f"{name[:18]:18s} {mode:8s} {label:10s} failed: {r['error'][-200:]!r}")
                    continue
                tok = f"{r['decode_tok_s']:.1f}"
                print(
                    f"{name[:18]:18s} {mode:8s} {label:10s} "
                    f"{r['ready_seconds']:7.1f} {r['load_seconds']:8.2f} "
                    f"{r['load_rss_delta_mb']:12.0f} {r['worker_hwm_at_ready_mb']:15.0f} "
                    f"{r['all_processes_hwm_at_ready_mb']:12.0f}  {tok}"
                )
            if "ratios" not in row:
                continue
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items())
            same = row["greedy_tokens_identical_prefix"]
            print(f"    ratios: {ratios}; greedy tokens identical for the first {same}/{DECODE_TOKENS}")
    print(f"saved {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
