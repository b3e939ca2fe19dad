"""Served rows of bench/runtime.py: an OpenAI-compatible server (`kiln serve`, vLLM's CPU API server)
started fresh and measured through the official `openai` client, as users meet it.

Per server: process start -> first streamed token of the first request (cold start); batch-1 decode
streaming (tokens after the first / time after the first chunk) and non-streaming (the same over
the request's time less the streamed time to first token); batch-B decode with B concurrent
streaming requests (B * (tokens - 1) / time from the first first-token to the last finish, so
slightly conservative: the sequences join the batch within a step or two of each other); peak RSS
of the server's processes.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 900.0
BATCH1_RUNS = 3


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base_url: str
    model: str
    spawned_at: float  # time.perf_counter() just before Popen


def free_port() -> int:
    from runtime.distributed import free_port as pick

    return pick()


def threads_env(threads: int) -> dict[str, str]:
    """This environment with the repository importable and every library at `threads` threads."""
    repo = Path(__file__).resolve().parents[1]
    return {
        **os.environ,
        "PYTHONPATH": str(repo),
        "KILN_NUM_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


def start_kiln(artifact: Path, threads: int, max_num_seqs: int, log: Path) -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "services.cli", "serve", str(artifact), "--port", str(port),
        "--max-num-seqs", str(max_num_seqs), "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return _spawn(cmd, threads_env(threads), port, artifact.name, log)


def vllm_api_command(vllm_python: Path, model: Path, port: int, mode: str, max_num_seqs: int) -> list[str]:
    """vLLM's CPU/GPU API server on `model` (a checkpoint, or an artifact with `--load-format kiln`
    appended), `mode` eager or compiled (its default), served as "m", context 512, bf16."""
    cmd = [
        str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--dtype", "bfloat16",
        "--served-model-name", "m", "--max-num-seqs", str(max_num_seqs),
    ]  # fmt: skip
    if mode == "eager":
        cmd.append("--enforce-eager")
    return cmd


def vllm_env(gpu: bool = False) -> dict[str, str]:
    """This environment without the calling venv's marker; on CPU a 1 GiB KV cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    if not gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def start_vllm(vllm_python: Path, checkpoint: Path, mode: str, max_num_seqs: int, log: Path) -> Server:
    """vLLM's CPU API server on a checkpoint, with its own kernels."""
    port = free_port()
    return _spawn(
        vllm_api_command(vllm_python, checkpoint, port, mode, max_num_seqs), vllm_env(), port, "m", log
    )


def _spawn(cmd: list[str], env: dict[str, str], port: int, model: str, log: Path) -> Server:
    repo = Path(__file__).resolve().parents[1]
    if str(repo) not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(proc, f"http://127.0.0.1:{port}", model, t0)


def stop(server: Server) -> None:
    from tests.vllm_plugin.vllm_host import stop as stop_group

    stop_group(server.proc, timeout_s=60)


def wait_ready(server: Server, log: Path) -> None:
    wait_healthy(server.proc, server.base_url, log, server.spawned_at)


def wait_healthy(proc: subprocess.Popen[bytes], base_url: str, log: Path, since: float) -> float:
    """Poll `/health` until 200 while the process lives; seconds from `since` (perf_counter) to ready."""
    while time.perf_counter() - since < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return time.perf_counter() - since
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"server not ready in {READY_TIMEOUT_S} s")


def _stream(client: Any, model: str, prompt: str, tokens: int) -> tuple[float, float, float]:
    """(request sent, first chunk, last chunk) perf_counter times of one greedy streamed completion."""
    t0 = time.perf_counter()
    first = 0.0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None and not first:
            first = time.perf_counter()
    return t0, first, time.perf_counter()


def _complete(client: Any, model: str, prompt: str, tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return time.perf_counter() - t0, r.usage.completion_tokens


def measure(server: Server, log: Path, prompt: str, tokens: int, batches: tuple[int, ...]) -> dict[str, Any]:
    import openai

    wait_ready(server, log)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    _, first, _ = _stream(client, server.model, prompt, 2)
    result: dict[str, Any] = {"cold_start_s": first - server.spawned_at}
    _stream(client, server.model, prompt, 16)  # warm-up
    streamed = [_stream(client, server.model, prompt, tokens) for _ in range(BATCH1_RUNS)]
    ttft = statistics.median(f - t0 for t0, f, _ in streamed)
    decode: dict[str, float] = {"1": statistics.median((tokens - 1) / (end - f) for _, f, end in streamed)}
    plain = [_complete(client, server.model, prompt, tokens) for _ in range(BATCH1_RUNS)]
    decode["1-nonstream"] = statistics.median((n - 1) / (secs - ttft) for secs, n in plain)
    for b in (b for b in batches if b > 1):
        decode[str(b)] = _concurrent(lambda: _stream(client, server.model, prompt, tokens), b, tokens)
    result["ttft_s"] = ttft
    result["decode_tok_s"] = decode
    result["peak_rss_mb"] = _group_hwm_mb(server.proc.pid)
    return result


def _concurrent(one: Callable[[], tuple[float, float, float]], b: int, tokens: int) -> float:
    times: list[tuple[float, float, float]] = []
    threads = [threading.Thread(target=lambda: times.append(one())) for _ in range(b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(times) != b:
        raise RuntimeError(f"{b - len(times)} of {b} concurrent requests failed")
    first = min(f for _, f, _ in times)
    end = max(e for _, _, e in times)
    return b * (tokens - 1) / (end - first)


def _group_hwm_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of a process and its descendants, summed."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    total = 0
    for p in [pid, *(int(x) for x in out.split())]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")), 0)
        except OSError:
            continue
    return total / 1024
