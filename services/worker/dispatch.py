"""How the API hands a job id to a worker: a Celery message, or the embedded in-process queue."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Protocol

from services.worker.celery_app import TASK_NAME

if TYPE_CHECKING:
    from celery import Celery

    from services.settings import ServiceSettings

log = logging.getLogger(__name__)


class Dispatcher(Protocol):
    def new_task_id(self) -> str | None: ...

    def send(self, job_id: str, task_id: str | None) -> None: ...

    def connect(self, connections: int) -> None:
        """Open up to `connections` broker connections now, so that the first sends do not."""
        ...

    def healthy(self) -> tuple[bool, str]: ...

    def close(self) -> None: ...


class CeleryDispatcher:
    """Publishes `kiln.convert(job_id)` with a task id recorded in the job row beforehand.

    It publishes through the Celery app it is given (built once per process by its owner, see
    services/worker/celery_app.py); `close()` closes that app's connections."""

    def __init__(self, settings: ServiceSettings, celery: Celery) -> None:
        self.settings = settings
        self.celery = celery

    def new_task_id(self) -> str:
        return uuid.uuid4().hex

    def send(self, job_id: str, task_id: str | None) -> None:
        self.celery.send_task(TASK_NAME, args=[job_id], task_id=task_id, queue=self.settings.celery_queue)

    def connect(self, connections: int) -> None:
        """Fill the producer pool `send` draws from: connected, with the queue declared (the first
        publish on a new producer does both); and load the result backend, which the first
        `send_task` otherwise imports (≈ 15 ms)."""
        self.celery.backend  # noqa: B018 - loaded on first access
        queue = self.celery.amqp.queues[self.settings.celery_queue]
        pool = self.celery.producer_pool
        count = min(connections, pool.limit or connections)
        producers = [pool.acquire(block=True, timeout=10) for _ in range(count)]
        try:
            for producer in producers:
                producer.connection.ensure_connection(max_retries=1)
                producer.maybe_declare(queue)
        finally:
            for producer in producers:
                producer.release()

    def healthy(self) -> tuple[bool, str]:
        import redis

        try:
            client = redis.Redis.from_url(
                self.settings.broker_url, socket_timeout=2, socket_connect_timeout=2
            )
            client.ping()
            client.close()
            return True, "ok"
        except Exception as e:
            return False, f"broker unreachable: {e}"

    def close(self) -> None:
        self.celery.close()
