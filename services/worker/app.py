"""The Celery worker's entry point: `celery -A services.worker.app worker` (or `kiln worker`).

`worker_app()` builds the worker's Celery app once per process, on first use (Celery's `-A` looks
up this module's `app`, which resolves to it): `celery_app.make_celery` from the process settings,
with the conversion task registered. When the worker is ready, a reconciler thread starts with a
dispatcher over that same app (see services/worker/reconcile.py). Delivery guarantees are described
in services/worker/celery_app.py.
"""

from __future__ import annotations

import logging
import threading
from functools import cache

from celery import Celery
from celery.signals import worker_process_init, worker_ready, worker_shutdown

from services.db.session import dispose_engines
from services.settings import get_settings
from services.worker import tasks
from services.worker.celery_app import make_celery
from services.worker.dispatch import CeleryDispatcher
from services.worker.reconcile import reconcile_forever

log = logging.getLogger(__name__)


@cache
def worker_app() -> Celery:
    """The worker's Celery app (one per process), with `kiln.convert` registered."""
    settings = get_settings()
    app = make_celery(settings)
    tasks.register(app, settings)
    return app


def __getattr__(name: str) -> object:
    if name == "app":  # `celery -A services.worker.app`
        return worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@worker_process_init.connect
def _dispose_inherited_engine(**_: object) -> None:
    """A forked pool process must not reuse the parent's pooled database sockets."""
    dispose_engines(close=False)


_reconciler_stop = threading.Event()


@worker_ready.connect
def _start_reconciler(**_: object) -> None:
    settings = get_settings()
    if settings.reconcile_interval_s <= 0:
        return
    dispatcher = CeleryDispatcher(settings, worker_app())  # closed with the worker's app, not here
    threading.Thread(
        target=reconcile_forever,
        args=(settings, dispatcher, _reconciler_stop),
        name="kiln-reconciler",
        daemon=True,
    ).start()


@worker_shutdown.connect
def _stop_reconciler(**_: object) -> None:
    _reconciler_stop.set()
