"""The embedded worker: `kiln api` with no broker runs jobs in threads next to the API.

Its queue lives in memory, so at start every job the database still calls queued or running has
no live task and is queued again (the same rule the Celery reconciler applies).
"""

from __future__ import annotations

import logging
import queue
import threading

from services.db import repo
from services.db.session import run_unit
from services.redact import redact_text
from services.settings import ServiceSettings
from services.worker.jobs import TransientJobError, retry_delay, run_job

log = logging.getLogger(__name__)
_STOP = "__stop__"


class EmbeddedWorker:
    def __init__(self, settings: ServiceSettings, threads: int = 1) -> None:
        self.settings = settings
        self._queue: queue.Queue[str] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"kiln-embedded-worker-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        self._timers: list[threading.Timer] = []
        self._closed = threading.Event()

    def start(self) -> None:
        for t in self._threads:
            t.start()
        pending = run_unit(
            self.settings,
            lambda s: [j.id for j in repo.orphaned_jobs(s, stale_after_s=0)],
            what="the embedded worker's start",
            read_only=True,
        )
        for job_id in sorted(pending):
            self._queue.put(job_id)
        if pending:
            log.info("embedded worker: re-queued %d unfinished job(s)", len(pending))

    # Dispatcher protocol ---------------------------------------------------------------------
    def new_task_id(self) -> None:
        return None

    def send(self, job_id: str, task_id: str | None) -> None:
        self._queue.put(job_id)

    def connect(self, connections: int) -> None:
        return None  # an in-memory queue

    def healthy(self) -> tuple[bool, str]:
        alive = sum(t.is_alive() for t in self._threads)
        return (alive > 0, f"embedded worker: {alive} thread(s) alive, {self._queue.qsize()} queued")

    def close(self) -> None:
        self._closed.set()
        for timer in self._timers:
            timer.cancel()
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join(timeout=10)

    # ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job_id = self._queue.get()
            if job_id == _STOP:
                return
            try:
                run_job(job_id, task_id=None, settings=self.settings)
            except TransientJobError as e:
                attempt = self._attempts(job_id)
                delay = retry_delay(attempt, self.settings)
                reason = redact_text(str(e))
                log.warning("job %s: transient error, retrying in %.0f s: %s", job_id, delay, reason)
                if not self._closed.is_set():
                    timer = threading.Timer(delay, self._queue.put, args=(job_id,))
                    timer.daemon = True
                    self._timers.append(timer)
                    timer.start()
            except Exception:
                log.exception("job %s: worker error", job_id)

    def _attempts(self, job_id: str) -> int:
        try:
            job = run_unit(
                self.settings,
                lambda s: repo.get_job(s, job_id),
                what=f"job {job_id}'s attempts",
                read_only=True,
            )
            return job.attempts if job else 1
        except Exception:
            return 1
