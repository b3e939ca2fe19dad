"""Tenancy: a job belongs to the token that submitted it, on PostgreSQL and SQLite.

Non-admin tokens list, read and cancel only their own jobs (another token's job answers exactly like
a missing one); admins see and cancel every job; Idempotency-Key and identical-request dedupe are per
owner; two owners converting the same checkpoint get a job each and share one content-addressed
artifact. The API runs under uvicorn with a dispatcher that publishes nowhere, so jobs stay queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from services.api.app import create_app
from services.convert.spec import ConversionSpec
from services.db import repo
from services.db.models import Artifact
from services.db.session import session_scope
from services.settings import ServiceSettings as Settings
from services.storage.local import LocalStore
from services.worker.jobs import run_job
from tests.services.conftest import create_token


class QueueOnlyDispatcher:
    """Publishes nowhere: submitted jobs stay queued (these tests pin visibility, not conversion)."""

    def new_task_id(self) -> None:
        return None

    def send(self, job_id: str, task_id: str | None) -> None:
        return None

    def connect(self, connections: int) -> None:
        return None

    def healthy(self) -> tuple[bool, str]:
        return True, "queue-only test dispatcher"

    def close(self) -> None:
        return None


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        environment="test",
        database_url=db_url,
        data_dir=tmp_path / "var",
        broker_url="",
        source_buckets=["*"],  # placeholder buckets (s3://b/...): nothing is read from them
    )


@pytest.fixture
def clients(settings: Settings, serve_app: Callable[..., str]) -> Iterator[dict[str, httpx.Client]]:
    url = serve_app(create_app(settings, dispatcher=QueueOnlyDispatcher()))
    tokens = {
        "alice": create_token(settings, name="alice"),
        "bob": create_token(settings, name="bob"),
        "admin": create_token(settings, admin=True, name="admin"),
    }
    made = {
        who: httpx.Client(base_url=url, headers={"Authorization": f"Bearer {t}"}, timeout=30)
        for who, t in tokens.items()
    }
    yield made
    for c in made.values():
        c.close()


def body(source: str) -> dict:
    return {"source": source, "targets": ["cpu"], "method": "auto", "tp": 1}


def ids(page: httpx.Response) -> set[str]:
    assert page.status_code == 200, page.text
    return {j["id"] for j in page.json()["items"]}


def test_non_admin_tokens_see_and_cancel_only_their_own_jobs(clients: dict[str, httpx.Client]) -> None:
    alice, bob, admin = clients["alice"], clients["bob"], clients["admin"]
    a = alice.post("/v1/conversions", json=body("s3://b/alice-model")).json()["id"]
    b = bob.post("/v1/conversions", json=body("s3://b/bob-model")).json()["id"]

    assert ids(alice.get("/v1/conversions")) == {a}
    assert ids(bob.get("/v1/conversions")) == {b}
    assert ids(bob.get("/v1/conversions", params={"source": "s3://b/alice-model"})) == set()
    assert ids(admin.get("/v1/conversions")) == {a, b}

    # Another token's job is indistinguishable from a missing one: same status, same message shape.
    theirs, missing = bob.get(f"/v1/conversions/{a}"), bob.get("/v1/conversions/job-0000000000000000")
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json() == {"detail": f"conversion {a!r} not found"}
    assert bob.post(f"/v1/conversions/{a}/cancel").status_code == 404
    assert alice.get(f"/v1/conversions/{a}").json()["status"] == "queued"  # bob's cancel did nothing

    assert admin.get(f"/v1/conversions/{a}").status_code == 200
    assert alice.post(f"/v1/conversions/{a}/cancel").json()["status"] == "cancelled"
    assert admin.post(f"/v1/conversions/{b}/cancel").json()["status"] == "cancelled"
    assert bob.get(f"/v1/conversions/{b}").json()["status"] == "cancelled"


def test_identical_submissions_and_idempotency_keys_are_per_owner(clients: dict[str, httpx.Client]) -> None:
    alice, bob, admin = clients["alice"], clients["bob"], clients["admin"]
    key = {"Idempotency-Key": "same-key"}
    first = alice.post("/v1/conversions", json=body("s3://b/shared"), headers=key).json()
    assert alice.post("/v1/conversions", json=body("s3://b/shared")).json()["id"] == first["id"]

    bobs = bob.post("/v1/conversions", json=body("s3://b/shared"))
    assert bobs.status_code == 202 and bobs.json()["id"] != first["id"]  # not alice's job
    # Bob's use of the same key is his own: it maps to his identical job, never to alice's.
    again = bob.post("/v1/conversions", json=body("s3://b/shared"), headers=key)
    assert again.json()["id"] == bobs.json()["id"]
    admins = admin.post("/v1/conversions", json=body("s3://b/shared")).json()["id"]
    assert admins not in {first["id"], bobs.json()["id"]}  # an admin's submissions dedupe per admin token
    assert admin.post("/v1/conversions", json=body("s3://b/shared")).json()["id"] == admins
    assert len(ids(admin.get("/v1/conversions"))) == 3


def _submit(settings: Settings, source: str, token_id: int | None) -> str:
    with session_scope(settings) as s:
        return repo.submit_job(
            s, ConversionSpec(source=source, targets=["cpu"]),
            idempotency_key=None, token_id=token_id, max_attempts=3,
        ).job.id  # fmt: skip


def _token_id(settings: Settings, name: str) -> int:
    with session_scope(settings) as s:
        return repo.create_token(s, name)[1].id


def test_concurrent_identical_submissions_make_one_job_per_owner(settings: Settings) -> None:
    owners = [_token_id(settings, "a"), _token_id(settings, "b"), None]
    results: list[tuple[int | None, str]] = []
    barrier = threading.Barrier(9)

    def go(owner: int | None) -> None:
        barrier.wait()
        results.append((owner, _submit(settings, "s3://b/race", owner)))

    threads = [threading.Thread(target=go, args=(o,)) for o in owners for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_owner = {o: {job for owner, job in results if owner == o} for o in owners}
    assert len(results) == 9 and all(len(jobs) == 1 for jobs in by_owner.values()), by_owner
    assert len(set().union(*by_owner.values())) == 3


def test_two_owners_converting_one_source_share_one_artifact(
    settings: Settings, tiny_checkpoint: Path
) -> None:
    """The second job finds the artifact already committed: it succeeds with the same artifact id,
    the store holds one copy and the catalog one row (recorded by the first job)."""
    first = _submit(settings, str(tiny_checkpoint), _token_id(settings, "a"))
    second = _submit(settings, str(tiny_checkpoint), _token_id(settings, "b"))
    assert first != second
    assert run_job(first, settings=settings) == "succeeded"
    assert run_job(second, settings=settings) == "succeeded"
    with session_scope(settings) as s:
        a, b = repo.get_job(s, first), repo.get_job(s, second)
        assert a is not None and b is not None and a.artifact_ids == b.artifact_ids
        [aid] = a.artifact_ids
        assert s.scalar(select(func.count()).select_from(Artifact)) == 1
        row = repo.get_artifact(s, aid)
        assert row is not None and row.job_id == first
    assert LocalStore(settings.resolved_store_url).list_ids() == [aid]
