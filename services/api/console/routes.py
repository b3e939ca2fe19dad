"""/console: the pages (shells without data, open to anyone) and the HTML fragments the console's
script fetches into them (bearer token in the Authorization header, the API's tenancy). Every
user-supplied string reaches the page through Jinja2's autoescaping."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session

from kernels.targets import Target
from runtime.artifact.manifest import MANIFEST_NAME, Manifest
from services.api import schemas
from services.api.console import views
from services.api.deps import SettingsDep, StoreDep, TokenDep
from services.api.routes.artifacts import STORE_FAULTS, ArtifactId, artifact_files
from services.api.routes.conversions import JobId, viewer
from services.api.routes.health import check_components
from services.api.routes.plans import create_plan
from services.api.token_cache import Caller
from services.convert.choices import FP8_SCHEMES, METHODS
from services.db import repo
from services.db.models import Artifact, Job
from services.db.session import run_unit
from services.redact import redact_text
from services.settings import ServiceSettings
from services.storage.errors import NotFoundError

log = logging.getLogger(__name__)
T = TypeVar("T")
HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["bytes"] = views.human_bytes
templates.env.globals["kernel_class"] = views.kernel_class

pages = APIRouter(prefix="/console", include_in_schema=False)
fragments = APIRouter(prefix="/console/fragments", include_in_schema=False)

JOBS_SHOWN = 100
ARTIFACTS_SHOWN = 500
JOB_STATUSES: tuple[str, ...] = get_args(schemas.JobStatus)


def _page(request: Request, name: str, title: str, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {"title": title, "page": name, **context})


def _fragment(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    response = templates.TemplateResponse(request, f"fragments/{name}", context, status_code=status_code)
    response.headers["Cache-Control"] = "no-store"
    return response


# --- pages: no data and nothing secret; the script fills them ------------------------------------


@pages.get("", response_class=HTMLResponse)
def jobs_page(request: Request) -> HTMLResponse:
    return _page(request, "jobs.html", "Conversions", statuses=JOB_STATUSES)


@pages.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: JobId) -> HTMLResponse:
    return _page(request, "job.html", f"Conversion {job_id}", job_id=job_id)


@pages.get("/artifacts", response_class=HTMLResponse)
def artifacts_page(request: Request) -> HTMLResponse:
    return _page(request, "artifacts.html", "Artifacts", targets=views.TARGET_ORDER)


@pages.get("/artifacts/{artifact_id}", response_class=HTMLResponse)
def artifact_page(request: Request, artifact_id: ArtifactId) -> HTMLResponse:
    return _page(request, "artifact.html", f"Artifact {artifact_id}", artifact_id=artifact_id)


@pages.get("/new", response_class=HTMLResponse)
def new_page(request: Request) -> HTMLResponse:
    return _page(
        request, "new.html", "New conversion",
        targets=views.TARGET_ORDER, methods=METHODS, fp8_schemes=FP8_SCHEMES, default_target=Target.CPU.value,
    )  # fmt: skip


# --- fragments -----------------------------------------------------------------------------------


@fragments.get("/health", response_class=HTMLResponse)
def health_fragment(request: Request, settings: SettingsDep) -> HTMLResponse:
    """Anyone: each component ok / down; with a valid token, why it is down."""
    ok, checks = check_components(request, settings)
    return _fragment(request, "health.html", ok=ok, checks=checks)


@fragments.get("/jobs", response_class=HTMLResponse)
def jobs_fragment(
    request: Request,
    settings: SettingsDep,
    token: TokenDep,
    status: Annotated[schemas.JobStatus | None, Query()] = None,
) -> HTMLResponse:
    rows, _ = run_unit(
        settings,
        lambda s: repo.list_jobs(s, limit=JOBS_SHOWN, viewer=viewer(token), status=status),
        what="the console's job list",
        read_only=True,
    )
    return _fragment(request, "jobs.html", jobs=rows, live=views.LIVE_STATUSES)


def _job_artifacts(session: Session, job: Job) -> list[tuple[str, int, dict[str, Any]]]:
    found = [repo.get_artifact(session, aid) for aid in job.artifact_ids or []]
    return [(a.id, a.size_bytes, a.manifest) for a in found if a is not None]


def _remember(cache: dict[str, T], limit: int, key: str, compute: Callable[[], T]) -> T:
    """`cache[key]`, computed on first use; a full cache starts over (bounded memory)."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= limit:
            cache.clear()
        found = cache[key] = compute()
    return found


_job_plans: dict[str, tuple[views.PlanGrid, str | None]] = {}
JOB_PLANS_KEPT = 256


def _planned_grid(job: Job, settings: ServiceSettings, token: Caller) -> tuple[views.PlanGrid, str | None]:
    """The plan of a job without artifacts yet, computed once per job (its page polls every few
    seconds; planning reads the checkpoint's headers, possibly from S3)."""

    def plan() -> tuple[views.PlanGrid, str | None]:
        try:
            body = schemas.ConversionCreate.model_validate(job.spec)
            plans = create_plan(body, settings, token).plans
            return views.grid_from_plans(p.model_dump() for p in plans), None
        except HTTPException as e:
            return views.PlanGrid(), str(e.detail)

    return _remember(_job_plans, JOB_PLANS_KEPT, job.id, plan)


@fragments.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_fragment(request: Request, job_id: JobId, settings: SettingsDep, token: TokenDep) -> HTMLResponse:
    """The job, and its plan grid: from its artifacts' manifests (with verification) once it has
    them, else planned now from its request."""

    def read(s: Session) -> tuple[Job, list[tuple[str, int, dict[str, Any]]]] | None:
        job = repo.get_job_for(s, job_id, viewer(token))
        return None if job is None else (job, _job_artifacts(s, job))

    found = run_unit(settings, read, what="the console's job read", read_only=True)
    if found is None:
        return _fragment(request, "missing.html", 404, what="conversion", id=job_id)
    job, artifacts = found
    if artifacts:
        grid, planned, plan_error = views.grid_from_manifests(artifacts), False, None
    else:
        planned = True
        grid, plan_error = _planned_grid(job, settings, token)
    return _fragment(
        request, "job.html", job=job, grid=grid, planned=planned, plan_error=plan_error,
        live=job.status in views.LIVE_STATUSES,
    )  # fmt: skip


@fragments.post("/plan", response_class=HTMLResponse)
def plan_fragment(
    request: Request, body: schemas.ConversionCreate, settings: SettingsDep, token: TokenDep
) -> HTMLResponse:
    """The new-conversion form's preview: POST /v1/plans, drawn as a grid (or its error)."""
    try:
        plans = create_plan(body, settings, token).plans
    except HTTPException as e:
        return _fragment(request, "plan_error.html", e.status_code, detail=str(e.detail))
    return _fragment(request, "plan.html", grid=views.grid_from_plans(p.model_dump() for p in plans))


_checksums: dict[str, str] = {}
CHECKSUMS_KEPT = 10_000


def manifest_sha256(artifact_id: str, manifest: dict[str, Any]) -> str:
    """sha256 of the artifact's manifest.json as the store holds it (its bytes are a function of the
    manifest; artifacts never change, so it is computed once per id)."""
    return _remember(
        _checksums,
        CHECKSUMS_KEPT,
        artifact_id,
        lambda: hashlib.sha256(Manifest.model_validate(manifest).to_json_bytes()).hexdigest(),
    )


def _artifact_view(a: Artifact) -> views.ArtifactView:
    checksum = manifest_sha256(a.id, a.manifest)
    return views.ArtifactView(
        id=a.id, model=a.model, source_uri=a.source_uri, source_format=a.source_format, target=a.target,
        method=a.method, tp=a.tp, expert_parallel=bool(a.manifest.get("expert_parallel")),
        size_bytes=a.size_bytes, checksum=checksum, uri=a.uri, job_id=a.job_id,
    )  # fmt: skip


@fragments.get("/artifacts", response_class=HTMLResponse)
def artifacts_fragment(
    request: Request,
    settings: SettingsDep,
    _: TokenDep,
    target: schemas.TargetName | None = None,
    source: Annotated[str | None, Query(max_length=2048, pattern=schemas.PRINTABLE_PATTERN)] = None,
) -> HTMLResponse:
    """The artifact matrix (model × target), filtered by target and by a piece of the source."""

    def read(s: Session) -> list[views.ArtifactView]:
        rows = repo.find_artifacts(
            s, limit=ARTIFACTS_SHOWN, target=target.value if target else None, source_contains=source
        )
        return [_artifact_view(a) for a in rows]

    items = run_unit(settings, read, what="the console's artifact list", read_only=True)
    return _fragment(request, "artifacts.html", matrix=views.artifact_matrix(items), count=len(items))


@fragments.get("/artifacts/{artifact_id}", response_class=HTMLResponse)
def artifact_fragment(
    request: Request, artifact_id: ArtifactId, settings: SettingsDep, store: StoreDep, _: TokenDep
) -> HTMLResponse:
    def read(s: Session) -> tuple[views.ArtifactView, dict[str, Any], list[Any]] | None:
        a = repo.get_artifact(s, artifact_id)
        if a is None:
            return None
        return _artifact_view(a), a.manifest, artifact_files(a)

    found = run_unit(settings, read, what="the console's artifact read", read_only=True)
    if found is None:
        return _fragment(request, "missing.html", 404, what="artifact", id=artifact_id)
    artifact, manifest, files = found
    urls: dict[str, str] = {}
    store_problem = None
    try:
        urls = store.presigned_urls(artifact_id)
    except NotFoundError:
        store_problem = "the artifact is in the catalog but not in the store"
    except STORE_FAULTS as e:
        log.warning("artifact %s: store unavailable (%s)", artifact_id, redact_text(str(e)))
        store_problem = "the artifact store is unavailable: no download links"
    grid = views.grid_from_manifests([(artifact.id, artifact.size_bytes, manifest)])
    return _fragment(
        request, "artifact.html", artifact=artifact, manifest=manifest, files=files, urls=urls,
        urls_expire_in_s=settings.presigned_url_ttl_s, store_problem=store_problem, grid=grid,
        manifest_name=MANIFEST_NAME,
    )  # fmt: skip
