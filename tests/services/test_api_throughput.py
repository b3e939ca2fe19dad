"""What keeps the API fast under load, over real HTTP, PostgreSQL and Redis: a status poll is one SQL
statement (its token remembered for `token_cache_s`, no transaction, no ping), a revoked token
stops working within that time, a pooled connection the server dropped while idle is replaced, and
`bench/load.py` itself runs (its figures are in the closing notes, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, event, text

from services.api.app import create_app
from services.db import repo
from services.db.session import dispose_engines, get_engine, session_factory, session_scope
from services.settings import ServiceSettings as Settings
from tests.services.conftest import PG_ADMIN_URL, REPO, create_token, make_settings


@pytest.fixture
def settings(services_env: dict[str, str]) -> Settings:
    # as in a fresh API process: no connection pooled by an earlier test of this worker (the
    # warm-up test counts the connections a start opens)
    dispose_engines()
    return make_settings({**services_env, "KILN_TOKEN_CACHE_S": "0.5"})


@pytest.fixture
def base_url(settings: Settings, serve_app: Callable[..., str]) -> str:
    return serve_app(create_app(settings))


@pytest.fixture
def statements(settings: Settings) -> Iterator[list[str]]:
    """Every SQL statement the process sends to the test database while the test runs."""
    seen: list[str] = []
    engine = get_engine(settings)

    def record(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
        seen.append(" ".join(statement.split()))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_a_status_poll_is_one_select_with_no_transaction(
    base_url: str, settings: Settings, statements: list[str]
) -> None:
    token = create_token(settings)
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}) as c:
        job = c.post("/v1/conversions", json={"source": "s3://checkpoints/tiny", "targets": ["cpu"]})
        assert job.status_code == 202
        c.get(f"/v1/conversions/{job.json()['id']}")  # the token is now remembered
        statements.clear()
        for _ in range(5):
            r = c.get(f"/v1/conversions/{job.json()['id']}")
            assert r.status_code == 200 and r.json()["status"] == "queued"
    assert len(statements) == 5, statements
    assert all(s.startswith("SELECT") and "FROM jobs" in s for s in statements), statements


def test_a_submission_is_one_insert_with_no_transaction(
    base_url: str, settings: Settings, statements: list[str]
) -> None:
    token = create_token(settings)
    commits: list[object] = []
    event.listen(get_engine(settings), "commit", lambda *_: commits.append(1))
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}) as c:
        c.get("/v1/conversions")  # the token is now remembered
        statements.clear()
        r = c.post("/v1/conversions", json={"source": "s3://checkpoints/one", "targets": ["cpu"]})
        assert r.status_code == 202 and r.headers["location"] == f"/v1/conversions/{r.json()['id']}"
        first, commits_of_first = list(statements), len(commits)
        again = c.post("/v1/conversions", json={"source": "s3://checkpoints/one", "targets": ["cpu"]})
        assert again.json()["id"] == r.json()["id"]  # the conflict path still finds the live job
    assert len(first) == 1, first
    assert first[0].startswith("INSERT INTO jobs") and "ON CONFLICT DO NOTHING" in first[0], first
    assert commits_of_first == 0  # autocommit: no BEGIN / COMMIT round trips


def test_a_revoked_token_stops_working_within_the_token_cache_time(base_url: str, settings: Settings) -> None:
    token = create_token(settings, name="leaving")
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{base_url}/v1/conversions", headers=headers).status_code == 200
    with session_scope(settings) as s:
        assert [t.name for t in repo.revoke_tokens(s, name="leaving").revoked] == ["leaving"]
    time.sleep(settings.token_cache_s + 0.1)
    r = httpx.get(f"{base_url}/v1/conversions", headers=headers)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]


def test_a_pooled_connection_the_server_dropped_is_replaced_without_a_ping(
    settings: Settings, statements: list[str]
) -> None:
    factory = session_factory(settings, autocommit=True)
    with factory() as s:
        pid = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        assert c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
    admin.dispose()
    time.sleep(0.3)
    statements.clear()
    with factory() as s:  # the checkout sees the closed socket and reconnects; no ping was needed
        assert s.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    assert statements == ["SELECT pg_backend_pid()"]


def test_kiln_api_refuses_several_processes_without_a_broker(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KILN_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "api", "--workers", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "need a broker (KILN_BROKER_URL)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_load_benchmark_runs_against_kiln_api_with_two_processes(
    tmp_path: Path, pg_url: str, redis_url: str
) -> None:
    """bench/load.py end to end at a low rate (it starts `kiln api --workers 2` on PostgreSQL and
    Redis): nothing lost, no 5xx, every accepted submission found in SQL."""
    results = tmp_path / "load.json"
    out = subprocess.run(
        [
            sys.executable, "bench/load.py", "--skip-serve", "--rate", "40", "--seconds", "3",
            "--peer-seconds", "1", "--redis-url", redis_url, "--results", str(results),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    api = json.loads(results.read_text())["api"]
    assert api["requests"] == 120 and api["5xx"] == 0 and api["lost"] == 0, api
    assert api["submissions_accepted"] > 0 and api["accepted_missing_in_sql"] == 0
    assert set(api["by_method"]) == {"GET", "POST"}


def test_a_fresh_api_answers_its_first_requests_on_connections_opened_at_start(
    settings: Settings, serve_app: Callable[..., str], statements: list[str], redis_url: str
) -> None:
    """warm_up (services/api/warmup.py) opens api_threads database connections and the broker's
    producer connections before uvicorn accepts: concurrent first requests open none."""
    from concurrent.futures import ThreadPoolExecutor

    import redis

    token = create_token(settings)
    engine = get_engine(settings)
    opened: list[object] = []
    event.listen(engine, "connect", lambda *_: opened.append(1))
    broker = redis.Redis.from_url(redis_url)
    db = str(broker.connection_pool.connection_kwargs["db"])

    def broker_clients() -> int:
        return sum(1 for c in broker.client_list() if c["db"] == db)

    try:
        base_url = serve_app(create_app(settings))
        assert opened, "the start opened no database connection"
        pooled, clients = len(opened), broker_clients()
        assert engine.pool.checkedin() >= settings.api_threads
        statements.clear()

        def submit(i: int) -> int:
            body = {"source": f"s3://checkpoints/warm-{i}", "targets": ["cpu"]}
            headers = {"Authorization": f"Bearer {token}"}
            return httpx.post(f"{base_url}/v1/conversions", json=body, headers=headers).status_code

        with ThreadPoolExecutor(settings.api_threads) as pool:
            assert list(pool.map(submit, range(2 * settings.api_threads))) == [202] * 2 * settings.api_threads
        assert len(opened) == pooled, "a first request opened a database connection"
        assert broker_clients() <= clients, "a first request opened a broker connection"
    finally:
        broker.close()


def test_the_api_starts_when_its_database_is_down_at_start(
    services_env: dict[str, str], serve_app: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    down = make_settings(
        {**services_env, "KILN_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:9/none"}
    )
    with caplog.at_level("WARNING", logger="services.api.warmup"):
        base_url = serve_app(create_app(down))
    assert "API warm-up: no database connection" in caplog.text
    r = httpx.get(f"{base_url}/health")
    assert r.status_code == 503 and r.json()["checks"]["db"] == "down", r.text
