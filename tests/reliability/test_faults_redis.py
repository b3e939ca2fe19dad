"""Redis restarted (nothing kept on disk) while jobs are queued and one is running: the SQL rows
are the source of truth, the worker's reconciler re-enqueues what the broker lost, none is lost."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reliability.faults import ThrowawayRedis, artifact_rows, submit
from tests.services.conftest import free_port, wait_for_job
from tests.services.stack import Stack

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py

TARGETS = ["cpu", "sm80", "sm90"]  # one source, a distinct artifact per job
WORKER_ENV = {
    "KILN_CONVERT_LAYER_DELAY_S": "0.2",  # ≈2 s per job: one runs while the others wait in Redis
    "KILN_RECONCILE_INTERVAL_S": "1",
    "KILN_JOB_HEARTBEAT_S": "0.5",
    "KILN_JOB_STALE_AFTER_S": "5",
}


@pytest.fixture
def own_redis(tmp_path: Path, services_env: dict[str, str]) -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis(free_port(), tmp_path)
    server.start()
    services_env["KILN_BROKER_URL"] = server.url  # the API and the worker use this one
    try:
        yield server
    finally:
        server.stop()


def test_redis_restart_with_jobs_queued_loses_none(
    own_redis: ThrowawayRedis, make_stack: Callable[..., Stack], tiny_checkpoint: Path
) -> None:
    import redis

    stack = make_stack(**WORKER_ENV)
    store = stack.store()
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-redis")
    jobs = [submit(stack, source, [t]) for t in TARGETS]
    wait_for_job(stack.api, jobs[0]["id"], until=lambda j: j["status"] == "running", timeout=60)
    client = redis.Redis.from_url(own_redis.url)
    assert client.llen(stack.settings.celery_queue) >= 1  # the others wait in the queue
    run_id = client.info("server")["run_id"]
    client.close()

    own_redis.stop()
    own_redis.start()  # --save "" and killed: the queued messages and the unacked set are gone
    fresh = redis.Redis.from_url(own_redis.url)
    # A new server process. (Its key count is no evidence: the worker reconnects at once and
    # re-creates kombu's bindings, and the reconciler may already be re-enqueueing.)
    assert fresh.info("server")["run_id"] != run_id
    fresh.close()
    jobs.append(submit(stack, source, ["sm89"]))  # the API publishes to the restarted broker

    done = [wait_for_job(stack.api, j["id"], timeout=120) for j in jobs]
    log = stack.worker.log.read_text(errors="replace")[-4000:]
    assert [d["status"] for d in done] == ["succeeded"] * len(jobs), (done, log)
    assert "re-enqueued" in log  # the reconciler, not luck, brought the lost messages back
    ids = sorted(a for d in done for a in d["artifact_ids"])
    assert len(ids) == len(set(ids)) == len(jobs)  # one artifact per job, none converted twice
    assert sorted(store.list_ids()) == ids and artifact_rows(stack) == len(ids)
    assert store.staging_keys() == []
    assert stack.api.get("/health").status_code == 200
