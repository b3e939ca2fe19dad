"""vLLM's CPU build as a real host for the plugin: `vllm serve ARTIFACT --load-format kiln` in a
subprocess of its own virtual environment (`make vllm-venv`: .venv-vllm, or $KILN_VLLM_PYTHON)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "KILN_VLLM_PYTHON"
STARTUP_TIMEOUT_S = 240.0
# vLLM's CPU KV cache (GiB); its default would take a quarter of this machine's memory.
KV_CACHE_GIB = "1"


def vllm_python() -> Path:
    """The vLLM venv's python, or skip (the venv is built by `make test` through `make vllm-venv`)."""
    path = Path(os.environ.get(VLLM_PYTHON_ENV, REPO / ".venv-vllm" / "bin" / "python"))
    if not path.exists():
        pytest.skip(f"vLLM's CPU build is not installed at {path} (make vllm-venv)")
    return path


# Prepended to a `run_in_vllm` script that calls vLLM's Marlin preparation: `gptq_marlin_repack` is a
# CUDA op the CPU build lacks, replaced by vLLM's own pure-Python test packer on the unpacked codes
# (that unpacking is this file's transcription).
MARLIN_REPACK_PRELUDE = r"""
import sys, types
import torch
import vllm._custom_ops as ops
from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights


def repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32)
    codes = (b_q_weight[:, None, :] >> shifts[None, :, None]) & ((1 << num_bits) - 1)
    codes = codes.reshape(size_k, size_n)
    return marlin_weights(codes, size_k, size_n, num_bits, get_weight_perm(num_bits, is_a_8bit), is_a_8bit)


ops.gptq_marlin_repack = repack
"""


def run_in_vllm(script: str, cases: dict[str, Any], work: Path) -> dict[str, Any]:
    """`script` run in vLLM's venv on `cases` (torch.save'd to its argv[1]): what it torch.save'd to
    argv[2] (skips without the venv; its output tail on a failure)."""
    import torch

    python = vllm_python()
    torch.save(cases, work / "in.pt")
    proc = subprocess.run(
        [str(python), "-c", script, str(work / "in.pt"), str(work / "out.pt")],
        cwd=REPO, env=vllm_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(work / "out.pt", weights_only=True)


def split_by_source(
    results: dict[str, Any], sources: list[str] | tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """`run_in_vllm` results keyed "<source>:<name>" -> {source: {name: result}}."""
    out: dict[str, dict[str, Any]] = {source: {} for source in sources}
    for key, value in results.items():
        source, name = key.split(":", 1)
        out[source][name] = value
    return out


def vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update({"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "VLLM_LOGGING_LEVEL": "INFO", **extra})
    return env


@dataclass
class VllmServer:
    base_url: str
    model: str
    report: dict[str, Any]
    log: Path

    def completions(self, **body: Any) -> dict[str, Any]:
        r = httpx.post(f"{self.base_url}/v1/completions", json={"model": self.model, **body}, timeout=120)
        r.raise_for_status()
        return r.json()

    def chat(self, **body: Any) -> dict[str, Any]:
        r = httpx.post(
            f"{self.base_url}/v1/chat/completions", json={"model": self.model, **body}, timeout=120
        )
        r.raise_for_status()
        return r.json()


def start_command(artifact: Path, port: int, *extra: str) -> list[str]:
    """`vllm serve ARTIFACT ...` as its module: vllm-cpu 0.32's `vllm` script looks up the package
    metadata of `vllm`, which the `vllm-cpu` distribution does not have, and exits."""
    return [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(artifact),
        "--load-format", "kiln", "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "512", "--enforce-eager",
        "--served-model-name", "kiln-artifact", *extra,
    ]  # fmt: skip


@dataclass
class VllmLaunch:
    """A `vllm serve` process started and not yet waited for: several can start at once (their
    start-up is mostly single-threaded imports in three processes), each waited for when needed."""

    proc: subprocess.Popen[bytes]
    base_url: str
    report: Path
    log: Path
    deadline: float

    def ready(self) -> VllmServer:
        """Wait until it answers /health (at most STARTUP_TIMEOUT_S from its launch)."""
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited with {self.proc.returncode}:\n{self.log.read_text()[-6000:]}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > self.deadline:
                raise AssertionError(
                    f"vllm serve not ready in {STARTUP_TIMEOUT_S} s:\n{self.log.read_text()[-6000:]}"
                )
            time.sleep(0.5)
        return VllmServer(self.base_url, "kiln-artifact", json.loads(self.report.read_text()), self.log)

    def stop(self) -> None:
        stop(self.proc)


def launch(artifact: Path, workdir: Path, *extra: str) -> VllmLaunch:
    """Start `vllm serve` on a loopback port in its own process group; its load report and log go to
    `workdir`."""
    port = free_port()
    report, log = workdir / "load-report.json", workdir / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            start_command(artifact, port, *extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=vllm_env(KILN_VLLM_LOAD_REPORT=str(report)),
            cwd=workdir,
            start_new_session=True,
        )
    return VllmLaunch(proc, f"http://127.0.0.1:{port}", report, log, time.monotonic() + STARTUP_TIMEOUT_S)


def stop(proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    """Stop a server started with start_new_session=True: its whole process group (vLLM's engine and
    workers), SIGTERM first, SIGKILL after `timeout_s`."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


OFFLINE_HOST = Path(__file__).with_name("offline_host.py")


class OfflineHost:
    """vLLM's offline engine in one long-lived process of the vLLM venv (tests/vllm_plugin/
    offline_host.py): jobs in, one result each, in order. A job that kills the process (a C++ abort)
    gets its log tail as its error, and a fresh process serves the next."""

    def __init__(self, workdir: Path, **env: str) -> None:
        self.workdir = workdir
        self.env = env
        self.log = workdir / "vllm-offline.log"
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0

    def _start(self) -> subprocess.Popen[str]:
        self.starts += 1
        with self.log.open("a") as log:
            proc = subprocess.Popen(
                [str(vllm_python()), str(OFFLINE_HOST)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env=vllm_env(VLLM_LOGGING_LEVEL="WARNING", **self.env),
                cwd=self.workdir,
                start_new_session=True,
            )
        assert proc.stdout is not None
        if not proc.stdout.readline():
            raise AssertionError(f"vLLM's offline host did not start:\n{self.log.read_text()[-6000:]}")
        return proc

    def run(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results = []
        for job in jobs:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                line = json.dumps({
                    "id": job.get("id"), "ok": False,
                    "error": f"vLLM died (exit {self.proc.returncode}): {self.log.read_text()[-3000:]}",
                })  # fmt: skip
            results.append(json.loads(line))
        return results

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stop(self.proc)
