"""JSON responses serialized once, straight from the response schema."""

from __future__ import annotations

from fastapi import Response
from pydantic import BaseModel


def json_response(body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """`body` as JSON. A route returning a Response skips FastAPI's response_model pass (a second
    validation of the model, run in the threadpool for sync routes); the route keeps declaring
    `response_model` for the OpenAPI document."""
    return Response(body.model_dump_json(), status_code, headers, media_type="application/json")
