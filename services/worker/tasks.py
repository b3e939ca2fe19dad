"""The one Celery task: convert the job with this id (idempotent; see services/jobs.py)."""

from __future__ import annotations

import logging

from celery import Task

from runtime.settings import get_settings
from services.jobs import TransientJobError, retry_delay, run_job
from services.worker.app import TASK_NAME, app

log = logging.getLogger(__name__)


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def convert_job(self: Task, job_id: str) -> str:
    settings = get_settings()
    try:
        return run_job(job_id, task_id=self.request.id, settings=settings)
    except TransientJobError as e:
        # Same task id on the retry, so the job's claim check still matches; attempts are bounded in SQL.
        delay = retry_delay(int(self.request.retries) + 1, settings)
        log.warning("job %s: transient error, retrying in %.0f s: %s", job_id, delay, e)
        raise self.retry(countdown=delay, exc=e) from e
