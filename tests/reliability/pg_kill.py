"""Killing PostgreSQL connections at chosen moments: the server side of a failover, restart or idle
kill, as `pg_terminate_backend` does it. `terminate_connections` sweeps a database; `BackendKiller`
kills the very connection that is about to run a statement (or COMMIT) and waits until its backend
is gone, so the client then talks to a dead connection every time, not just when a race allows."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event, text

from tests.services.conftest import PG_ADMIN_URL

BACKEND_EXIT_TIMEOUT_S = 10.0


def terminate_connections(database_url: str) -> int:
    """pg_terminate_backend on every other connection to this database; returns how many."""
    name = database_url.rsplit("/", 1)[-1]
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            return len(
                c.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": name},
                ).all()
            )
    finally:
        admin.dispose()


class BackendKiller:
    """Armed with `arm(n, at=...)`, kills the backend of the next n connections of `engine` that
    run a statement matching `statement` (at="statement", just before it is sent) or a COMMIT
    (at="commit"), then lets the client go on with its now-dead connection. With
    `socket_error=True` the client then fails the way psycopg fails when the kernel reports the
    reset before libpq has read the server's goodbye: "connection socket closed", no SQLSTATE, on
    a connection libpq still calls healthy (a race: seen once in CI, not reproducible on demand)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        self._lock = threading.Lock()
        self._left = 0
        self._at = "statement"
        self._pattern: re.Pattern[str] | None = None
        self._socket_error = False
        self.killed = 0
        event.listen(engine, "before_cursor_execute", self._before_statement)
        event.listen(engine, "commit", self._before_commit)

    def arm(
        self, n: int = 1, *, at: str = "statement", statement: str | None = None, socket_error: bool = False
    ) -> None:
        with self._lock:
            self._left, self._at, self._socket_error = n, at, socket_error
            self._pattern = re.compile(statement, re.IGNORECASE) if statement else None

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._before_statement)
        event.remove(self.engine, "commit", self._before_commit)
        self.admin.dispose()

    def _before_statement(self, conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if self._at == "statement" and (self._pattern is None or self._pattern.search(statement)):
            self._maybe_kill(conn)

    def _before_commit(self, conn: Any) -> None:
        if self._at == "commit":
            self._maybe_kill(conn)

    def _maybe_kill(self, conn: Any) -> None:
        with self._lock:
            if self._left <= 0:
                return
            self._left -= 1
        pid = conn.connection.dbapi_connection.info.backend_pid
        with self.admin.connect() as c:
            c.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            deadline = time.monotonic() + BACKEND_EXIT_TIMEOUT_S
            while c.execute(text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).first():
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"backend {pid} still alive {BACKEND_EXIT_TIMEOUT_S} s after termination"
                    )
                time.sleep(0.01)
        self.killed += 1
        if self._socket_error:
            raise psycopg.OperationalError("connection socket closed")
