"""Engine and session helpers. One engine per process; forked workers dispose the inherited one."""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from services.redact import redact_text
from services.settings import ServiceSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_engines: dict[str, Engine] = {}
# One sessionmaker per engine: each sessionmaker builds its own Session subclass, whose event
# dispatch setup costs more than the query of a status poll.
_factories: dict[tuple[str, bool], sessionmaker[Session]] = {}


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    engine = create_engine(url, pool_size=10, max_overflow=20, pool_recycle=1800)
    _ping_when_idle(engine)
    _lost_sockets_are_disconnects(engine)
    return engine


# SQLSTATEs of a connection the server ended: class 08 (connection exception), admin / crash
# shutdown, "cannot connect now".
_DISCONNECT_SQLSTATES = ("08", "57P01", "57P02", "57P03")


def _lost_sockets_are_disconnects(engine: Engine) -> None:
    """SQLAlchemy's psycopg dialect calls an error a disconnect only when libpq has already marked
    the connection bad. When the socket fails first (the backend was terminated and the kernel
    reports the reset before libpq reads the server's goodbye), psycopg raises an OperationalError
    with no SQLSTATE ("connection socket closed") on a connection it still calls healthy: the
    connection would go back to the pool, its reset would fail on the half-sent query, and the unit
    would not be retried. Any OperationalError without a SQLSTATE comes from the client side of the
    socket, so it is a disconnect too; errors the server reported keep their meaning."""
    operational_error = engine.dialect.loaded_dbapi.OperationalError

    @event.listens_for(engine, "handle_error")
    def _classify(ctx) -> None:  # type: ignore[no-untyped-def]
        e = ctx.original_exception
        if ctx.is_disconnect or not isinstance(e, operational_error):
            return
        sqlstate = getattr(e, "sqlstate", None)
        if sqlstate is None or sqlstate.startswith(_DISCONNECT_SQLSTATES):
            ctx.is_disconnect = True


IDLE_PING_S = 10.0


def _ping_when_idle(engine: Engine) -> None:
    """Check a pooled connection on checkout without a round trip: a connection the server closed
    (restart, `pg_terminate_backend`, idle kill) has its socket readable (the server's goodbye or
    EOF), which one `select` sees; only a connection idle for IDLE_PING_S is also pinged (a peer
    that vanished without closing). A dead connection is replaced transparently, and a busy API does
    not pay the round trip per request that `pool_pre_ping` costs."""

    @event.listens_for(engine, "checkin")
    def _stamp(_dbapi_conn, record) -> None:  # type: ignore[no-untyped-def]
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _check(dbapi_conn, record, _proxy) -> None:  # type: ignore[no-untyped-def]
        since = record.info.get("idle_since")
        if since is None:  # a new connection
            return
        if _closed_by_server(dbapi_conn):
            raise DisconnectionError("the server closed this pooled connection")
        if time.monotonic() - since < IDLE_PING_S:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as e:
            raise DisconnectionError(f"pooled connection is gone: {e}") from e
        if not alive:
            raise DisconnectionError("pooled connection did not answer a ping")


def _closed_by_server(dbapi_conn: Any) -> bool:
    """An idle PostgreSQL connection has nothing to read; anything readable means the server
    said goodbye (or closed the socket)."""
    try:
        fd = dbapi_conn.pgconn.socket
        readable, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError, AttributeError, dbapi_conn.Error):
        return True  # no usable socket
    return bool(readable)


def get_engine(settings: ServiceSettings) -> Engine:
    url = settings.resolved_database_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            if url.startswith("sqlite:///"):
                from pathlib import Path

                Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            engine = _engines[url] = make_engine(url)
        return engine


def dispose_engines(close: bool = False) -> None:
    """Drop pooled connections (call in each forked process: sockets must not be shared)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=close)
        _engines.clear()
        _factories.clear()


def session_factory(settings: ServiceSettings, *, autocommit: bool = False) -> sessionmaker[Session]:
    """Sessions on the process's engine. `autocommit`: its connections run each statement as its own
    transaction (each sees what is committed; no BEGIN / COMMIT round trips), for reads and for
    writes that are one statement."""
    key = (settings.resolved_database_url, autocommit)
    factory = _factories.get(key)
    if factory is None:
        engine = get_engine(settings)
        bind = engine.execution_options(isolation_level="AUTOCOMMIT") if autocommit else engine
        with _lock:
            factory = _factories.setdefault(key, sessionmaker(bind, expire_on_commit=False))
    return factory


@contextmanager
def session_scope(settings: ServiceSettings) -> Iterator[Session]:
    """A session in a transaction: committed on success, rolled back on error. No retry: for
    one-off commands on fresh connections; long-lived processes use `run_unit`."""
    with session_factory(settings)() as session, session.begin():
        yield session


LOST_CONNECTION_ATTEMPTS = 3


def run_unit(
    settings: ServiceSettings,
    work: Callable[[Session], T],
    *,
    what: str,
    read_only: bool = False,
    autocommit: bool = False,
    idempotent: bool = False,
) -> T:
    """Run `work(session)` as one unit of work and return its result: in a transaction committed
    at the end, or on an autocommit connection for a `read_only` unit and for an `autocommit` one
    (a write whose every statement stands on its own, such as one INSERT … ON CONFLICT … RETURNING
    and the reads after it; this saves the BEGIN and COMMIT round trips).

    A pooled connection the server dropped (failover, restart, `pg_terminate_backend`, an idle
    kill) is found at its first statement at the latest; the pool then discards it and every
    connection as old, and the unit runs again on a new connection, with one warning line, when
    that is safe: always for reads, and for writes whose failure came before COMMIT was sent (the
    server rolled the transaction back when the connection died). A failure during COMMIT leaves
    the outcome unknown, so it is retried only for an `idempotent` unit; so is any loss during an
    `autocommit` write, whose statements commit as they run. A unit runs at most
    LOST_CONNECTION_ATTEMPTS times: two losses in a row happen when the server drops every
    connection while a unit is already retrying on a connection killed a moment before (measured:
    rounds of `pg_terminate_backend` sweeps under load). Any other error, and a loss on the last
    attempt, surface as they are. `work` must do nothing outside the database that another run
    would repeat harmfully."""
    factory = session_factory(settings, autocommit=read_only or autocommit)
    for attempt in range(1, LOST_CONNECTION_ATTEMPTS + 1):
        committing = autocommit
        session = factory()
        try:
            result = work(session)
            if not (read_only or autocommit):
                session.flush()
                committing = True
                session.commit()
            return result
        except DBAPIError as e:
            last = attempt == LOST_CONNECTION_ATTEMPTS
            if last or not e.connection_invalidated or (committing and not idempotent):
                raise
            reason = redact_text(str(e.orig) if e.orig is not None else str(e)).splitlines()[0][:200]
            log.warning("database connection lost during %s (%s); retrying on a new connection", what, reason)
        finally:
            session.close()
    raise AssertionError("unreachable")  # the last attempt returned or raised
