"""/health (database, broker, store; 503 naming what is down) and /metrics (Prometheus).

/health answers anyone with each component's status ("ok" / "down"); the details (why a component
is down, the embedded worker's queue) go only to a caller with a valid token, since they name
internal endpoints, buckets and prefixes. Credentials in them are redacted either way.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select, text

from services.api import schemas
from services.api.deps import SettingsDep, app_store, lookup_token
from services.db.models import Job
from services.db.session import run_unit
from services.redact import redact_text
from services.settings import ServiceSettings

router = APIRouter(tags=["operations"])
CHECK_TIMEOUT_S = 3.0
PROBE_ID = "kiln-health-probe"


def _presented_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _summary(detail: str) -> str:
    return "down" if detail.startswith("down") else "ok"


def check_components(request: Request, settings: ServiceSettings) -> tuple[bool, dict[str, str]]:
    """Each component's status ("ok", or "down: why"); only a caller presenting a valid bearer token
    gets the reasons, anyone else "ok" / "down"."""
    presented = _presented_token(request)

    def db() -> str:
        run_unit(settings, lambda s: s.execute(text("SELECT 1")), what="the health check", read_only=True)
        return "ok"

    def broker() -> str:
        ok, detail = request.app.state.dispatcher.healthy()
        if not ok:
            raise RuntimeError(detail)
        return "ok" if settings.broker_url else detail

    def store() -> str:
        app_store(request, settings).exists(PROBE_ID)  # one HEAD / stat: reachable and authorised
        return "ok"

    def authenticated() -> bool:
        if presented is None:
            return False
        return lookup_token(settings, presented) is not None

    checks: dict[str, Callable[[], str]] = {"db": db, "broker": broker, "store": store}
    results: dict[str, str] = {}
    pool = request.app.state.health_pool
    futures = {name: pool.submit(fn) for name, fn in checks.items()}
    auth = pool.submit(authenticated)
    for name, fut in futures.items():
        try:
            results[name] = redact_text(fut.result(timeout=CHECK_TIMEOUT_S))
        except cf.TimeoutError:
            results[name] = f"down: no answer within {CHECK_TIMEOUT_S:.0f} s"
        except Exception as e:
            results[name] = redact_text(f"down: {type(e).__name__}: {e}")[:300]
    ok = all(not v.startswith("down") for v in results.values())
    try:
        detailed = auth.result(timeout=CHECK_TIMEOUT_S)
    except Exception:  # the database is down or slow: nobody can be authenticated
        detailed = False
    if not detailed:
        results = {name: _summary(detail) for name, detail in results.items()}
    return ok, results


@router.get("/health", response_model=schemas.Health, responses={503: {"model": schemas.Health}})
def health(request: Request, settings: SettingsDep) -> JSONResponse:
    """Component status for anyone; with a valid bearer token, also why a component is down."""
    ok, results = check_components(request, settings)
    body = schemas.Health(status="ok" if ok else "unavailable", checks=results)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request, settings: SettingsDep) -> Response:
    gauge = request.app.state.jobs_gauge
    try:
        counts = run_unit(
            settings,
            lambda s: dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all()),
            what="the job metrics",
            read_only=True,
        )
        for st in ("queued", "running", "succeeded", "failed", "cancelled"):
            gauge.labels(st).set(counts.get(st, 0))
    except Exception:  # the scrape still answers with request metrics when the DB is down
        pass
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
