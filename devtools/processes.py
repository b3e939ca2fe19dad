"""The processes `make demo` starts (`kiln api`, `kiln serve`, one-shot `kiln` commands), with their
output in the demo's log file, and the stdout/stderr redirection that keeps the checkpoint
producers' output (llm-compressor's per-module logs, progress bars) out of the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kernels.errors import KilnError
from runtime.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
KILN = [sys.executable, "-m", "services.cli"]


class DemoStepFailed(KilnError):
    """A process the demo started failed; its output is in the demo's log file."""


@contextmanager
def output_into(log: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2: print, logging, tqdm,
    loguru and C libraries alike) to `log` for the duration of the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with log.open("ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def kiln(args: list[str], env: dict[str, str], log: Path, timeout: float = 600) -> str:
    """Run one `kiln` command to completion; its stdout is returned, its stderr goes to `log`."""
    with log.open("ab") as err:
        err.write(f"\n$ kiln {' '.join(args)}\n".encode())
        err.flush()
        out = subprocess.run(
            [*KILN, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, timeout=timeout
        )
    if out.returncode != 0:
        raise DemoStepFailed(f"`kiln {' '.join(args)}` exited with {out.returncode}; see {log}")
    return out.stdout.decode().strip()


class Server:
    """A long-running `kiln` command serving HTTP on a free loopback port."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.started = time.perf_counter()
        with log.open("ab") as out:
            out.write(f"\n$ kiln {' '.join(self.args)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [*KILN, *self.args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the process's start until /health answered 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DemoStepFailed(
                    f"`kiln {' '.join(self.args)}` exited with {self.proc.returncode}; see {self.log}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise DemoStepFailed(f"`kiln {' '.join(self.args)}` not ready in {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
