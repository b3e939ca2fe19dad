"""A pooled PostgreSQL connection that dies under a unit of work: `run_unit` replaces it and runs the
unit once more when that is safe, so a request or a worker step gets its answer, not a 500.

Each connection here is killed at a chosen moment (BackendKiller: just before a statement or a
COMMIT, waiting until the backend is gone), so every test takes the path it names, every run."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError, ProgrammingError
from sqlalchemy.orm import Session

from services.api.app import create_app
from services.convert.spec import ConversionSpec
from services.db import repo
from services.db.models import Job
from services.db.session import LOST_CONNECTION_ATTEMPTS, get_engine, run_unit
from services.settings import ServiceSettings
from services.worker.jobs import run_job
from tests.reliability.pg_kill import BackendKiller, terminate_connections
from tests.services.conftest import create_token, make_settings

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py

RETRY_LOG = "retrying on a new connection"
STORM_ROUNDS = 20


@pytest.fixture
def pg_settings(clean_db: str, tmp_path: Path) -> ServiceSettings:
    return ServiceSettings(_env_file=None, database_url=clean_db, data_dir=tmp_path / "var")  # type: ignore[call-arg]


@pytest.fixture
def killer(pg_settings: ServiceSettings) -> Iterator[BackendKiller]:
    k = BackendKiller(get_engine(pg_settings))
    yield k
    k.close()


def add_job(settings: ServiceSettings, source: str) -> Callable[[Session], str]:
    def work(s: Session) -> str:
        return repo.submit_job(
            s, ConversionSpec(source=source, targets=["cpu"]),
            idempotency_key=None, token_id=None, max_attempts=3,
        ).job.id  # fmt: skip

    return work


def job_count(settings: ServiceSettings) -> int:
    return run_unit(
        settings, lambda s: s.scalar(select(func.count()).select_from(Job)), what="count", read_only=True
    )


def retries(caplog: pytest.LogCaptureFixture) -> int:
    return sum(RETRY_LOG in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_read_whose_connection_died_is_run_again(
    pg_settings: ServiceSettings, killer: BackendKiller, caplog: pytest.LogCaptureFixture
) -> None:
    run_unit(pg_settings, lambda s: s.execute(text("SELECT 1")), what="warm-up", read_only=True)
    killer.arm(1)
    assert (
        run_unit(pg_settings, lambda s: s.scalar(text("SELECT 41 + 1")), what="a read", read_only=True) == 42
    )
    assert killer.killed == 1 and retries(caplog) == 1


def test_a_socket_that_failed_before_libpq_read_the_goodbye_is_a_lost_connection(
    pg_settings: ServiceSettings, killer: BackendKiller, caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg's "connection socket closed" (no SQLSTATE, connection not yet marked bad) is a
    disconnect: the read is run again, and a write that had not sent COMMIT too."""
    run_unit(pg_settings, lambda s: s.execute(text("SELECT 1")), what="warm-up", read_only=True)
    killer.arm(1, socket_error=True)
    assert (
        run_unit(pg_settings, lambda s: s.scalar(text("SELECT 41 + 1")), what="a read", read_only=True) == 42
    )
    killer.arm(1, statement="INSERT INTO jobs", socket_error=True)
    run_unit(pg_settings, add_job(pg_settings, "/src/a"), what="a write")
    assert killer.killed == 2 and retries(caplog) == 2 and job_count(pg_settings) == 1


def test_a_write_whose_connection_died_before_commit_is_run_again(
    pg_settings: ServiceSettings, killer: BackendKiller, caplog: pytest.LogCaptureFixture
) -> None:
    killer.arm(1, statement="INSERT INTO jobs")
    job_id = run_unit(pg_settings, add_job(pg_settings, "/src/a"), what="a write")
    assert killer.killed == 1 and retries(caplog) == 1
    assert job_count(pg_settings) == 1
    assert run_unit(pg_settings, lambda s: repo.get_job(s, job_id), what="read", read_only=True) is not None


def test_a_commit_that_failed_is_retried_only_for_an_idempotent_unit(
    pg_settings: ServiceSettings, killer: BackendKiller, caplog: pytest.LogCaptureFixture
) -> None:
    killer.arm(1, at="commit")
    with pytest.raises(DBAPIError) as err:  # outcome unknown: not run again
        run_unit(pg_settings, add_job(pg_settings, "/src/b"), what="a write")
    assert err.value.connection_invalidated and killer.killed == 1 and retries(caplog) == 0
    assert job_count(pg_settings) == 0  # the server rolled it back

    killer.arm(1, at="commit")
    run_unit(pg_settings, add_job(pg_settings, "/src/b"), what="a submission", idempotent=True)
    assert killer.killed == 2 and retries(caplog) == 1
    assert job_count(pg_settings) == 1


def test_a_loss_on_the_last_attempt_and_real_errors_surface(
    pg_settings: ServiceSettings, killer: BackendKiller, caplog: pytest.LogCaptureFixture
) -> None:
    killer.arm(LOST_CONNECTION_ATTEMPTS - 1)  # every attempt but the last loses its connection
    assert run_unit(pg_settings, lambda s: s.scalar(text("SELECT 7")), what="a read", read_only=True) == 7
    assert killer.killed == LOST_CONNECTION_ATTEMPTS - 1 and retries(caplog) == LOST_CONNECTION_ATTEMPTS - 1

    caplog.clear()
    killer.arm(LOST_CONNECTION_ATTEMPTS)
    with pytest.raises(DBAPIError) as err:
        run_unit(pg_settings, lambda s: s.execute(text("SELECT 1")), what="a read", read_only=True)
    assert err.value.connection_invalidated and retries(caplog) == LOST_CONNECTION_ATTEMPTS - 1

    calls: list[int] = []

    def broken(s: Session) -> None:
        calls.append(1)
        s.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(ProgrammingError):
        run_unit(pg_settings, broken, what="a broken read", read_only=True)
    assert calls == [1] and retries(caplog) == LOST_CONNECTION_ATTEMPTS - 1  # not retried


@pytest.fixture
def api(
    services_env: dict[str, str], serve_app: Callable[..., str]
) -> Iterator[tuple[httpx.Client, BackendKiller]]:
    """The REST API on PostgreSQL (its engine armed with a BackendKiller) and Redis; no worker, so
    submitted jobs stay queued."""
    settings = make_settings(services_env)
    url = serve_app(create_app(settings))
    killer = BackendKiller(get_engine(settings))
    headers = {"Authorization": f"Bearer {create_token(settings)}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        yield client, killer
    killer.close()


def submit(client: httpx.Client, source: str) -> httpx.Response:
    return client.post("/v1/conversions", json={"source": source, "targets": ["cpu"]})


def cancel(client: httpx.Client, job_id: str) -> httpx.Response:
    return client.post(f"/v1/conversions/{job_id}/cancel")


def test_requests_get_their_answer_when_their_connection_is_killed(
    api: tuple[httpx.Client, BackendKiller], caplog: pytest.LogCaptureFixture
) -> None:
    client, killer = api
    first = submit(client, "/src/first").json()["id"]
    second = submit(client, "/src/second").json()["id"]
    cases: list[tuple[str, str | None, Callable[[], httpx.Response], int]] = [
        ("read a job", "FROM jobs", lambda: client.get(f"/v1/conversions/{first}"), 200),
        ("list jobs", "FROM jobs", lambda: client.get("/v1/conversions"), 200),
        ("list artifacts", "FROM artifacts", lambda: client.get("/v1/artifacts"), 200),
        ("submit, at its INSERT", "INSERT INTO jobs", lambda: submit(client, "/src/third"), 202),
        ("cancel, at its SELECT … FOR UPDATE", "FOR UPDATE", lambda: cancel(client, first), 200),
        ("cancel, at its COMMIT", None, lambda: cancel(client, second), 200),
    ]  # fmt: skip
    for n, (name, statement, request, expected) in enumerate(cases, start=1):
        killer.arm(1, at="statement" if statement else "commit", statement=statement)
        r = request()
        assert r.status_code == expected, (name, r.status_code, r.text)
        assert killer.killed == n, f"{name}: its connection was not killed"
    assert retries(caplog) == len(cases)
    jobs = client.get("/v1/conversions", params={"limit": 100}).json()["items"]
    assert sorted(j["source"] for j in jobs) == ["/src/first", "/src/second", "/src/third"]
    assert {j["id"]: j["status"] for j in jobs}[first] == "cancelled"


def test_requests_during_connection_sweeps_are_all_answered(
    api: tuple[httpx.Client, BackendKiller], pg_url: str
) -> None:
    """Rounds of: every connection of the database terminated while reads and writes are in flight
    (the sweep and the requests start together)."""
    client, _ = api
    job_id = submit(client, "/src/storm").json()["id"]
    statuses: list[tuple[str, int, str]] = []
    terminated = 0

    def call(barrier: threading.Barrier, name: str, request: Callable[[], httpx.Response]) -> None:
        barrier.wait()
        r = request()
        statuses.append((name, r.status_code, r.text[:200]))

    def sweep(barrier: threading.Barrier) -> None:
        nonlocal terminated
        barrier.wait()
        terminated += terminate_connections(pg_url)

    for i in range(STORM_ROUNDS):
        barrier = threading.Barrier(4)
        threads = [
            threading.Thread(target=sweep, args=(barrier,)),
            threading.Thread(
                target=call, args=(barrier, "read", lambda: client.get(f"/v1/conversions/{job_id}"))
            ),
            threading.Thread(target=call, args=(barrier, "list", lambda: client.get("/v1/conversions"))),
            threading.Thread(
                target=call, args=(barrier, "submit", lambda i=i: submit(client, f"/src/storm-{i}"))
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    bad = [s for s in statuses if s[1] not in (200, 202)]
    assert not bad and len(statuses) == 3 * STORM_ROUNDS, bad
    assert terminated >= STORM_ROUNDS  # every sweep found connections to kill


def test_the_worker_claims_a_job_whose_connection_died(
    services_env: dict[str, str], tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim (SELECT … FOR UPDATE, attempt counted) runs on a connection killed just before it:
    the job runs once, with one attempt counted."""
    settings = make_settings(services_env)
    job_id = run_unit(settings, add_job(settings, str(tiny_checkpoint)), what="submit")
    killer = BackendKiller(get_engine(settings))
    try:
        killer.arm(1, statement="FOR UPDATE")
        assert run_job(job_id, settings=settings) == "succeeded"
    finally:
        killer.close()
    job = run_unit(settings, lambda s: repo.get_job(s, job_id), what="read", read_only=True)
    assert killer.killed == 1 and retries(caplog) == 1
    assert job is not None and job.status == "succeeded" and job.attempts == 1
