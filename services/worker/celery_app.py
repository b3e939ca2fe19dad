"""Building a Celery app from settings (a leaf: no other worker module is imported here).

`make_celery(settings)` is called once per process: by the worker's entry point
(services/worker/app.py, which registers the task on it) and by the API's dispatcher
(services/api/app.py). Nothing builds an app at import.

At-least-once delivery that survives a dead worker: `acks_late` + `task_reject_on_worker_lost`
(a message is acknowledged only after the task returns; a killed child puts it back), prefetch 1
(a worker holds one job at a time), a broker visibility timeout above the longest allowed job (a
message held by a dead worker comes back after it), and soft/hard time limits below that timeout.
The attempt counter in SQL bounds redeliveries (see services/worker/jobs.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import Celery

if TYPE_CHECKING:
    from services.settings import ServiceSettings

log = logging.getLogger(__name__)
TASK_NAME = "kiln.convert"
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"


def transport_options(settings: ServiceSettings) -> dict[str, Any]:
    opts: dict[str, Any] = {"visibility_timeout": settings.broker_visibility_timeout_s}
    if settings.broker_restore_interval_s is not None:
        opts["unacked_restore_interval"] = settings.broker_restore_interval_s
        opts["unacked_restore_throttle"] = 1
    return opts


def make_celery(settings: ServiceSettings) -> Celery:
    """A Celery app for the broker, queue, limits and serializers in `settings` (no task registered:
    publishing needs only the task's name, TASK_NAME)."""
    if settings.job_hard_time_limit_s >= settings.broker_visibility_timeout_s:
        log.warning(
            "KILN_BROKER_VISIBILITY_TIMEOUT_S (%d) should exceed KILN_JOB_HARD_TIME_LIMIT_S (%d), "
            "or a long job is redelivered while it still runs",
            settings.broker_visibility_timeout_s,
            settings.job_hard_time_limit_s,
        )
    celery = Celery("kiln", broker=settings.broker_url or DEFAULT_BROKER)
    celery.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=settings.celery_queue,
        task_routes={TASK_NAME: {"queue": settings.celery_queue}},
        broker_transport_options=transport_options(settings),
        task_soft_time_limit=settings.job_soft_time_limit_s,
        task_time_limit=settings.job_hard_time_limit_s,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],  # never pickle: messages carry a job id only
    )
    return celery
