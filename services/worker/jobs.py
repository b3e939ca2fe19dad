"""Running one conversion job: shared by the Celery task and the embedded worker thread.

The job row is the source of truth. An attempt is counted in SQL before any work (`claim_job`), so a
job that keeps killing its worker ends `failed` after `max_attempts` instead of looping forever.
Progress is written to SQL (throttled), cancellation is read from SQL between layers, and transient
S3 / database faults surface as `TransientJobError` for the caller to retry with backoff. Conversion
is idempotent: the converter reuses an artifact whose id is already committed, and recording it in
SQL is an upsert.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from celery.exceptions import SoftTimeLimitExceeded
from pydantic import ValidationError
from sqlalchemy.orm import Session

from kernels.errors import KilnError
from services.convert.spec import ConversionSpec
from services.db import repo
from services.db.models import Job
from services.db.session import run_unit
from services.redact import is_local, local_source_problem, public_error, redact_text
from services.settings import ServiceSettings
from services.sources import source_problem
from services.storage import open_store

if TYPE_CHECKING:
    from services.convert.pipeline import ConversionResult  # annotations only: no torch at import

log = logging.getLogger(__name__)

Outcome = Literal["succeeded", "failed", "cancelled", "missing", "done", "stale", "exhausted"]


_TRANSIENT_S3_CODES = frozenset({"SlowDown", "RequestTimeout", "Throttling", "InternalError"})


class TransientJobError(Exception):
    """A fault worth retrying (S3 or database unreachable, throttled, 5xx); the attempt is counted."""


def is_transient(exc: BaseException) -> bool:
    """True for connection-level S3 / SQL / Redis faults anywhere in the exception's cause chain."""
    import botocore.exceptions as bexc
    import sqlalchemy.exc as sexc

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(
            e, bexc.HTTPClientError | bexc.EndpointConnectionError | ConnectionError | TimeoutError
        ):
            return True
        if isinstance(e, bexc.ClientError):
            err = e.response.get("Error", {})
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status >= 500 or err.get("Code") in _TRANSIENT_S3_CODES:
                return True
        if isinstance(e, sexc.OperationalError | sexc.InterfaceError) or (
            isinstance(e, sexc.DBAPIError) and e.connection_invalidated
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


class ProgressWriter:
    """Writes converter progress to the job row: on every stage change, else at most every interval."""

    def __init__(self, job_id: str, settings: ServiceSettings) -> None:
        self.job_id = job_id
        self.settings = settings
        self._last_stage = ""
        self._last_write = 0.0

    def __call__(self, p: object) -> None:
        stage = str(getattr(p, "stage", ""))
        done, total = int(getattr(p, "done", 0)), int(getattr(p, "total", 0))
        now = time.monotonic()
        if stage == self._last_stage and now - self._last_write < self.settings.progress_write_interval_s:
            return
        self._last_stage, self._last_write = stage, now
        pct = int(100 * done / total) if total > 0 else 0
        try:
            message = str(getattr(p, "message", ""))
            run_unit(
                self.settings,
                lambda s: repo.record_progress(s, self.job_id, stage=stage, progress=pct, message=message),
                what=f"job {self.job_id}'s progress",
                idempotent=True,
            )
        except SoftTimeLimitExceeded:
            raise
        except Exception as e:  # progress is advisory: a failed write must not fail the conversion
            log.warning("job %s: progress not recorded (%s)", self.job_id, e)


class JobTimeLimitExceeded(KilnError):
    """The attempt ran past KILN_JOB_SOFT_TIME_LIMIT_S (checked between layers by every worker)."""


def time_limit_message(settings: ServiceSettings) -> str:
    return (
        f"exceeded the time limit of {settings.job_soft_time_limit_s} s; "
        "raise KILN_JOB_SOFT_TIME_LIMIT_S (and the broker visibility timeout) for larger models"
    )


class CancelCheck:
    """`should_cancel` for the converter: reads the job row (called between layers), and ends the
    attempt once it has run for `job_soft_time_limit_s`: the embedded worker's threads have no
    Celery time limit, so this is their limit (under Celery the soft limit usually fires first).

    `ServiceSettings.convert_layer_delay_s` sleeps here first: a documented test/demo aid that makes a
    conversion slow enough to cancel or kill mid-flight. It is 0 in production.
    """

    def __init__(self, job_id: str, settings: ServiceSettings) -> None:
        self.job_id = job_id
        self.settings = settings
        self.deadline = time.monotonic() + settings.job_soft_time_limit_s

    def __call__(self) -> bool:
        if self.settings.convert_layer_delay_s > 0:
            time.sleep(self.settings.convert_layer_delay_s)
        if time.monotonic() > self.deadline:
            raise JobTimeLimitExceeded(time_limit_message(self.settings))
        try:
            return run_unit(
                self.settings,
                lambda s: repo.cancel_requested(s, self.job_id),
                what=f"job {self.job_id}'s cancellation flag",
                read_only=True,
            )
        except SoftTimeLimitExceeded:
            raise
        except Exception as e:
            log.warning("job %s: cancellation flag not readable (%s); continuing", self.job_id, e)
            return False


class Heartbeat:
    """Touches the job row periodically so the reconciler can tell a live job from an orphan."""

    def __init__(self, job_id: str, settings: ServiceSettings) -> None:
        self.job_id = job_id
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.job_heartbeat_s):
            try:
                run_unit(
                    self.settings,
                    lambda s: repo.heartbeat(s, self.job_id),
                    what=f"job {self.job_id}'s heartbeat",
                    idempotent=True,
                )
            except Exception as e:
                log.warning("job %s: heartbeat failed (%s)", self.job_id, e)


@dataclass(frozen=True)
class Claimed:
    """An attempt the worker claimed: its job, attempt number, the owning token's --source-buckets
    (None: not narrowed) and the conversion the row holds."""

    id: str
    attempt: int
    token_buckets: tuple[str, ...] | None
    conversion: ConversionSpec


def stored_spec(job: Job) -> ConversionSpec:
    """The job row's conversion, validated back into its one shape (rows written before any option
    existed hold `options: {}`, which validates to the defaults)."""
    return ConversionSpec.model_validate(job.spec)


def discard_stale_staging(artifact_ids: list[str], settings: ServiceSettings) -> None:
    """Remove what a killed earlier attempt staged for these artifacts (now committed, so any staging
    left for their ids is garbage: a concurrent writer of the same id finds it committed and aborts)."""
    store = open_store(settings.resolved_store_url, settings)
    for aid in artifact_ids:
        try:
            removed = store.discard_staged(aid)
            if removed:
                log.info("artifact %s: removed %d staged item(s) a dead attempt had left", aid, removed)
        except Exception as e:
            log.warning("artifact %s: stale staging not removed (%s)", aid, e)


def run_job(job_id: str, *, settings: ServiceSettings, task_id: str | None = None) -> Outcome:
    """Run (or skip) one attempt of a job. Raises TransientJobError when a retry should follow,
    including when the database is lost while the job is claimed or ended (the retry's claim
    resumes it; the attempts bound holds)."""
    try:
        return _run_attempt(job_id, settings, task_id)
    except TransientJobError:
        raise
    except Exception as e:
        if is_transient(e):
            raise TransientJobError(redact_text(str(e))) from e
        raise


def _claim(job_id: str, settings: ServiceSettings, task_id: str | None) -> tuple[str, Claimed | str | None]:
    """Claim the job for this attempt: (outcome, the claimed attempt | why its row cannot run | None)."""

    def claim(s: Session) -> tuple[str, Claimed | str | None]:
        c = repo.claim_job(s, job_id, task_id)
        if c.outcome != "run" or c.job is None:
            return c.outcome, None
        j = c.job
        owner = repo.get_token(s, j.token_id) if j.token_id is not None else None
        buckets = (
            tuple(owner.source_buckets) if owner is not None and owner.source_buckets is not None else None
        )
        try:
            conversion = stored_spec(j)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            problem = f"the job's stored request is invalid ({where}: {first['msg']}); submit it again"
            return c.outcome, problem
        return c.outcome, Claimed(j.id, j.attempts, buckets, conversion)

    # Not idempotent: a rerun after a lost COMMIT would count the attempt twice.
    return run_unit(settings, claim, what=f"job {job_id}'s claim")


def _run_attempt(job_id: str, settings: ServiceSettings, task_id: str | None) -> Outcome:
    outcome, claimed = _claim(job_id, settings, task_id)
    if claimed is None:
        log.info("job %s: not run (%s)", job_id, outcome)
        return outcome  # type: ignore[return-value]
    if isinstance(claimed, str):
        _finish(job_id, "failed", claimed, settings)
        return "failed"
    spec = claimed.conversion
    log.info("job %s: attempt %d: converting %s for %s", job_id, claimed.attempt, spec.source, spec.targets)
    problem = source_problem(spec.source, settings, claimed.token_buckets)  # the settings may have changed
    if problem is None and is_local(spec.source):
        problem = local_source_problem(spec.source)
    if problem is not None:
        _finish(job_id, "failed", problem, settings)
        return "failed"
    results = _convert(job_id, claimed, settings)
    if isinstance(results, str):
        return results  # type: ignore[return-value]
    ids = [r.artifact_id for r in results]
    discard_stale_staging(ids, settings)  # before the job reads as succeeded

    def record(s: Session) -> None:
        for r in results:
            repo.record_artifact(s, r.manifest, r.uri, job_id)
        repo.complete_job(s, job_id, ids)

    try:
        run_unit(settings, record, what=f"job {job_id}'s artifacts", idempotent=True)  # upserts
    except Exception as e:
        if is_transient(e):  # the artifacts are committed: the retry reuses them
            raise TransientJobError(str(e)) from e
        raise
    log.info("job %s: succeeded: %s", job_id, ", ".join(ids))
    return "succeeded"


def _convert(job_id: str, claimed: Claimed, settings: ServiceSettings) -> list[ConversionResult] | str:
    """Run the conversion: its results, or the outcome the job ended with ("failed", "cancelled");
    a transient error is retried later (TransientJobError)."""
    spec = claimed.conversion
    try:
        from services.convert.library import Cancelled, ConversionRequest, convert
    except ImportError as e:  # a broken install: fail the job visibly rather than leave it running
        _finish(job_id, "failed", f"internal error: conversion library unavailable ({e})", settings)
        return "failed"
    try:
        with Heartbeat(job_id, settings):
            return convert(
                ConversionRequest.from_spec(spec, out=settings.resolved_store_url),
                progress=ProgressWriter(job_id, settings),
                should_cancel=CancelCheck(job_id, settings),
                settings=settings,
            )
    except Cancelled as e:
        _finish(job_id, "cancelled", public_error(f"cancelled: {e}", spec.source), settings)
        return "cancelled"
    except (SoftTimeLimitExceeded, JobTimeLimitExceeded):
        _finish(job_id, "failed", time_limit_message(settings), settings)
        return "failed"
    except Exception as e:
        if is_transient(e):
            reason = f"transient error on attempt {claimed.attempt}: {type(e).__name__}: {e}"
            _retry_later(job_id, public_error(reason, spec.source), settings)
            raise TransientJobError(redact_text(str(e))) from e
        if isinstance(e, KilnError):
            _finish(job_id, "failed", public_error(str(e), spec.source), settings)
        else:
            log.exception("job %s: unexpected error", job_id)
            reason = f"internal error ({type(e).__name__}): {e}"
            _finish(job_id, "failed", public_error(reason, spec.source), settings)
        return "failed"


def record_time_limit_kill(job_id: str, settings: ServiceSettings) -> None:
    """The worker killed the task at its hard time limit (the message is acknowledged, no retry)."""
    _finish(
        job_id,
        "failed",
        f"killed at the hard time limit of {settings.job_hard_time_limit_s} s; raise "
        "KILN_JOB_SOFT_TIME_LIMIT_S / KILN_JOB_HARD_TIME_LIMIT_S (below the broker visibility timeout)",
        settings,
    )


def _finish(
    job_id: str, status: Literal["failed", "cancelled"], error: str, settings: ServiceSettings
) -> None:
    run_unit(
        settings,
        lambda s: repo.finish_job(s, job_id, status, error),
        what=f"job {job_id}'s end",
        idempotent=True,
    )


def _retry_later(job_id: str, error: str, settings: ServiceSettings) -> None:
    try:
        run_unit(
            settings,
            lambda s: repo.retry_later(s, job_id, error),
            what=f"job {job_id}'s retry",
            idempotent=True,
        )
    except Exception as e:  # the database itself may be the transient fault
        log.warning("job %s: could not record retry (%s)", job_id, e)


def retry_delay(attempt: int, settings: ServiceSettings) -> float:
    """Exponential backoff: base, 2×base, 4×base … capped at 5 minutes."""
    return min(300.0, settings.job_retry_backoff_s * 2 ** max(0, attempt - 1))
