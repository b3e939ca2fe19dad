"""Engine and session helpers. One engine per process; forked workers dispose the inherited one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from services.settings import ServiceSettings

_lock = threading.Lock()
_engines: dict[str, Engine] = {}


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
    # pre_ping: a dropped PostgreSQL connection is replaced transparently on checkout.
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, pool_recycle=1800)


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


def session_factory(settings: ServiceSettings) -> sessionmaker[Session]:
    return sessionmaker(get_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(settings: ServiceSettings) -> Iterator[Session]:
    """A session in a transaction: committed on success, rolled back on error."""
    with session_factory(settings)() as session, session.begin():
        yield session
