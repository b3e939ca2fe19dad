"""GET /health (503 once the engine died), /version, /metrics (Prometheus, vLLM's names), /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from runtime.metrics import CONTENT_TYPE
from runtime.openai.errors import OpenAIError
from runtime.openai.protocol import ModelCard, ModelList, VersionResponse
from runtime.openai.routes import serving_of
from runtime.version import kiln_version

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    if (reason := serving_of(request).engine.dead) is not None:
        return OpenAIError(503, reason, type_="server_error", code="engine_dead").response()
    return Response(status_code=200)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=kiln_version())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(serving_of(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    serving = serving_of(request)
    card = ModelCard(
        id=serving.model_name,
        created=serving.created,
        root=serving.root or serving.model_name,
        max_model_len=serving.max_model_len,
    )
    return ModelList(data=[card])
