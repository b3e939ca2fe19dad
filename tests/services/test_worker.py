"""The worker over the real stack: REST -> PostgreSQL -> Redis -> Celery prefork process -> S3.

Conversions use the synthetic tiny bf16 Llama (devtools/builders/synthetic.py) for speed; tests that
must interrupt a conversion mid-flight slow it with `KILN_CONVERT_LAYER_DELAY_S` (a documented
sleep between layers in the worker's cancellation check).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, update

from runtime.artifact.manifest import Manifest
from services.convert.spec import ConversionSpec
from services.db.models import Artifact, ArtifactFile, Job
from services.db.session import session_scope
from tests.services.conftest import TEST_VISIBILITY_TIMEOUT_S, WorkerProcess, wait_for_job
from tests.services.stack import Stack, sha256_bytes

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py

SLOW_LAYER_S = "0.3"  # tiny model: 8 fused layers per target -> ≈3 s per conversion


def _submit(stack: Stack, source: str, targets: list[str], key: str | None = None) -> dict:
    headers = {"Idempotency-Key": key} if key else {}
    r = stack.api.post("/v1/conversions", json={"source": source, "targets": targets}, headers=headers)
    assert r.status_code == 202, r.text
    return r.json()


def _sql_counts(stack: Stack) -> tuple[int, int]:
    with session_scope(stack.settings) as s:
        return (
            s.scalar(select(func.count()).select_from(Artifact)) or 0,
            s.scalar(select(func.count()).select_from(ArtifactFile)) or 0,
        )


def test_end_to_end_rest_to_s3_and_sql(
    make_stack: Callable[..., Stack], tiny_checkpoint: Path, tmp_path: Path
) -> None:
    stack = make_stack()
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-llama")
    job = _submit(stack, source, ["cpu", "sm80"], key="e2e-1")
    done = wait_for_job(stack.api, job["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"] == 100 and done["attempts"] == 1 and len(done["artifact_ids"]) == 2

    # Rows in PostgreSQL, objects in S3, nothing staged.
    store = stack.store()
    assert sorted(store.list_ids()) == sorted(done["artifact_ids"])
    assert store.staging_keys() == []
    n_artifacts, n_files = _sql_counts(stack)
    manifests = [Manifest.parse(store.read_manifest(a)) for a in done["artifact_ids"]]
    assert n_artifacts == 2 and n_files == sum(len(m.files) for m in manifests)
    assert {m.target for m in manifests} == {"cpu", "sm80"}

    # Catalogue lookups and presigned URLs that really serve the bytes the manifest promises.
    found = stack.api.get("/v1/artifacts", params={"model": "tiny-llama", "target": "cpu", "tp": 1}).json()
    [cpu] = found["items"]
    detail = stack.api.get(f"/v1/artifacts/{cpu['id']}").json()
    assert detail["manifest"]["artifact_id"] == cpu["id"]
    assert detail["urls_expire_in_s"] == stack.settings.presigned_url_ttl_s
    for f in detail["files"]:
        body = httpx.get(detail["urls"][f["name"]], timeout=30).content
        assert len(body) == f["size"] and sha256_bytes(body) == f["sha256"]
    digest = detail["source_digest"]
    by_digest = stack.api.get("/v1/artifacts", params={"source_digest": digest}).json()["items"]
    assert {a["id"] for a in by_digest} == set(done["artifact_ids"])

    # Same key -> same job; identical request -> same job; a narrower request reuses the artifact.
    assert _submit(stack, source, ["cpu", "sm80"], key="e2e-1")["id"] == job["id"]
    assert _submit(stack, source, ["sm80", "cpu"])["id"] == job["id"]
    only_cpu = wait_for_job(stack.api, _submit(stack, source, ["cpu"])["id"])
    assert only_cpu["status"] == "succeeded" and only_cpu["artifact_ids"] == [cpu["id"]]
    assert _sql_counts(stack)[0] == 2 and len(store.list_ids()) == 2

    # Admin deletes an artifact: gone from S3 and SQL.
    assert stack.api.delete(f"/v1/artifacts/{cpu['id']}").status_code == 403
    assert stack.admin.delete(f"/v1/artifacts/{cpu['id']}").status_code == 204
    assert stack.api.get(f"/v1/artifacts/{cpu['id']}").status_code == 404
    assert cpu["id"] not in store.list_ids()


def _wait_running(stack: Stack, job_id: str, attempt: int) -> dict:
    return wait_for_job(
        stack.api,
        job_id,
        until=lambda j: (
            (j["status"] == "running" and j["attempts"] == attempt and j["stage"] == "converting")
            or j["status"] in ("succeeded", "failed", "cancelled")
        ),
        timeout=60,
    )


def test_kill_9_mid_conversion_is_redelivered_once(
    make_stack: Callable[..., Stack], tiny_checkpoint: Path
) -> None:
    """Killed after its files were staged (the pause before commit): the redelivered attempt
    commits one artifact and removes what the dead attempt staged."""
    stack = make_stack(KILN_CONVERT_LAYER_DELAY_S=SLOW_LAYER_S)
    store = stack.store()
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-kill")
    job = _submit(stack, source, ["cpu"])
    child = stack.worker.wait_for_child()
    deadline = time.monotonic() + 60
    while not store.staging_keys():  # staged, not yet committed
        assert time.monotonic() < deadline, "the conversion never staged files"
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    assert store.list_ids() == []

    done = wait_for_job(stack.api, job["id"], timeout=90)
    assert done["status"] == "succeeded", (done, stack.worker.log.read_text()[-3000:])
    assert done["attempts"] == 2
    assert store.list_ids() == done["artifact_ids"] and len(done["artifact_ids"]) == 1
    assert store.staging_keys() == []
    assert _sql_counts(stack)[0] == 1


def test_whole_worker_killed_mid_conversion_is_redelivered_to_a_new_worker(
    make_stack: Callable[..., Stack], celery_worker: Callable[..., WorkerProcess], tiny_checkpoint: Path
) -> None:
    """The node dies: SIGKILL to the worker's main process and its pool child together (nothing acks,
    nothing cleans up). A worker started afterwards gets the job once the broker's visibility timeout
    (short here) hands the unacknowledged message out again: one artifact, nothing staged left."""
    stack = make_stack(KILN_CONVERT_LAYER_DELAY_S=SLOW_LAYER_S)
    store = stack.store()
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-node-loss")
    job = _submit(stack, source, ["cpu"])
    running = _wait_running(stack, job["id"], 1)
    assert running["status"] == "running", running
    pids = [stack.worker.proc.pid, *stack.worker.child_pids()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    stack.worker.proc.wait(timeout=10)
    assert store.list_ids() == []

    replacement = celery_worker(KILN_CONVERT_LAYER_DELAY_S=SLOW_LAYER_S)
    done = wait_for_job(stack.api, job["id"], timeout=TEST_VISIBILITY_TIMEOUT_S + 90)
    assert done["status"] == "succeeded", (done, replacement.log.read_text()[-3000:])
    assert done["attempts"] == 2
    assert store.list_ids() == done["artifact_ids"] and len(done["artifact_ids"]) == 1
    assert store.staging_keys() == []
    assert _sql_counts(stack)[0] == 1


def test_job_that_keeps_killing_its_worker_ends_failed(
    make_stack: Callable[..., Stack], tiny_checkpoint: Path
) -> None:
    stack = make_stack(KILN_CONVERT_LAYER_DELAY_S=SLOW_LAYER_S)
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-crashy")
    job = _submit(stack, source, ["cpu"])
    max_attempts = stack.settings.max_job_attempts
    for attempt in range(1, max_attempts + 1):
        running = _wait_running(stack, job["id"], attempt)
        assert running["status"] == "running", running
        os.kill(stack.worker.wait_for_child(), signal.SIGKILL)
        time.sleep(0.3)
    done = wait_for_job(stack.api, job["id"], timeout=60)
    assert done["status"] == "failed" and done["attempts"] == max_attempts
    assert done["error"].startswith(f"worker died {max_attempts} times"), done["error"]
    assert stack.store().list_ids() == [] and stack.store().staging_keys() == []


def test_cancel_a_running_conversion(make_stack: Callable[..., Stack], tiny_checkpoint: Path) -> None:
    stack = make_stack(KILN_CONVERT_LAYER_DELAY_S=SLOW_LAYER_S)
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-cancel")
    job = _submit(stack, source, ["cpu"])
    assert _wait_running(stack, job["id"], 1)["status"] == "running"
    r = stack.api.post(f"/v1/conversions/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    done = wait_for_job(stack.api, job["id"], timeout=60)
    assert done["status"] == "cancelled" and "cancelled" in done["error"]
    assert stack.store().list_ids() == [] and stack.store().staging_keys() == []
    assert stack.api.post(f"/v1/conversions/{job['id']}/cancel").status_code == 200


def test_reconciler_requeues_a_job_whose_message_is_gone(
    make_stack: Callable[..., Stack], tiny_checkpoint: Path
) -> None:
    """A queued row with no broker message (e.g. Redis restarted) is re-enqueued and converted."""
    from services.db import repo
    from services.worker.reconcile import QUEUED_GRACE_S, reconcile_once

    stack = make_stack()
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-orphan")
    with session_scope(stack.settings) as s:
        sub = repo.submit_job(
            s, ConversionSpec(source=source, targets=["cpu"]),
            idempotency_key=None, token_id=None, max_attempts=3,
        )  # fmt: skip
        sub.job.task_id = "lost-message"
        job_id = sub.job.id
    with session_scope(stack.settings) as s:  # age the row past the publish grace period
        s.execute(update(Job).where(Job.id == job_id).values(updated_at=repo.utcnow().replace(year=2000)))
    assert QUEUED_GRACE_S > 0
    assert reconcile_once(stack.settings) == [job_id]
    assert reconcile_once(stack.settings) == []  # its new message is live now (or already running)
    done = wait_for_job(stack.admin, job_id, timeout=60)  # a token-less job: only admins see it
    assert done["status"] == "succeeded" and done["attempts"] == 1
