"""Helpers for the fault tests: a throwaway Redis server one test may stop and restart, job
submission, and the store/SQL invariants every fault must preserve."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from sqlalchemy import func, select

from services.db.models import Artifact
from services.db.session import session_scope
from tests.services.stack import Stack

REDIS_START_TIMEOUT_S = 10


class ThrowawayRedis:
    """`redis-server` on its own loopback port, nothing on disk; stop() and start() keep the port."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"redis-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # like a crash: nothing is saved
            self.proc.wait(timeout=10)
        self.proc = None


def submit(stack: Stack, source: str, targets: list[str]) -> dict:
    r = stack.api.post("/v1/conversions", json={"source": source, "targets": targets})
    assert r.status_code == 202, r.text
    return r.json()


def artifact_rows(stack: Stack) -> int:
    with session_scope(stack.settings) as s:
        return s.scalar(select(func.count()).select_from(Artifact)) or 0
