"""Readying an API process before it accepts requests.

A process's first requests open its database connections and its broker connection, compile its
statements and load psycopg's type information. Under load these first requests queue behind
each other: bench/load.py at 400 req/s saw every request slower than 50 ms in the first 0.3 s of
a fresh `kiln api --workers 2`, up to 0.4 s each (1 % of a 25 s run, enough to set its p99). The
lifespan runs `warm_up` first: uvicorn accepts connections only once it returns.

Nothing here is required: a database or broker that is down at start is reported by /health, and
the process starts anyway (one warning line).
"""

from __future__ import annotations

import logging
import time

from services.db import repo
from services.db.session import session_factory
from services.redact import redact_text
from services.settings import ServiceSettings
from services.worker.dispatch import Dispatcher

log = logging.getLogger(__name__)
_NO_JOB = "job-0"  # a well-formed id no job has: the read runs and finds nothing


def warm_up(settings: ServiceSettings, dispatcher: Dispatcher) -> None:
    """Open as many database connections as the process has request threads, each with a job read
    behind it, and the dispatcher's broker connections."""
    t0 = time.perf_counter()
    connections = settings.api_threads
    steps = {"database": _open_database_connections, "broker": lambda _s, n: dispatcher.connect(n)}
    for what, step in steps.items():
        try:
            step(settings, connections)
        except Exception as e:  # whatever the driver raises; /health names the cause
            reason = (redact_text(str(e)).splitlines() or [type(e).__name__])[0][:200]
            log.warning("API warm-up: no %s connection (%s); serving anyway", what, reason)
    log.info("API warm-up: %d connections in %.2f s", connections, time.perf_counter() - t0)


def _open_database_connections(settings: ServiceSettings, count: int) -> None:
    admin = repo.Viewer(token_id=None, is_admin=True)
    # Reads and autocommit writes (a submission) run on autocommit sessions; both kinds of session
    # share the engine's pool, so these are the connections every request checks out.
    sessions = [session_factory(settings, autocommit=True)() for _ in range(count)]
    try:
        for session in sessions:  # each holds its connection: `count` distinct ones
            repo.get_job_for(session, _NO_JOB, admin)
    finally:
        for session in sessions:
            session.close()
