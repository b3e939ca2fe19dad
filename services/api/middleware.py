"""ASGI middleware: request metrics (the body size limit is runtime/body_limit.py)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMetrics:
    """Counts requests and observes latency per route template (not per raw path: bounded labels)."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "kiln_api_requests_total", "HTTP requests", ["method", "route", "status"], registry=registry
        )
        self.latency = Histogram(
            "kiln_api_request_seconds", "HTTP request latency", ["method", "route"], registry=registry
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", "unmatched")
            self.requests.labels(scope["method"], label, str(status)).inc()
            self.latency.labels(scope["method"], label).observe(time.perf_counter() - t0)
