"""/v1/plans: what a conversion would do — kernel per layer per target, fallbacks, rejections with
their reasons, expected artifact size — without queueing it (`kiln plan --json` over REST).

Errors are cleaned as a job's are (`services.redact.public_error`): a server-local path that is not
a readable checkpoint directory is one 404 whatever the reason, and no message names a server path
but the one submitted."""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, status

from kernels.errors import KilnError
from services.api import schemas
from services.api.deps import SettingsDep, TokenDep
from services.api.errors import AUTH_RESPONSES
from services.api.routes.conversions import check_source
from services.convert.errors import NotACheckpointError
from services.convert.library import plan_targets
from services.redact import is_local, local_source_problem, public_error, redact_text
from services.storage.errors import NotFoundError

log = logging.getLogger(__name__)
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
    check_source(body.source, settings, token)
    source = body.source
    if is_local(source) and (problem := local_source_problem(source)) is not None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, problem)
    try:
        plans = plan_targets(body, settings=settings)
    except (NotFoundError, NotACheckpointError) as e:  # no checkpoint there
        raise HTTPException(status.HTTP_404_NOT_FOUND, public_error(str(e), source)) from e
    except KilnError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, public_error(str(e), source)) from e
    except OSError as e:  # a file of the checkpoint that cannot be read
        log.warning("plan of %s: %s", source, redact_text(str(e)))
        detail = f"source {source!r}: a file of the checkpoint cannot be read ({type(e).__name__})"
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail) from e
    return schemas.PlanSet(plans=[schemas.Plan.model_validate(p.to_json()) for p in plans])
