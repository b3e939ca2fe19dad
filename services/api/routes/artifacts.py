"""/v1/artifacts: find committed artifacts, read one (manifest + presigned URLs), delete (admin)."""

from __future__ import annotations

import logging
from typing import Annotated

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import APIRouter, HTTPException, Path, Query, Response, status
from sqlalchemy.orm import Session

from services.api import schemas
from services.api.deps import AdminDep, SettingsDep, StoreDep, TokenDep
from services.api.errors import AUTH_RESPONSES, not_found, store_unavailable
from services.api.responses import json_response
from services.db import repo
from services.db.models import Artifact
from services.db.session import run_unit
from services.redact import redact_text
from services.storage.errors import NotFoundError

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"], responses=AUTH_RESPONSES)

ArtifactId = Annotated[str, Path(max_length=128, pattern=schemas.ID_PATTERN)]
# An unreachable, failing or refusing store (S3 connection/HTTP errors; local filesystem errors).
STORE_FAULTS = (BotoCoreError, ClientError, OSError)
STORE_DOWN = {503: {"model": schemas.Problem, "description": "The artifact store is unavailable"}}


def _store_fault(artifact_id: str, action: str, e: Exception) -> HTTPException:
    log.warning("artifact %s: store unavailable (%s: %s)", artifact_id, type(e).__name__, redact_text(str(e)))
    return store_unavailable(action)


def artifact_files(a: Artifact) -> list[schemas.ArtifactFile]:
    return [schemas.ArtifactFile(name=f.name, size=f.size, sha256=f.sha256, rank=f.rank) for f in a.files]


def _summary(a: Artifact) -> schemas.ArtifactSummary:
    return schemas.ArtifactSummary(
        id=a.id,
        model=a.model,
        architecture=a.architecture,
        source_uri=a.source_uri,
        source_digest=a.source_digest,
        source_format=a.source_format,
        target=a.target,
        tp=a.tp,
        method=a.method,
        uri=a.uri,
        size_bytes=a.size_bytes,
        job_id=a.job_id,
        created_at=repo.as_aware(a.created_at),  # type: ignore[arg-type]
    )


@router.get("", response_model=schemas.ArtifactPage)
def list_artifacts(
    settings: SettingsDep,
    _: TokenDep,
    model: Annotated[str | None, Query(max_length=300, pattern=schemas.PRINTABLE_PATTERN)] = None,
    source_digest: Annotated[str | None, Query(max_length=64, pattern=r"^[0-9a-f]+$")] = None,
    target: schemas.TargetName | None = None,
    tp: Annotated[int | None, Query(ge=1, le=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: Annotated[str | None, Query(max_length=128, pattern=schemas.ID_PATTERN)] = None,
) -> Response:
    rows, nxt = run_unit(
        settings,
        lambda session: repo.list_artifacts(
            session,
            limit=min(limit, settings.api_page_size_max),
            cursor=cursor,
            model=model,
            source_digest=source_digest,
            target=target,
            tp=tp,
        ),
        what="an artifact listing",
        read_only=True,
    )
    return json_response(schemas.ArtifactPage(items=[_summary(a) for a in rows], next_cursor=nxt))


@router.get(
    "/{artifact_id}",
    response_model=schemas.ArtifactDetail,
    responses={404: {"model": schemas.Problem}, **STORE_DOWN},
)
def get_artifact(artifact_id: ArtifactId, settings: SettingsDep, store: StoreDep, _: TokenDep) -> Response:
    def read(session: Session) -> tuple[schemas.ArtifactSummary, dict, list[schemas.ArtifactFile]] | None:
        a = repo.get_artifact(session, artifact_id)
        if a is None:
            return None
        return _summary(a), a.manifest, artifact_files(a)

    found = run_unit(settings, read, what="an artifact read", read_only=True)
    if found is None:
        raise not_found("artifact", artifact_id)
    summary, manifest, files = found
    try:
        urls = store.presigned_urls(artifact_id)
    except NotFoundError:
        log.warning("artifact %s is in SQL but not in the store", artifact_id)
        urls = {}
    except STORE_FAULTS as e:
        raise _store_fault(artifact_id, "sign its download URLs", e) from e
    detail = schemas.ArtifactDetail(
        **summary.model_dump(),
        manifest=manifest,
        files=files,
        urls=urls,
        urls_expire_in_s=settings.presigned_url_ttl_s,
    )
    return json_response(detail)


@router.delete(
    "/{artifact_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={403: {"model": schemas.Problem}, 404: {"model": schemas.Problem}, **STORE_DOWN},
)
def delete_artifact(artifact_id: ArtifactId, settings: SettingsDep, store: StoreDep, _: AdminDep) -> Response:
    """Remove an artifact from the store (manifest first) and the catalog. Admin only."""
    found = run_unit(
        settings, lambda s: repo.get_artifact(s, artifact_id), what="an artifact read", read_only=True
    )
    if found is None:
        raise not_found("artifact", artifact_id)
    try:
        store.delete(artifact_id)
    except NotFoundError:
        log.warning("artifact %s was already gone from the store", artifact_id)
    except STORE_FAULTS as e:
        raise _store_fault(artifact_id, "delete it", e) from e
    run_unit(
        settings,
        lambda s: repo.delete_artifact(s, artifact_id),
        what="an artifact deletion",
        idempotent=True,  # deleting a deleted row deletes nothing
    )
    return Response(status_code=status.HTTP_204_NO_CONTENT)
