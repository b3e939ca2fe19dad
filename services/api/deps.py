"""Dependencies of the routes, as `Annotated` aliases: settings, a DB session, the caller's token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from services.api.errors import forbidden, store_unavailable, unauthorized
from services.db import repo
from services.db.models import ApiToken
from services.db.session import session_factory
from services.settings import ServiceSettings
from services.storage import open_store
from services.storage.base import ArtifactStore
from services.worker.dispatch import Dispatcher

_bearer = HTTPBearer(auto_error=False, description="API token from `kiln admin create-token`")


def get_settings_dep(request: Request) -> ServiceSettings:
    return request.app.state.settings


SettingsDep = Annotated[ServiceSettings, Depends(get_settings_dep)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """One transaction per request, committed when the route returns (routes that must be durable
    before they answer commit themselves)."""
    with session_factory(settings)() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


SessionDep = Annotated[Session, Depends(get_session)]


def get_dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


def get_store(request: Request, settings: SettingsDep) -> ArtifactStore:
    store = getattr(request.app.state, "store", None)
    if store is None:
        try:
            store = request.app.state.store = open_store(settings.resolved_store_url, settings)
        except OSError as e:  # a local store directory that cannot be created
            raise store_unavailable("open it") from e
    return store


StoreDep = Annotated[ArtifactStore, Depends(get_store)]


def current_token(
    session: SessionDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> ApiToken:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    token = repo.find_token(session, creds.credentials)
    if token is None:
        raise unauthorized("invalid or revoked token")
    return token


TokenDep = Annotated[ApiToken, Depends(current_token)]


def admin_token(token: TokenDep) -> ApiToken:
    if not token.is_admin:
        raise forbidden("this operation needs an admin token (kiln admin create-token --admin)")
    return token


AdminDep = Annotated[ApiToken, Depends(admin_token)]
