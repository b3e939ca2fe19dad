"""`kiln api` as an operator starts it: a subprocess on a free loopback port with SQLite, a local
artifact directory and the embedded worker (unless `env` says otherwise), killed at the end.

A real process matters for the denial-of-service tests: what stalls one request must not stall the
others, and a test must be able to kill a server that is stuck (one in the test's own process would
take the test down with it). Used by tests/reliability and bench/security_probe.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import DemoStepFailed, Server
from services.settings import ServiceSettings

START_TIMEOUT_S = 120


@dataclass
class KilnApi:
    url: str
    admin_token: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def settings(self) -> ServiceSettings:
        """Settings reaching the same SQLite database (to create more tokens)."""
        return ServiceSettings(_env_file=None, data_dir=self.data_dir)  # type: ignore[call-arg]

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def kiln_api(workdir: Path, **env: str) -> Iterator[KilnApi]:
    """Start `kiln api` with `KILN_*` variables `env` on top of a data directory in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "var"
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KILN_DATA_DIR": str(data), **env}
    log = workdir / "kiln-api.log"
    server = Server(["api"], full_env, log)
    try:
        try:
            server.wait_ready(START_TIMEOUT_S)
        except DemoStepFailed as e:
            raise AssertionError(f"kiln api did not start:\n{log.read_text(errors='replace')[-3000:]}") from e
        yield KilnApi(server.url, (data / "admin-token").read_text().strip(), data, server.proc, log)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
