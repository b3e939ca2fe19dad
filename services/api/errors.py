"""HTTP errors of the API: one JSON shape `{"detail": ...}`; KilnErrors map to 4xx, never 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernels.errors import KilnError
from services.db.repo import IdempotencyConflict

log = logging.getLogger(__name__)


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


def forbidden(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_403_FORBIDDEN, detail)


def not_found(what: str, ident: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} {ident!r} not found")


def conflict(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_409_CONFLICT, detail)


def invalid_field(field: str, detail: str) -> RequestValidationError:
    """A 422 in FastAPI's field-level shape, for checks the schema cannot express."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("body", field), "msg": detail, "input": None}]
    )


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(IdempotencyConflict)
    async def _idempotency(_: Request, exc: IdempotencyConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code != status.HTTP_405_METHOD_NOT_ALLOWED:
            return await http_exception_handler(request, exc)
        # Starlette lists only the matched route's methods; a path served by several routes
        # (GET and POST /v1/conversions) must list all of them.
        path = request.url.path
        methods: set[str] = set()
        for route in app.routes:
            regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
            if regex is not None and route_methods and regex.match(path):
                methods |= set(route_methods)
        headers = {"Allow": ", ".join(sorted(methods))} if methods else None
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers=headers)

    @app.exception_handler(KilnError)
    async def _kiln(_: Request, exc: KilnError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


# Responses every authenticated route may give, for the OpenAPI document.
AUTH_RESPONSES: dict[int | str, dict[str, object]] = {
    401: {"description": "Missing or invalid bearer token"},
}
