"""The one Celery task: convert the job with this id (idempotent; see services/worker/jobs.py).

`register(app, settings)` binds it to the worker's Celery app (services/worker/app.py); publishers
need only its name, `celery_app.TASK_NAME`.
"""

from __future__ import annotations

import logging

from celery import Celery, Task
from celery.worker.request import Request

from services.redact import redact_text
from services.settings import ServiceSettings
from services.worker.celery_app import TASK_NAME
from services.worker.jobs import TransientJobError, record_time_limit_kill, retry_delay, run_job

log = logging.getLogger(__name__)


def register(app: Celery, settings: ServiceSettings) -> Task:
    """Register `kiln.convert` on `app`; the task runs jobs with `settings`."""

    class ConvertRequest(Request):
        """Runs in the worker's main process: a hard time-limit kill acknowledges the message, so the
        job row must say why it stopped (otherwise it would read `running` until the reconciler)."""

        def on_timeout(self, soft: bool, timeout: float) -> None:
            super().on_timeout(soft, timeout)
            if not soft and self.args:
                try:
                    record_time_limit_kill(str(self.args[0]), settings)
                except Exception as e:
                    log.warning("job %s: time-limit failure not recorded (%s)", self.args[0], e)

    @app.task(
        name=TASK_NAME,
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=None,
        Request=ConvertRequest,
    )
    def convert_job(self: Task, job_id: str) -> str:
        try:
            return run_job(job_id, task_id=self.request.id, settings=settings)
        except TransientJobError as e:
            # Same task id on the retry, so the job's claim check still matches; attempts are bounded in SQL.
            delay = retry_delay(int(self.request.retries) + 1, settings)
            log.warning("job %s: transient error, retrying in %.0f s: %s", job_id, delay, redact_text(str(e)))
            raise self.retry(countdown=delay, exc=e) from e

    return convert_job
