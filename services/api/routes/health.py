"""/health (database, broker, store; 503 naming what is down) and /metrics (Prometheus)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select, text

from services.api import schemas
from services.api.deps import SettingsDep, get_store
from services.db.models import Job
from services.db.session import session_scope

router = APIRouter(tags=["operations"])
CHECK_TIMEOUT_S = 3.0
PROBE_ID = "kiln-health-probe"


@router.get("/health", response_model=schemas.Health, responses={503: {"model": schemas.Health}})
def health(request: Request, settings: SettingsDep) -> JSONResponse:
    def db() -> str:
        with session_scope(settings) as s:
            s.execute(text("SELECT 1"))
        return "ok"

    def broker() -> str:
        ok, detail = request.app.state.dispatcher.healthy()
        if not ok:
            raise RuntimeError(detail)
        return "ok" if settings.broker_url else detail

    def store() -> str:
        get_store(request, settings).exists(PROBE_ID)  # one HEAD / stat: reachable and authorised
        return "ok"

    checks: dict[str, Callable[[], str]] = {"db": db, "broker": broker, "store": store}
    results: dict[str, str] = {}
    pool = request.app.state.health_pool
    futures = {name: pool.submit(fn) for name, fn in checks.items()}
    for name, fut in futures.items():
        try:
            results[name] = fut.result(timeout=CHECK_TIMEOUT_S)
        except cf.TimeoutError:
            results[name] = f"down: no answer within {CHECK_TIMEOUT_S:.0f} s"
        except Exception as e:
            results[name] = f"down: {type(e).__name__}: {e}"[:300]
    ok = all(not v.startswith("down") for v in results.values())
    body = schemas.Health(status="ok" if ok else "unavailable", checks=results)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request, settings: SettingsDep) -> Response:
    gauge = request.app.state.jobs_gauge
    try:
        with session_scope(settings) as s:
            counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        for st in ("queued", "running", "succeeded", "failed", "cancelled"):
            gauge.labels(st).set(counts.get(st, 0))
    except Exception:  # the scrape still answers with request metrics when the DB is down
        pass
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
