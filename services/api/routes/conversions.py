"""/v1/conversions: submit, inspect, list and cancel conversion jobs."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response, status

from services.api import schemas
from services.api.deps import DispatcherDep, SettingsDep, TokenDep
from services.api.errors import AUTH_RESPONSES, conflict, invalid_field, not_found
from services.api.responses import json_response
from services.api.token_cache import Caller
from services.db import repo
from services.db.models import Job
from services.db.session import run_unit
from services.redact import redact_text
from services.settings import ServiceSettings
from services.sources import source_problem

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/conversions", tags=["conversions"], responses=AUTH_RESPONSES)

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="Same key (per token) -> same job",
    ),
]


JobId = Annotated[str, Path(max_length=64, pattern=schemas.ID_PATTERN)]


def to_schema(job: Job) -> schemas.Job:
    return schemas.Job(
        id=job.id,
        status=job.status,  # type: ignore[arg-type]
        stage=job.stage,
        progress=job.progress,
        message=job.message,
        error=job.error,
        attempts=job.attempts,
        max_attempts=job.max_attempts,
        cancel_requested=job.cancel_requested,
        source=job.spec["source"],
        targets=list(job.spec["targets"]),
        method=job.spec["method"],
        tp=job.spec["tp"],
        options=dict(job.spec["options"]),
        artifact_ids=list(job.artifact_ids or []),
        created_at=repo.as_aware(job.created_at),  # type: ignore[arg-type]
        updated_at=repo.as_aware(job.updated_at),  # type: ignore[arg-type]
        started_at=repo.as_aware(job.started_at),
        finished_at=repo.as_aware(job.finished_at),
    )


def check_source(source: str, settings: ServiceSettings, token: Caller) -> None:
    """A 422 naming `source` when this caller may not read it (services/sources.py)."""
    if (problem := source_problem(source, settings, token.source_buckets)) is not None:
        raise invalid_field("source", problem)


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=schemas.Job,
    responses={409: {"model": schemas.Problem, "description": "Idempotency-Key reused for another request"}},
)
def submit(
    body: schemas.ConversionCreate,
    settings: SettingsDep,
    token: TokenDep,
    dispatcher: DispatcherDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """Queue a conversion; returns the job (the caller's existing one for a repeated Idempotency-Key
    or an identical request while that job is live or succeeded)."""
    check_source(body.source, settings, token)
    task_id = dispatcher.new_task_id()
    sub = run_unit(
        settings,
        lambda session: repo.submit_job(
            session,
            body,
            idempotency_key=idempotency_key,
            token_id=token.id,
            max_attempts=settings.max_job_attempts,
            task_id=task_id,
        ),
        what="a submission",
        autocommit=True,  # one INSERT … ON CONFLICT, and reads only when it conflicted
        idempotent=True,  # a rerun finds the row a lost commit may have written (its dedupe key)
    )  # the row is durable before any worker can see the id
    job = sub.job
    # Ours if created now, or by this request's own attempt whose COMMIT's answer was lost.
    if sub.created or (task_id is not None and job.task_id == task_id):
        try:
            dispatcher.send(job.id, job.task_id)
        except Exception as e:  # the reconciler publishes it once the broker is back
            reason = redact_text(str(e))
            log.warning("job %s: not published to the broker (%s); left for the reconciler", job.id, reason)
    location = {"Location": f"/v1/conversions/{job.id}"}
    return json_response(to_schema(job), status.HTTP_202_ACCEPTED, location)


def viewer(token: Caller) -> repo.Viewer:
    return repo.Viewer(token_id=token.id, is_admin=token.is_admin)


@router.get("", response_model=schemas.JobPage)
def list_conversions(
    settings: SettingsDep,
    token: TokenDep,
    status_: Annotated[schemas.JobStatus | None, Query(alias="status")] = None,
    source: Annotated[str | None, Query(max_length=2048, pattern=schemas.PRINTABLE_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: Annotated[str | None, Query(max_length=64, pattern=r"^job-[0-9a-f]+$")] = None,
) -> Response:
    """Newest first; follow `next_cursor` for more. Lists the caller's own jobs (an admin: all jobs)."""
    rows, nxt = run_unit(
        settings,
        lambda session: repo.list_jobs(
            session,
            limit=min(limit, settings.api_page_size_max),
            viewer=viewer(token),
            cursor=cursor,
            status=status_,
            source=source,
        ),
        what="a job listing",
        read_only=True,
    )
    return json_response(schemas.JobPage(items=[to_schema(j) for j in rows], next_cursor=nxt))


@router.get("/{job_id}", response_model=schemas.Job, responses={404: {"model": schemas.Problem}})
def get_conversion(job_id: JobId, settings: SettingsDep, token: TokenDep) -> Response:
    """One of the caller's jobs (an admin: any job); another token's job is 404, like a missing one."""
    job = run_unit(
        settings, lambda s: repo.get_job_for(s, job_id, viewer(token)), what="a job read", read_only=True
    )
    if job is None:
        raise not_found("conversion", job_id)
    return json_response(to_schema(job))


@router.post(
    "/{job_id}/cancel",
    response_model=schemas.Job,
    responses={404: {"model": schemas.Problem}, 409: {"model": schemas.Problem}},
)
def cancel_conversion(job_id: JobId, settings: SettingsDep, token: TokenDep) -> Response:
    """Cancel: a queued job at once, a running one at its next layer boundary. Non-admin tokens
    cancel only their own jobs (another token's job is 404)."""
    job = run_unit(
        settings,
        lambda s: repo.request_cancel(s, job_id, viewer(token)),
        what="a cancellation",
        idempotent=True,  # setting the flag twice is setting it once
    )
    if job is None:
        raise not_found("conversion", job_id)
    if job.status in ("succeeded", "failed"):
        raise conflict(f"conversion {job_id} already {job.status}; nothing to cancel")
    return json_response(to_schema(job))
