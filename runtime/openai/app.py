"""The FastAPI app: lifespan, error handlers, body limit, API key, and the routers of
`runtime/openai/routes`.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
parameters and context overflow, 404 for an unknown model or route, 413 for a body over
`max_request_bytes` (refused before it is read).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.body_limit import BodySizeLimit
from runtime.engine import AsyncEngine
from runtime.openai.auth import ApiKeyCheck
from runtime.openai.errors import OpenAIError, engine_error
from runtime.openai.routes import generation, operations
from runtime.openai.routes import tokenizer as tokenizer_routes
from runtime.openai.serving import OpenAIServing
from runtime.request_limits import InvalidRequestError
from runtime.settings import get_settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_model_len: int | None = None,
    root: str | None = None,
    manage_engine: bool = True,
    max_request_bytes: int | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app.

    With `manage_engine`, the app's lifespan starts the AsyncEngine's thread and shuts it down at
    exit. Bodies over `max_request_bytes` (default: the setting `serve_max_request_bytes`) get 413.
    With `api_key`, every request but /health, /metrics and /version must carry
    `Authorization: Bearer <api_key>` (compared in constant time) or gets 401 (runtime/openai/auth.py).
    """
    serving = OpenAIServing(async_engine, served_model_name, tokenizer, max_model_len, root)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            async_engine.start()
        try:
            yield
        finally:
            if manage_engine:
                async_engine.shutdown()

    app = FastAPI(title="Kiln OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = serving
    settings = get_settings()
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.serve_max_request_bytes if max_request_bytes is None else max_request_bytes,
        error_body=lambda message: OpenAIError(
            413, message + " (kiln serve --max-request-bytes)", code="request_too_large"
        ).body(),
        body_timeout_s=settings.request_body_timeout_s,
        body_idle_timeout_s=settings.request_body_idle_timeout_s,
        timeout_error_body=lambda message: OpenAIError(408, message, code="request_timeout").body(),
    )
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    _add_error_handlers(app)

    for routes in (operations, tokenizer_routes, generation):
        app.include_router(routes.router)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param).response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return engine_error(exc).response()  # a 400: answered here, not by the catch-all below

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return engine_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), type_=type_).response()
