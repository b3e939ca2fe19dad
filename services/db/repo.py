"""Repository functions: every SQL read and write the API, the worker and the CLI perform.

Functions take a Session (from `run_unit` or `session_scope`) and never commit themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Row, bindparam, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from kernels.errors import KilnError
from services.convert.spec import ConversionSpec
from services.db.models import TERMINAL_STATUSES, ApiToken, Artifact, ArtifactFile, Job, utcnow

if TYPE_CHECKING:
    from runtime.artifact.manifest import Manifest  # annotations only: `kiln admin` imports no torch

TOKEN_PREFIX = "kiln_"


class IdempotencyConflict(KilnError):
    """An Idempotency-Key was reused with a different request body."""


# --- tokens -----------------------------------------------------------------------------------


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    session: Session, name: str, *, is_admin: bool = False, source_buckets: list[str] | None = None
) -> tuple[str, ApiToken]:
    """Create a bearer token; only its sha256 is stored, the plain text is returned once.
    `source_buckets` narrows the s3:// buckets it may name (None: the deployment's list)."""
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(name=name, token_hash=hash_token(plain), is_admin=is_admin, source_buckets=source_buckets)
    session.add(row)
    session.flush()
    return plain, row


def find_token(session: Session, presented: str) -> ApiToken | None:
    digest = hash_token(presented)
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))
    # The index lookup is by digest; the final equality is still constant-time.
    if row is None or row.revoked_at is not None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return row


def count_tokens(session: Session) -> int:
    return len(session.scalars(select(ApiToken.id).where(ApiToken.revoked_at.is_(None))).all())


def get_token(session: Session, token_id: int) -> ApiToken | None:
    return session.get(ApiToken, token_id)


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


class UnknownToken(KilnError):
    """No API token has the id or name given."""


@dataclass(frozen=True)
class Revocation:
    revoked: list[ApiToken]  # revoked by this call
    already: list[ApiToken]  # matched, but revoked before


def revoke_tokens(session: Session, *, token_id: int | None = None, name: str | None = None) -> Revocation:
    """Revoke the token with this id, or every token with this name (exactly one of the two: a name
    made of digits is a name, never an id).

    Revoking is idempotent: a token revoked before is reported, not an error."""
    if (token_id is None) == (name is None):
        raise ValueError("revoke_tokens takes exactly one of token_id and name")
    if token_id is not None:
        matched = session.scalars(select(ApiToken).where(ApiToken.id == token_id)).all()
        what = f"id {token_id}"
    else:
        matched = session.scalars(select(ApiToken).where(ApiToken.name == name)).all()
        what = f"name {name!r}"
    if not matched:
        raise UnknownToken(f"no API token with {what}; `kiln admin list-tokens` shows them")
    already = [t for t in matched if t.revoked_at is not None]
    revoked = [t for t in matched if t.revoked_at is None]
    now = utcnow()
    for token in revoked:
        token.revoked_at = now
    session.flush()
    return Revocation(revoked, already)


# --- jobs -------------------------------------------------------------------------------------


def new_job_id() -> str:
    """Time-ordered id: lexicographic order is creation order (used as the pagination cursor)."""
    return f"job-{time.time_ns() // 1000:014x}{os.urandom(5).hex()}"


def request_digest(spec: ConversionSpec) -> str:
    return hashlib.sha256(json.dumps(spec.row(), sort_keys=True).encode()).hexdigest()


def owner_dedupe_key(token_id: int | None, digest: str) -> str:
    """The unique key that makes identical live requests share a job, scoped to their owner: two
    tokens submitting the same request get a job each (they may still share the artifact)."""
    owner = "-" if token_id is None else str(token_id)
    return hashlib.sha256(f"{owner}:{digest}".encode()).hexdigest()


def spec_columns(spec: ConversionSpec) -> dict[str, object]:
    """A job row's request columns: the whole spec (the worker validates it back), and its source
    copied out for `list_jobs`' filter."""
    row = spec.row()
    return {"spec": row, "source": row["source"]}


def model_name(source: str) -> str:
    return PurePosixPath(source.rstrip("/")).name or source


@dataclass(frozen=True)
class Submission:
    job: Job
    created: bool


def _existing(session: Session, digest: str, idem_key: str | None, token_id: int | None) -> Job | None:
    if idem_key is not None:
        job = session.scalar(select(Job).where(Job.idempotency_key == idem_key, Job.token_id == token_id))
        if job is not None:
            if job.request_digest != digest:
                raise IdempotencyConflict(
                    f"Idempotency-Key {idem_key!r} was used for a different request (job {job.id}); "
                    "use a new key for a new request"
                )
            return job
    return session.scalar(select(Job).where(Job.dedupe_key == owner_dedupe_key(token_id, digest)))


def submit_job(
    session: Session,
    spec: ConversionSpec,
    *,
    idempotency_key: str | None,
    token_id: int | None,
    max_attempts: int,
    task_id: str | None = None,
) -> Submission:
    """Create a queued job, or return the one this request already maps to.

    Same Idempotency-Key (per token) -> same job. An identical request from the same token while a
    job for it is queued, running or succeeded -> that job (the unique `dedupe_key` settles
    concurrent races). Another token's identical request gets its own job. The common case, a new
    job, is one `INSERT … ON CONFLICT DO NOTHING RETURNING` (no lookup first, no savepoint).
    """
    digest = request_digest(spec)
    if token_id is None and idempotency_key is not None:
        # the unique (token_id, idempotency_key) index does not cover a NULL owner
        found = _existing(session, digest, idempotency_key, token_id)
        if found is not None:
            return Submission(found, False)
    for _ in range(2):  # a conflicting job that ended (and freed its dedupe_key) meanwhile: retry
        values = {
            "id": new_job_id(),
            **spec_columns(spec),
            "request_digest": digest,
            "dedupe_key": owner_dedupe_key(token_id, digest),
            "idempotency_key": idempotency_key,
            "token_id": token_id,
            "max_attempts": max_attempts,
            "status": "queued",
            "stage": "queued",
            "task_id": task_id,
        }
        row = session.connection().execute(_insert_unless_conflicting(session), values).one_or_none()
        if row is not None:
            return Submission(_detached_job(row), True)
        found = _existing(session, digest, idempotency_key, token_id)
        if found is not None:
            return Submission(found, False)
    raise RuntimeError(f"job for {spec.source!r}: conflicting inserts kept racing; submit again")


_JOBS = Job.__table__
_INSERT_JOB: dict[str, Any] = {}  # by dialect; values travel as parameters (a fixed cache key)
_JOB_BY_ID = select(_JOBS).where(_JOBS.c.id == bindparam("job_id"))


def _insert_unless_conflicting(session: Session) -> Any:
    dialect = session.get_bind().dialect.name
    stmt = _INSERT_JOB.get(dialect)
    if stmt is None:
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        stmt = _INSERT_JOB[dialect] = insert(_JOBS).on_conflict_do_nothing().returning(*_JOBS.c)
    return stmt


def _detached_job(row: Row[Any]) -> Job:
    """A Job built from a Core row, in no session. The API's per-request reads and its submission
    insert go through Core: the ORM's bulk-insert and identity-map machinery cost as much CPU as the
    rest of a status poll (bench/load.py profile)."""
    return Job(**row._mapping)


def set_task_id(session: Session, job_id: str, task_id: str) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(task_id=task_id))


def get_job(session: Session, job_id: str) -> Job | None:
    return session.get(Job, job_id)


@dataclass(frozen=True)
class Viewer:
    """Who is asking: an admin sees every job, any other token only the jobs it submitted."""

    token_id: int
    is_admin: bool

    def sees(self, job: Job) -> bool:
        return self.is_admin or job.token_id == self.token_id


def get_job_for(session: Session, job_id: str, viewer: Viewer) -> Job | None:
    """The job, or None when it does not exist or belongs to another token (indistinguishable)."""
    row = session.connection().execute(_JOB_BY_ID, {"job_id": job_id}).one_or_none()
    job = None if row is None else _detached_job(row)
    return job if job is not None and viewer.sees(job) else None


def list_jobs(
    session: Session,
    *,
    limit: int,
    viewer: Viewer | None = None,
    cursor: str | None = None,
    status: str | None = None,
    source: str | None = None,
) -> tuple[list[Job], str | None]:
    """Newest first; `cursor` is the last id of the previous page. A non-admin `viewer` sees only
    its own jobs; no viewer means every job (internal callers)."""
    q = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if viewer is not None and not viewer.is_admin:
        q = q.where(Job.token_id == viewer.token_id)
    if cursor:
        q = q.where(Job.id < cursor)
    if status:
        q = q.where(Job.status == status)
    if source:
        q = q.where(Job.source == source)
    rows = list(session.scalars(q))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1].id if more and rows else None)


def request_cancel(session: Session, job_id: str, viewer: Viewer | None = None) -> Job | None:
    """Queued jobs are cancelled at once; running ones stop at the next layer boundary. None when
    the job does not exist or another token owns it (a non-admin `viewer` cancels only its own)."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or (viewer is not None and not viewer.sees(job)):
        return None
    if job.status in TERMINAL_STATUSES:
        return job
    job.cancel_requested = True
    if job.status == "queued":
        _finish(job, "cancelled", "cancelled before it started")
    return job


def _finish(job: Job, status: Literal["succeeded", "failed", "cancelled"], error: str | None) -> None:
    job.status = status
    job.finished_at = utcnow()
    job.error = error if status != "succeeded" else None
    if status == "succeeded":
        job.progress = 100
        job.stage = "done"
    else:
        job.stage = status
        job.dedupe_key = None  # a new identical request may try again


ClaimOutcome = Literal["run", "missing", "done", "stale", "cancelled", "exhausted"]


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    job: Job | None = None


def claim_job(session: Session, job_id: str, task_id: str | None) -> Claim:
    """Start an attempt: count it in SQL, or refuse (finished, superseded, cancelled, out of attempts).

    A redelivered message keeps its task id, so it may resume a job left `running` by a dead worker;
    a message whose id is no longer the job's `task_id` (the reconciler re-enqueued it) is stale.
    """
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        return Claim("missing")
    if job.status in TERMINAL_STATUSES:
        return Claim("done", job)
    if task_id is not None and job.task_id is not None and job.task_id != task_id:
        return Claim("stale", job)
    if job.cancel_requested:
        _finish(job, "cancelled", "cancelled before it started")
        return Claim("cancelled", job)
    if job.attempts >= job.max_attempts:
        if job.status == "running":
            reason = (
                f"worker died {job.attempts} times while converting (last stage: {job.stage}); giving up. "
                "Check the worker's memory and time limits and its logs"
            )
        else:
            reason = f"failed after {job.attempts} attempts; last error: {job.error}"
        _finish(job, "failed", reason)
        return Claim("exhausted", job)
    job.attempts = job.attempts + 1
    job.status = "running"
    job.stage = "starting"
    job.started_at = job.heartbeat_at = utcnow()
    return Claim("run", job)


def record_progress(session: Session, job_id: str, *, stage: str, progress: int, message: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "running")
        .values(
            stage=stage[:64],
            progress=max(0, min(99, progress)),
            message=message[:2000],
            heartbeat_at=utcnow(),
        )
    )


def heartbeat(session: Session, job_id: str) -> None:
    session.execute(
        update(Job).where(Job.id == job_id, Job.status == "running").values(heartbeat_at=utcnow())
    )


def cancel_requested(session: Session, job_id: str) -> bool:
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def finish_job(session: Session, job_id: str, status: Literal["failed", "cancelled"], error: str) -> None:
    job = session.get(Job, job_id, with_for_update=True)
    if job is not None and job.status not in TERMINAL_STATUSES:
        _finish(job, status, error[:4000])


def retry_later(session: Session, job_id: str, error: str) -> None:
    """A transient failure: back to queued (the attempt stays counted) with the reason kept."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "running")
        .values(status="queued", stage="retrying", error=error[:4000])
    )


def record_artifact(session: Session, manifest: Manifest, uri: str, job_id: str | None) -> Artifact:
    """Insert the artifact and its files, or return the committed row (idempotent)."""
    existing = session.get(Artifact, manifest.artifact_id)
    if existing is not None:
        return existing
    row = Artifact(
        id=manifest.artifact_id,
        model=model_name(manifest.source.uri),
        architecture=manifest.architecture,
        source_uri=manifest.source.uri,
        source_digest=manifest.source.digest,
        source_format=manifest.source.format,
        target=manifest.target,
        tp=manifest.tp,
        method=manifest.method,
        uri=uri,
        size_bytes=sum(f.size for f in manifest.files),
        manifest=json.loads(manifest.to_json_bytes()),
        job_id=job_id,
        files=[ArtifactFile(name=f.name, size=f.size, sha256=f.sha256, rank=f.rank) for f in manifest.files],
    )
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        found = session.get(Artifact, manifest.artifact_id)
        if found is None:
            raise
        return found
    return row


def complete_job(session: Session, job_id: str, artifact_ids: list[str]) -> None:
    job = session.get(Job, job_id, with_for_update=True)
    if job is not None and job.status not in TERMINAL_STATUSES:
        job.artifact_ids = artifact_ids
        job.message = f"{len(artifact_ids)} artifact(s)"
        _finish(job, "succeeded", None)


def orphaned_jobs(session: Session, *, stale_after_s: float) -> list[Job]:
    """Queued jobs, and running jobs whose heartbeat stopped: candidates for re-enqueueing."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    q = select(Job).where(
        (Job.status == "queued") | ((Job.status == "running") & (Job.heartbeat_at < cutoff))
    )
    return list(session.scalars(q))


def replace_task_id(session: Session, job_id: str, old: str | None, new: str) -> bool:
    """Compare-and-set the job's task id (the reconciler's claim to re-enqueue it)."""
    cond = Job.task_id.is_(None) if old is None else Job.task_id == old
    res = session.execute(
        update(Job).where(Job.id == job_id, cond, Job.status.in_(("queued", "running"))).values(task_id=new)
    )
    return bool(res.rowcount)  # type: ignore[attr-defined]


# --- artifacts --------------------------------------------------------------------------------


def list_artifacts(
    session: Session,
    *,
    limit: int,
    cursor: str | None = None,
    model: str | None = None,
    source_digest: str | None = None,
    target: str | None = None,
    tp: int | None = None,
) -> tuple[list[Artifact], str | None]:
    """Ordered by id; `cursor` is the last id of the previous page."""
    q = select(Artifact).order_by(Artifact.id).limit(limit + 1)
    if cursor:
        q = q.where(Artifact.id > cursor)
    if model:
        q = q.where(Artifact.model == model)
    if source_digest:
        q = q.where(Artifact.source_digest == source_digest)
    if target:
        q = q.where(Artifact.target == target)
    if tp is not None:
        q = q.where(Artifact.tp == tp)
    rows = list(session.scalars(q))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1].id if more and rows else None)


def find_artifacts(
    session: Session, *, limit: int, target: str | None = None, source_contains: str | None = None
) -> list[Artifact]:
    """Newest first, with their file rows: the console's view. `source_contains` matches a piece of
    the model name or the source URI, case-insensitively."""
    q = select(Artifact).options(selectinload(Artifact.files)).order_by(Artifact.created_at.desc())
    if target:
        q = q.where(Artifact.target == target)
    if source_contains:
        escaped = source_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        pattern = f"%{escaped}%"
        q = q.where(
            or_(Artifact.model.ilike(pattern, escape="\\"), Artifact.source_uri.ilike(pattern, escape="\\"))
        )
    return list(session.scalars(q.limit(limit)))


def get_artifact(session: Session, artifact_id: str) -> Artifact | None:
    return session.get(Artifact, artifact_id)


def delete_artifact(session: Session, artifact_id: str) -> bool:
    """Remove the artifact's rows; jobs that produced it no longer dedupe new requests onto it."""
    row = session.get(Artifact, artifact_id)
    if row is None:
        return False
    for job in session.scalars(select(Job).where(Job.status == "succeeded", Job.dedupe_key.is_not(None))):
        if artifact_id in (job.artifact_ids or []):
            job.dedupe_key = None
    session.delete(row)  # its files go with it (ORM cascade; ON DELETE CASCADE in SQL)
    return True


def as_aware(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes (stored as UTC)."""
    if dt is None or dt.tzinfo is not None:
        return dt
    return dt.replace(tzinfo=UTC)
