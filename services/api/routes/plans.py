"""/v1/plans: what a conversion would do — kernel per layer per target, fallbacks, rejections with
their reasons, expected artifact size — without queueing it (`kiln plan --json` over REST)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from services.api import schemas
from services.api.deps import SettingsDep, TokenDep
from services.api.errors import AUTH_RESPONSES
from services.api.routes.conversions import check_source
from services.convert.errors import NotACheckpointError
from services.convert.library import plan_targets
from services.storage.errors import NotFoundError

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=AUTH_RESPONSES)


@router.post(
    "",
    response_model=schemas.PlanSet,
    responses={
        404: {"model": schemas.Problem, "description": "No checkpoint (config.json) at `source`"},
        422: {"model": schemas.Unprocessable, "description": "Invalid body, or a checkpoint it cannot plan"},
    },
)
def create_plan(body: schemas.ConversionCreate, settings: SettingsDep, token: TokenDep) -> schemas.PlanSet:
    """Plan a conversion (same body as POST /v1/conversions, nothing queued): reads the checkpoint's
    config and tensor headers only. A checkpoint or shape Kiln cannot convert is a 422 naming the
    layer and what to do — before any work is queued; no checkpoint at `source` is a 404."""
    check_source(body.source, settings)
    options = body.options
    try:
        plans = plan_targets(
            body.source,
            list(body.targets),
            tp=body.tp,
            method=body.method,
            fp8_scheme=options.fp8_scheme,
            disabled_kernels=tuple(options.disabled_kernels) or None,
            expert_parallel=options.expert_parallel,
            settings=settings,
        )
    except (NotFoundError, NotACheckpointError) as e:  # no checkpoint there; other KilnErrors: a 422
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    return schemas.PlanSet(plans=[schemas.Plan.model_validate(p.to_json()) for p in plans])
