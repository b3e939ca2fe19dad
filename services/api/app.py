"""The FastAPI application factory.

`create_app()` takes the process's settings object (default: `services.settings.get_settings()`).
With a broker URL the API publishes job ids to Celery (one Celery app, built with its dispatcher);
without one (the embedded default) it runs jobs in worker threads next to itself. Migrations are a
separate step (`kiln db upgrade`); `kiln api` runs them at start only for an embedded SQLite database.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Gauge

from runtime.body_limit import BodySizeLimit
from services.api.console import routes as console
from services.api.console.security import ConsoleHeaders
from services.api.errors import install_handlers
from services.api.middleware import HttpMetrics
from services.api.routes import artifacts, conversions, health, plans
from services.api.token_cache import TokenCache
from services.api.warmup import warm_up
from services.settings import ServiceSettings, get_settings
from services.worker.celery_app import make_celery
from services.worker.dispatch import CeleryDispatcher, Dispatcher


def make_dispatcher(settings: ServiceSettings) -> Dispatcher:
    if settings.broker_url:
        return CeleryDispatcher(settings, make_celery(settings))
    from services.worker.embedded import EmbeddedWorker

    return EmbeddedWorker(settings, threads=settings.embedded_workers)


def create_app(settings: ServiceSettings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Sync routes and DB calls share this many threads per process. A handful keeps the CPU busy
        # (each call waits on PostgreSQL for a fraction of its time); anyio's default of 40 made the
        # threads fight over the GIL under load: 150 vs 200 req/s and 5x the median latency
        # measured with bench/load.py on 2 cores.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        d = dispatcher or make_dispatcher(settings)
        start = getattr(d, "start", None)
        if start is not None:
            start()
        await anyio.to_thread.run_sync(warm_up, settings, d)
        app.state.dispatcher = d
        try:
            yield
        finally:
            d.close()
            app.state.health_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="Kiln",
        version="1",
        description="Convert LLM checkpoints once into kernel-ready artifacts.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.token_cache = TokenCache(settings.token_cache_s)
    app.state.registry = registry = CollectorRegistry()
    app.state.jobs_gauge = Gauge("kiln_jobs", "Conversion jobs by status", ["status"], registry=registry)
    # One thread per /health check (db, broker, store) plus the optional token check.
    app.state.health_pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-health")
    app.include_router(conversions.router)
    app.include_router(artifacts.router)
    app.include_router(plans.router)
    app.include_router(health.router)
    app.include_router(console.pages)
    app.include_router(console.fragments)
    app.mount("/console/static", StaticFiles(directory=console.STATIC_DIR), name="console-static")
    install_handlers(app)
    # Outermost last: metrics see every response, the size limit runs before routing.
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_request_bytes,
        body_timeout_s=settings.request_body_timeout_s,
        body_idle_timeout_s=settings.request_body_idle_timeout_s,
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
            expose_headers=["Location"],
        )
    app.add_middleware(ConsoleHeaders)
    app.add_middleware(HttpMetrics, registry=registry)
    return app
