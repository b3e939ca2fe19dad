"""Fixtures for the services tests, all over real components on loopback.

- `pg_url` (session): a throwaway PostgreSQL database `kiln_test_<random>`, migrated, dropped after.
- `redis_url` (session): Redis db 15, flushed before and after the session; each test run uses its
  own queue name.
- `services_env`: the `KILN_*` environment of a service process (PostgreSQL, Redis, the S3 test
  server from tests/fixtures/s3.py, short broker timeouts for fast redelivery).
- `celery_worker`: a real `celery ... worker --pool=prefork -c 1` process (a factory, so a test can
  pass extra settings such as the per-layer delay).
- `serve_app`: runs a FastAPI app under uvicorn in a thread on a free loopback port.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from runtime.distributed import free_port
from tests.fixtures.s3 import s3_test_env

if TYPE_CHECKING:
    from services.settings import ServiceSettings as Settings
    from tests.services.stack import Stack

REPO = Path(__file__).resolve().parents[2]
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_TEST_DBS = range(15, 7, -1)  # one per pytest-xdist worker (gw0: 15, gw1: 14, ...)
# Fast redelivery for tests (docs/formats.md §17.4): jobs here are far shorter than the visibility timeout.
TEST_VISIBILITY_TIMEOUT_S = 20
TEST_RESTORE_INTERVAL_S = 5
TEST_SOFT_LIMIT_S = 15
TEST_HARD_LIMIT_S = 18
WORKER_READY_TIMEOUT_S = 60


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything here talks to PostgreSQL / Redis / the S3 server: `-m "not services"` skips it."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.services)


def _pg_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    if not _pg_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432 (run infra/ensure-services.sh)")
    from sqlalchemy import create_engine, text

    from services.db import migrate

    name = f"kiln_test_{secrets.token_hex(4)}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        migrate.upgrade(url)
        yield url
    finally:
        from services.db.session import dispose_engines

        dispose_engines(close=True)
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    import redis

    # A session flushes its database at start and end, and kombu keeps its unacknowledged messages
    # and their restore lock in per-database keys: parallel workers sharing one database lost each
    # other's redeliveries (seen with `-n 2`).
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    url = f"redis://127.0.0.1:6379/{REDIS_TEST_DBS[worker % len(REDIS_TEST_DBS)]}"
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("Redis is not running on 127.0.0.1:6379 (run infra/ensure-services.sh)")
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


def clear_tables(url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("TRUNCATE jobs, artifact_files, artifacts, api_tokens RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture
def clean_db(pg_url: str) -> str:
    """The session's PostgreSQL database with every table emptied."""
    clear_tables(pg_url)
    return pg_url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database: the PostgreSQL test database, then a fresh SQLite file."""
    if request.param == "sqlite":
        from services.db import migrate

        url = f"sqlite:///{tmp_path / 'kiln.db'}"
        migrate.upgrade(url)
        return url
    return str(request.getfixturevalue("clean_db"))


@pytest.fixture
def services_env(
    clean_db: str, redis_url: str, s3_server: str, s3_bucket: str, tmp_path: Path
) -> dict[str, str]:
    """Environment of service processes: PostgreSQL, Redis (own queue), S3 store, short timeouts."""
    env = {
        "KILN_ENVIRONMENT": "test",
        "KILN_DATABASE_URL": clean_db,
        "KILN_BROKER_URL": redis_url,
        "KILN_CELERY_QUEUE": f"kiln-test-{secrets.token_hex(4)}",
        "KILN_STORE_URL": f"s3://{s3_bucket}/artifacts",
        "KILN_DATA_DIR": str(tmp_path / "var"),
        "KILN_CACHE_DIR": str(tmp_path / "cache"),
        "KILN_BROKER_VISIBILITY_TIMEOUT_S": str(TEST_VISIBILITY_TIMEOUT_S),
        "KILN_BROKER_RESTORE_INTERVAL_S": str(TEST_RESTORE_INTERVAL_S),
        "KILN_JOB_SOFT_TIME_LIMIT_S": str(TEST_SOFT_LIMIT_S),
        "KILN_JOB_HARD_TIME_LIMIT_S": str(TEST_HARD_LIMIT_S),
        "KILN_JOB_RETRY_BACKOFF_S": "0.5",
        "KILN_RECONCILE_INTERVAL_S": "0",
        "KILN_PROGRESS_WRITE_INTERVAL_S": "0.2",
        "KILN_MAX_JOB_ATTEMPTS": "3",
        # Tests name placeholder buckets (s3://b/x); tests/reliability/test_security_sources.py sets a list.
        "KILN_SOURCE_BUCKETS": "*",
        **s3_test_env(s3_server),
    }
    return env


def make_settings(env: dict[str, str]):  # type: ignore[no-untyped-def]
    """A Settings object built from exactly this environment (no .env file, no process env)."""
    from services.settings import ServiceSettings as Settings

    prefix = "KILN_"
    fields = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    return Settings(_env_file=None, **fields)  # type: ignore[call-arg]


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    log: Path

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def wait_for_child(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.child_pids()
            if pids:
                return pids[0]
            time.sleep(0.1)
        raise AssertionError(f"no pool process under the worker; log:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            children = self.child_pids()
            self.proc.send_signal(signal.SIGQUIT)  # cold shutdown: the tests are done with it
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def celery_worker(services_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(**extra_env: str) -> WorkerProcess:
        env = {**os.environ, **services_env, **extra_env}
        log = tmp_path / f"worker-{len(started)}.log"
        cmd = [
            sys.executable, "-m", "celery", "-A", "services.worker.app", "worker",
            "--pool=prefork", "-c", "1", "-Q", env["KILN_CELERY_QUEUE"], "--loglevel=INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"kiln-test-{secrets.token_hex(3)}@%h",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        worker = WorkerProcess(proc, log)
        started.append(worker)
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"celery worker exited early:\n{log.read_text()[-3000:]}")
            if "ready." in log.read_text(errors="replace"):
                return worker
            time.sleep(0.2)
        worker.stop()
        raise AssertionError(
            f"celery worker not ready in {WORKER_READY_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
        )

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def serve_app() -> Iterator[Callable[..., str]]:
    """Serve an ASGI app with uvicorn on a free loopback port in a thread; returns its base URL."""
    import uvicorn

    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def serve(app: object) -> str:
        port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")  # type: ignore[arg-type]
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise AssertionError("uvicorn did not start")
            time.sleep(0.05)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield serve
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def create_token(settings: object, *, admin: bool = False, name: str = "test") -> str:
    from services.db import repo
    from services.db.session import session_scope

    with session_scope(settings) as s:  # type: ignore[arg-type]
        plain, _ = repo.create_token(s, name, is_admin=admin)
    return plain


def wait_for_job(
    client: httpx.Client, job_id: str, *, until: Callable[[dict], bool] | None = None, timeout: float = 120
) -> dict:
    """Poll GET /v1/conversions/{id} until `until(job)` (default: a terminal status)."""
    until = until or (lambda j: j["status"] in ("succeeded", "failed", "cancelled"))
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        r = client.get(f"/v1/conversions/{job_id}")
        r.raise_for_status()
        job = r.json()
        if until(job):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach the expected state in {timeout} s: {job}")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic tiny bf16 Llama (2 layers, hidden 256) as a checkpoint directory."""
    from devtools.builders.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", "dense", dtype="bfloat16")


@pytest.fixture
def make_stack(
    services_env: dict[str, str],
    celery_worker: Callable[..., WorkerProcess],
    serve_app: Callable[..., str],
    s3_bucket: str,
) -> Iterator[Callable[..., Stack]]:
    clients: list[httpx.Client] = []

    from services.api.app import create_app
    from tests.services.stack import Stack

    def make(**worker_env: str) -> Stack:
        settings = make_settings(services_env)
        url = serve_app(create_app(settings))
        worker = celery_worker(**worker_env)
        user = httpx.Client(
            base_url=url, timeout=30, headers={"Authorization": f"Bearer {create_token(settings)}"}
        )
        admin = httpx.Client(
            base_url=url,
            timeout=30,
            headers={"Authorization": f"Bearer {create_token(settings, admin=True)}"},
        )
        clients.extend([user, admin])
        return Stack(settings, user, admin, worker, s3_bucket)

    yield make
    for c in clients:
        c.close()


def failed_job_error(settings: Settings, source: str) -> str:
    """Submit a conversion of `source`, run it in this process and return the error the failed job
    recorded (the job must fail)."""
    from services.convert.spec import ConversionSpec
    from services.db import repo
    from services.db.session import session_scope
    from services.worker.jobs import run_job

    with session_scope(settings) as s:
        job_id = repo.submit_job(
            s, ConversionSpec(source=source, targets=["cpu"]),
            idempotency_key=None, token_id=None, max_attempts=1,
        ).job.id  # fmt: skip
    assert run_job(job_id, settings=settings) == "failed"
    with session_scope(settings) as s:
        job = repo.get_job(s, job_id)
        assert job is not None and job.error is not None
        return job.error
