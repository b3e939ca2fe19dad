"""What surviving a dropped PostgreSQL connection costs the REST API: a round trip per checkout
(SQLAlchemy's pre-ping) against what Kiln ships (a socket check at checkout, no round trip, and
`run_unit`'s one retry on a connection found dead at its first statement).

    .venv/bin/python bench/db_reconnect.py [--polls 2000] [--rounds 30]

For each way: the API (uvicorn on loopback, in this process) on a throwaway PostgreSQL database;
`--polls` sequential status polls (GET /v1/conversions/{id}, one SELECT each) timed one by one,
then `--rounds` rounds of a sweep that terminates every connection of the database while a read, a
listing and a submission are in flight (they start together), counting answers that are not 2xx.
Prints per-way p50 / p99 poll latency, polls/s and the ratio of the two ways. Needs PostgreSQL on
127.0.0.1:5432 (trust auth); no broker (submissions go to the embedded worker's queue and fail
fast: their sources do not exist).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import DisconnectionError

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

from runtime.distributed import free_port  # noqa: E402
from services.api.app import create_app  # noqa: E402
from services.convert.spec import ConversionSpec  # noqa: E402
from services.db import migrate, repo  # noqa: E402
from services.db.session import dispose_engines, get_engine, session_scope  # noqa: E402
from services.settings import ServiceSettings  # noqa: E402
from tests.reliability.pg_kill import terminate_connections  # noqa: E402

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def add_pre_ping(engine: Engine) -> None:
    """What `pool_pre_ping=True` does: one round trip on every checkout."""

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn, _record, _proxy) -> None:  # type: ignore[no-untyped-def]
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as e:
            raise DisconnectionError(str(e)) from e


def serve(app: object) -> tuple[str, uvicorn.Server, threading.Thread]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


def measure(way: str, polls: int, rounds: int, workdir: Path) -> dict[str, float]:
    database = f"kiln_bench_{secrets.token_hex(4)}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{database}"'))
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
    try:
        migrate.upgrade(url)
        settings = ServiceSettings(_env_file=None, database_url=url, data_dir=workdir / way.replace(" ", "-"))  # type: ignore[call-arg]
        if way != "shipped":
            add_pre_ping(get_engine(settings))
        with session_scope(settings) as s:
            token, _ = repo.create_token(s, "bench", is_admin=True)  # sees the ownerless job
            job = repo.submit_job(
                s, ConversionSpec(source="/bench/none", targets=["cpu"]),
                idempotency_key=None, token_id=None, max_attempts=1,
            ).job  # fmt: skip
            repo.finish_job(s, job.id, "failed", "bench row")
            job_id = job.id
        base, server, thread = serve(create_app(settings))
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        try:
            for _ in range(50):  # warm-up
                client.get(f"/v1/conversions/{job_id}").raise_for_status()
            times = []
            t0 = time.perf_counter()
            for _ in range(polls):
                t = time.perf_counter()
                client.get(f"/v1/conversions/{job_id}").raise_for_status()
                times.append(time.perf_counter() - t)
            elapsed = time.perf_counter() - t0
            failures = storm(client, job_id, url, rounds)
        finally:
            client.close()
            server.should_exit = True
            thread.join(timeout=10)
        times.sort()
        return {
            "p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * times[int(0.99 * (len(times) - 1))],
            "polls_per_s": polls / elapsed,
            "storm_failures": failures,
            "storm_requests": 3 * rounds,
        }
    finally:
        dispose_engines(close=True)
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


def storm(client: httpx.Client, job_id: str, database_url: str, rounds: int) -> int:
    failures = 0
    for i in range(rounds):
        barrier = threading.Barrier(4)
        answers: list[int] = []

        def call(
            request: Callable[[], httpx.Response],
            barrier: threading.Barrier = barrier,
            answers: list[int] = answers,
        ) -> None:
            barrier.wait()
            answers.append(request().status_code)

        def sweep(barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            terminate_connections(database_url)

        requests = [
            lambda: client.get(f"/v1/conversions/{job_id}"),
            lambda: client.get("/v1/conversions"),
            lambda i=i: client.post(
                "/v1/conversions", json={"source": f"/bench/storm-{i}", "targets": ["cpu"]}
            ),
        ]
        threads = [threading.Thread(target=sweep)] + [
            threading.Thread(target=call, args=(r,)) for r in requests
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        failures += sum(code >= 300 for code in answers) + (3 - len(answers))
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--polls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    ways = ("shipped", "pre-ping")  # both retry; "pre-ping" also pings on every checkout
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-db-") as tmp:
        for way in ways:
            results[way] = measure(way, args.polls, args.rounds, Path(tmp))
    print(f"{'way':<10} {'p50 ms':>8} {'p99 ms':>8} {'polls/s':>9} {'storm failures':>16}")
    for way, r in results.items():
        storm_col = f"{r['storm_failures']:.0f}/{r['storm_requests']:.0f}"
        print(f"{way:<10} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['polls_per_s']:>9.1f} {storm_col:>16}")
    a, b = results["pre-ping"], results["shipped"]
    print(
        f"pre-ping / shipped: p50 {a['p50_ms'] / b['p50_ms']:.2f}x, p99 {a['p99_ms'] / b['p99_ms']:.2f}x, "
        f"throughput {a['polls_per_s'] / b['polls_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
