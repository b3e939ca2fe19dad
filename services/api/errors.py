"""HTTP errors of the API: one JSON shape `{"detail": ...}`; KilnErrors map to 4xx, never 500."""

from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernels.errors import KilnError
from services.db.repo import IdempotencyConflict
from services.redact import redact_text

log = logging.getLogger(__name__)


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


def forbidden(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_403_FORBIDDEN, detail)


def not_found(what: str, ident: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} {ident!r} not found")


def conflict(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_409_CONFLICT, detail)


STORE_RETRY_AFTER_S = 10
DB_RETRY_AFTER_S = 5


def store_unavailable(action: str) -> HTTPException:
    """503 for an artifact store that cannot be reached; the cause is logged, not shown."""
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE,
        f"the artifact store is unavailable, so the API cannot {action}; try again later",
        headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
    )


_SURROGATES = re.compile("[\ud800-\udfff]")


def json_safe(value: object) -> object:
    """`value` (already JSON-encodable) made strictly JSON-compliant for echoing request data back:
    NaN/Infinity become the strings "NaN"/"Infinity"/"-Infinity", lone surrogates become U+FFFD."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return _SURROGATES.sub("\ufffd", value)
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    return value


def invalid_field(field: str, detail: str) -> RequestValidationError:
    """A 422 in FastAPI's field-level shape, for checks the schema cannot express."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("body", field), "msg": detail, "input": None}]
    )


def allowed_methods(app: FastAPI, path: str) -> set[str]:
    """Methods the OpenAPI document declares for the templates matching `path`."""
    table = getattr(app.state, "allow_table", None)
    if table is None:
        table = app.state.allow_table = [
            (re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$"), ops)
            for template, ops in app.openapi()["paths"].items()
        ]
    methods: set[str] = set()
    for regex, ops in table:
        if regex.match(path):
            methods |= {m.upper() for m in ops if m != "parameters"}
    return methods


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(IdempotencyConflict)
    async def _idempotency(_: Request, exc: IdempotencyConflict) -> JSONResponse:
        return JSONResponse({"detail": json_safe(str(exc))}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == status.HTTP_400_BAD_REQUEST and exc.__cause__ is not None:
            # FastAPI's answer to a body it could not decode (e.g. not UTF-8): a 400 outside the
            # documented responses; an undecodable body is as invalid as malformed JSON, a 422.
            error = {"type": "json_invalid", "loc": ["body"], "input": None,
                     "msg": "the request body is not JSON text in UTF-8"}  # fmt: skip
            return JSONResponse({"detail": [error]}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
        if exc.status_code != status.HTTP_405_METHOD_NOT_ALLOWED:
            return await http_exception_handler(request, exc)
        # Starlette lists only the matched route's methods; a path served by several routes
        # (GET and POST /v1/conversions) must list all of them.
        methods = allowed_methods(app, request.url.path)
        headers = {"Allow": ", ".join(sorted(methods))} if methods else None
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each error's `input`, and JSON cannot carry NaN, Infinity
        # or a lone surrogate: encoding them failed with a 500 and a dropped connection.
        return JSONResponse(
            {"detail": json_safe(jsonable_encoder(exc.errors()))},
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _db_down(_: Request, exc: DBAPIError) -> JSONResponse:
        # Connection-level faults that outlived run_unit's retry: the database is down or
        # unreachable. The cause is logged, not shown (it names hosts and databases).
        log.error("database unavailable: %s", redact_text(str(exc.orig if exc.orig is not None else exc)))
        return JSONResponse(
            {"detail": "the database is unavailable; try again later"},
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": str(DB_RETRY_AFTER_S)},
        )

    @app.exception_handler(KilnError)
    async def _kiln(_: Request, exc: KilnError) -> JSONResponse:
        body = {"detail": json_safe(str(exc))}
        return JSONResponse(body, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


# Responses every authenticated route may give, for the OpenAPI document.
AUTH_RESPONSES: dict[int | str, dict[str, object]] = {
    401: {"description": "Missing or invalid bearer token"},
}
