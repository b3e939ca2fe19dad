"""Repository rules on PostgreSQL: dedupe under concurrency, idempotency keys, the attempt bound."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import delete

from services.convert.spec import ConversionSpec
from services.db import repo
from services.db.models import ApiToken, Job
from services.db.session import session_scope
from services.settings import ServiceSettings as Settings


@pytest.fixture
def settings(pg_url: str) -> Iterator[Settings]:
    s = Settings(_env_file=None, database_url=pg_url)  # type: ignore[call-arg]
    yield s
    with session_scope(s) as session:
        session.execute(delete(Job))
        session.execute(delete(ApiToken))


def _submit(settings: Settings, source: str, key: str | None = None, token_id: int | None = None) -> str:
    with session_scope(settings) as s:
        sub = repo.submit_job(
            s, ConversionSpec(source=source, targets=["cpu"]),
            idempotency_key=key, token_id=token_id, max_attempts=3,
        )  # fmt: skip
        return sub.job.id


def test_identical_concurrent_submissions_make_one_job(settings: Settings) -> None:
    ids: list[str] = []
    barrier = threading.Barrier(8)

    def go() -> None:
        barrier.wait()
        ids.append(_submit(settings, "s3://b/same"))

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 8 and len(set(ids)) == 1


def test_failed_job_does_not_capture_new_identical_requests(settings: Settings) -> None:
    first = _submit(settings, "s3://b/retry-me")
    with session_scope(settings) as s:
        repo.finish_job(s, first, "failed", "boom")
    second = _submit(settings, "s3://b/retry-me")
    assert second != first


def test_idempotency_key_is_per_token_and_bound_to_the_request(settings: Settings) -> None:
    with session_scope(settings) as s:
        _, a = repo.create_token(s, "a")
        _, b = repo.create_token(s, "b")
        ta, tb = a.id, b.id
    j1 = _submit(settings, "s3://b/x", key="k", token_id=ta)
    assert _submit(settings, "s3://b/x", key="k", token_id=ta) == j1
    with pytest.raises(repo.IdempotencyConflict, match="Idempotency-Key 'k'"):
        _submit(settings, "s3://b/other", key="k", token_id=ta)
    # Another token's key space and jobs are separate: the same key and request make its own job.
    jb = _submit(settings, "s3://b/x", key="k", token_id=tb)
    assert jb != j1 and _submit(settings, "s3://b/x", token_id=tb) == jb


def test_attempts_are_bounded_and_the_reason_says_the_worker_died(settings: Settings) -> None:
    job_id = _submit(settings, "s3://b/crashy")
    for expected in (1, 2, 3):
        with session_scope(settings) as s:
            claim = repo.claim_job(s, job_id, None)
            assert claim.outcome == "run" and claim.job is not None and claim.job.attempts == expected
        # the worker dies here: nothing is recorded, the row stays `running`
    with session_scope(settings) as s:
        claim = repo.claim_job(s, job_id, None)
        assert claim.outcome == "exhausted"
    with session_scope(settings) as s:
        job = repo.get_job(s, job_id)
        assert job is not None and job.status == "failed"
        assert job.error is not None and job.error.startswith("worker died 3 times")
        assert job.dedupe_key is None


def test_superseded_task_id_is_refused(settings: Settings) -> None:
    job_id = _submit(settings, "s3://b/stale")
    with session_scope(settings) as s:
        repo.set_task_id(s, job_id, "t1")
    with session_scope(settings) as s:
        assert repo.replace_task_id(s, job_id, "t1", "t2")
        assert not repo.replace_task_id(s, job_id, "t1", "t3")  # compare-and-set: lost the race
    with session_scope(settings) as s:
        assert repo.claim_job(s, job_id, "t1").outcome == "stale"
    with session_scope(settings) as s:
        assert repo.claim_job(s, job_id, "t2").outcome == "run"


def test_token_hash_only_is_stored(settings: Settings) -> None:
    with session_scope(settings) as s:
        plain, row = repo.create_token(s, "t")
        assert row.token_hash == repo.hash_token(plain) and plain not in row.token_hash
    with session_scope(settings) as s:
        assert repo.find_token(s, plain) is not None
        assert repo.find_token(s, plain + "x") is None
