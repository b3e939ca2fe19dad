"""vLLM's CPU build as a real host for the plugin: `vllm serve ARTIFACT --load-format kiln` in a
subprocess of its own virtual environment (`make vllm-venv`: .venv-vllm, or $KILN_VLLM_PYTHON)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, VLLM_LOGGING_LEVEL="INFO", **extra)
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
        "--port", str(port), "--max-model-len", "512", "--dtype", "bfloat16", "--enforce-eager",
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


@contextmanager
def vllm_serve(artifact: Path, workdir: Path, *extra: str) -> Iterator[VllmServer]:
    """`vllm serve` on a loopback port until it answers /health; its load report and log kept."""
    started = launch(artifact, workdir, *extra)
    try:
        yield started.ready()
    finally:
        started.stop()


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
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


def run_to_exit(
    artifact: Path, workdir: Path, *extra: str, timeout_s: float = STARTUP_TIMEOUT_S
) -> tuple[int, str]:
    """`vllm serve` expected to refuse: its exit status and log."""
    port = free_port()
    proc = subprocess.run(
        start_command(artifact, port, *extra),
        capture_output=True,
        text=True,
        env=vllm_env(),
        cwd=workdir,
        timeout=timeout_s,
    )
    return proc.returncode, proc.stdout + proc.stderr
