"""The reconciler: SQL is the source of truth; re-enqueue jobs whose broker message is gone.

A queued job whose task id is in neither the Redis queue nor the unacknowledged set (Redis
restarted, or publishing failed after the row was written), and a running job whose heartbeat
stopped while its message is no longer held, get a fresh task id (compare-and-set in SQL, so two
reconcilers cannot both re-enqueue) and a new message. A superseded message that still turns up
is refused by the job's task-id check.

The reconciler publishes through the dispatcher it is given: the worker passes one over its own
Celery app; a one-off pass (`reconcile_once(settings)`) opens its own and closes it.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from functools import partial

from services.db import repo
from services.db.models import utcnow
from services.db.session import run_unit
from services.redact import redact_text
from services.settings import ServiceSettings
from services.storage import open_store
from services.worker.celery_app import make_celery
from services.worker.dispatch import CeleryDispatcher, Dispatcher

log = logging.getLogger(__name__)
UNACKED_KEY = "unacked"
QUEUED_GRACE_S = 10.0  # a row just written may not have been published yet


def live_task_ids(settings: ServiceSettings) -> set[str]:
    """Task ids of messages waiting in the queue or held (unacked) by a worker, read from Redis."""
    import redis

    client = redis.Redis.from_url(settings.broker_url, socket_timeout=5)
    ids: set[str] = set()
    try:
        raw: list[bytes] = []
        for key in client.scan_iter(match=f"{settings.celery_queue}*", count=100):
            if client.type(key) == b"list":
                raw.extend(client.lrange(key, 0, -1))  # type: ignore[arg-type]
        for value in client.hvals(UNACKED_KEY):  # type: ignore[union-attr]
            try:
                raw.append(json.dumps(json.loads(value)[0]).encode())
            except (ValueError, IndexError, TypeError):
                continue
        for item in raw:
            try:
                task_id = json.loads(item).get("headers", {}).get("id")
            except (ValueError, AttributeError):
                continue
            if task_id:
                ids.add(task_id)
    finally:
        client.close()
    return ids


def reconcile_once(settings: ServiceSettings, dispatcher: Dispatcher | None = None) -> list[str]:
    """Re-enqueue orphaned jobs through `dispatcher` (None: a Celery dispatcher of its own, closed
    before returning); returns their ids."""
    if dispatcher is None:
        own = CeleryDispatcher(settings, make_celery(settings))
        try:
            return reconcile_once(settings, own)
        finally:
            own.close()
    live = live_task_ids(settings)
    grace = utcnow() - timedelta(seconds=QUEUED_GRACE_S)
    candidates = [
        (j.id, j.task_id)
        for j in run_unit(
            settings,
            lambda s: repo.orphaned_jobs(s, stale_after_s=settings.job_stale_after_s),
            what="the reconciler's scan",
            read_only=True,
        )
        if j.task_id not in live and repo.as_aware(j.updated_at) < grace  # type: ignore[operator]
    ]
    requeued: list[str] = []
    for job_id, old in candidates:
        new = dispatcher.new_task_id()
        # Not idempotent (compare-and-set): after a lost COMMIT the next pass finds the job again.
        claimed = run_unit(
            settings,
            lambda s, job_id=job_id, old=old, new=new: repo.replace_task_id(s, job_id, old, new),
            what=f"the reconciler's claim of job {job_id}",
        )
        if not claimed:
            continue
        dispatcher.send(job_id, new)
        requeued.append(job_id)
        log.warning("reconciler: job %s had no live task (was %s); re-enqueued as %s", job_id, old, new)
    return requeued


def sweep_stale_staging(settings: ServiceSettings) -> int:
    """Remove objects staged longer ago than the hard time limit (a writer that lost the store
    mid-upload could not remove them; once the store is back, this does). Returns the count."""
    store = open_store(settings.resolved_store_url, settings)
    removed = store.sweep_staging(float(settings.job_hard_time_limit_s))
    if removed:
        limit = settings.job_hard_time_limit_s
        log.warning("reconciler: removed %d staged object(s) older than %d s", removed, limit)
    return removed


def reconcile_forever(settings: ServiceSettings, dispatcher: Dispatcher, stop: threading.Event) -> None:
    """Every `reconcile_interval_s` until `stop`: re-enqueue orphans through `dispatcher`, then sweep
    stale staging. A failed pass is logged and the next one runs."""
    steps = (partial(reconcile_once, settings, dispatcher), partial(sweep_stale_staging, settings))
    while not stop.wait(settings.reconcile_interval_s):
        for step in steps:
            try:
                step()
            except Exception as e:
                log.warning("reconciler pass failed (%s): %s", step.func.__name__, redact_text(str(e)))
