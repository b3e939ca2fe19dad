"""The embedded default (SQLite + local store + worker thread inside the API process) and the job
runner's handling of transient faults, in-process against real SQLite/PostgreSQL and a real socket."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.convert.spec import ConversionSpec
from services.db import migrate, repo
from services.db.session import session_scope
from services.settings import ServiceSettings as Settings
from services.storage.local import LocalStore
from services.worker.jobs import TransientJobError, run_job
from tests.services.conftest import create_token, free_port, make_settings, wait_for_job

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py


def test_embedded_api_converts_with_sqlite_and_a_local_store(
    tmp_path: Path, tiny_checkpoint: Path, serve_app: Callable[..., str]
) -> None:
    settings = Settings(_env_file=None, data_dir=tmp_path / "var", environment="development")  # type: ignore[call-arg]
    assert settings.resolved_database_url.startswith("sqlite:///") and not settings.broker_url
    migrate.upgrade(settings.resolved_database_url)  # what `kiln api` does at start for SQLite
    url = serve_app(create_app(settings))
    token = create_token(settings)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["checks"]["broker"].startswith("embedded worker")
        r = client.post("/v1/conversions", json={"source": str(tiny_checkpoint), "targets": ["cpu"]})
        assert r.status_code == 202
        job = wait_for_job(client, r.json()["id"], timeout=120)
        assert job["status"] == "succeeded", job
        [aid] = job["artifact_ids"]
        store = LocalStore(settings.resolved_store_url)
        assert store.list_ids() == [aid] and store.staging_entries() == []
        detail = client.get(f"/v1/artifacts/{aid}").json()
        assert detail["urls"]["manifest.json"].startswith("file://")
        # A bad source fails the job with the converter's message, not a 5xx and not a hang.
        bad = client.post("/v1/conversions", json={"source": str(tmp_path / "missing"), "targets": ["cpu"]})
        failed = wait_for_job(client, bad.json()["id"], timeout=60)
        assert failed["status"] == "failed" and "missing" in failed["error"]


def test_unreachable_store_is_a_transient_error_that_keeps_the_job(
    services_env: dict[str, str], tiny_checkpoint: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    settings = make_settings({**services_env, "KILN_S3_ENDPOINT_URL": dead, "KILN_S3_MAX_ATTEMPTS": "1"})
    with session_scope(settings) as s:
        job_id = repo.submit_job(
            s, ConversionSpec(source=str(tiny_checkpoint), targets=["cpu"]),
            idempotency_key=None, token_id=None, max_attempts=2,
        ).job.id  # fmt: skip
    with pytest.raises(TransientJobError):
        run_job(job_id, settings=settings)
    with session_scope(settings) as s:
        job = repo.get_job(s, job_id)
        assert job is not None and job.status == "queued" and job.attempts == 1
        assert job.error is not None and job.error.startswith("transient error on attempt 1")
    with pytest.raises(TransientJobError):
        run_job(job_id, settings=settings)
    assert run_job(job_id, settings=settings) == "exhausted"  # the bound holds for retries too
    with session_scope(settings) as s:
        job = repo.get_job(s, job_id)
        assert job is not None and job.status == "failed"
        assert job.error is not None and job.error.startswith(
            "failed after 2 attempts; last error: transient"
        )


def test_embedded_api_converts_a_moe_checkpoint_expert_parallel(
    tmp_path: Path, serve_app: Callable[..., str]
) -> None:
    """`options.expert_parallel` over REST: each rank file holds only its experts, as `kiln convert --ep`."""
    from devtools.builders.synthetic import QWEN3_MOE_TINY, write_checkpoint
    from runtime.artifact.manifest import Manifest

    source = write_checkpoint(tmp_path / "qwen3-moe", "gptq", dims=QWEN3_MOE_TINY, group_size=64)
    settings = Settings(_env_file=None, data_dir=tmp_path / "var", environment="development")  # type: ignore[call-arg]
    migrate.upgrade(settings.resolved_database_url)
    url = serve_app(create_app(settings))
    token = create_token(settings)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        bad = client.post(
            "/v1/conversions",
            json={"source": str(source), "targets": ["cpu"], "tp": 2, "options": {"expert_parallel": "yes"}},
        )
        assert bad.status_code == 422 and "expert_parallel" in bad.text
        r = client.post(
            "/v1/conversions",
            json={"source": str(source), "targets": ["cpu"], "tp": 2, "options": {"expert_parallel": True}},
        )
        assert r.status_code == 202, r.text
        job = wait_for_job(client, r.json()["id"], timeout=120)
        assert job["status"] == "succeeded", job
        assert job["options"]["expert_parallel"] is True
        [aid] = job["artifact_ids"]
    manifest = Manifest.parse((Path(settings.resolved_store_url) / aid / "manifest.json").read_bytes())
    assert manifest.expert_parallel and manifest.tp == 2
    spec = next(iter(manifest.expert_groups.values())).moe_spec()
    assert (spec.num_experts, spec.total_experts) == (
        QWEN3_MOE_TINY.num_experts // 2,
        QWEN3_MOE_TINY.num_experts,
    )


def test_the_embedded_worker_enforces_the_job_time_limit(
    tmp_path: Path, tiny_checkpoint: Path, serve_app: Callable[..., str]
) -> None:
    """The embedded worker's threads have no Celery time limit: KILN_JOB_SOFT_TIME_LIMIT_S is checked
    between layers, and a job past it fails saying which setting to raise, leaving nothing behind."""
    settings = Settings(
        _env_file=None, data_dir=tmp_path / "var", environment="development",
        job_soft_time_limit_s=1, convert_layer_delay_s=0.5,
    )  # type: ignore[call-arg]  # fmt: skip
    migrate.upgrade(settings.resolved_database_url)
    url = serve_app(create_app(settings))
    token = create_token(settings)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        r = client.post("/v1/conversions", json={"source": str(tiny_checkpoint), "targets": ["cpu"]})
        assert r.status_code == 202, r.text
        job = wait_for_job(client, r.json()["id"], timeout=120)
    assert job["status"] == "failed", job
    error = job["error"]
    assert error.startswith("exceeded the time limit of 1 s") and "KILN_JOB_SOFT_TIME_LIMIT_S" in error
    store = LocalStore(settings.resolved_store_url)
    assert store.list_ids() == [] and store.staging_entries() == []
