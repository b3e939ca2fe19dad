"""Dependencies of the routes, as `Annotated` aliases: settings, a DB session, the caller's token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from services.api.errors import forbidden, store_unavailable, unauthorized
from services.api.token_cache import Caller, TokenCache
from services.db import repo
from services.db.session import session_factory
from services.settings import ServiceSettings
from services.storage import open_store
from services.storage.base import ArtifactStore
from services.worker.dispatch import Dispatcher

_bearer = HTTPBearer(auto_error=False, description="API token from `kiln admin create-token`")


async def get_settings_dep(request: Request) -> ServiceSettings:
    return request.app.state.settings


SettingsDep = Annotated[ServiceSettings, Depends(get_settings_dep)]


def _end(session: Session, commit: bool) -> None:
    try:
        if commit:
            session.commit()
    finally:
        session.close()  # rolls back whatever is still open


async def get_session(settings: SettingsDep) -> AsyncIterator[Session]:
    """One session per request, committed when the route returns (routes that must be durable
    before they answer commit themselves). Creating it does no I/O, so it happens on the event
    loop; ending a transaction does, so that happens in the threadpool, and only when one is open
    (a route that committed leaves none: its request costs no extra thread hop)."""
    session = session_factory(settings)()
    try:
        yield session
    except BaseException:
        await run_in_threadpool(_end, session, False)
        raise
    if session.in_transaction():
        await run_in_threadpool(_end, session, True)
    else:
        session.close()


async def get_read_session(settings: SettingsDep) -> AsyncIterator[Session]:
    """A session for routes that only read. Its connection is in autocommit, so closing it is no
    I/O (nothing to commit or roll back) and happens on the event loop."""
    session = session_factory(settings, read_only=True)()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]


async def get_dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


def app_store(request: Request, settings: ServiceSettings) -> ArtifactStore:
    """The app's artifact store, opened on first use."""
    store = getattr(request.app.state, "store", None)
    if store is None:
        try:
            store = request.app.state.store = open_store(settings.resolved_store_url, settings)
        except OSError as e:  # a local store directory that cannot be created
            raise store_unavailable("open it") from e
    return store


async def get_store(request: Request, settings: SettingsDep) -> ArtifactStore:
    return app_store(request, settings)


StoreDep = Annotated[ArtifactStore, Depends(get_store)]


def lookup_token(settings: ServiceSettings, presented: str) -> Caller | None:
    """Who a presented bearer token is, from SQL (None: unknown or revoked)."""
    with session_factory(settings, read_only=True)() as session:
        row = repo.find_token(session, presented)
        return None if row is None else Caller(id=row.id, name=row.name, is_admin=row.is_admin)


async def current_token(
    request: Request,
    settings: SettingsDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    cache: TokenCache = request.app.state.token_cache
    digest = repo.hash_token(creds.credentials)
    caller = cache.get(digest)
    if caller is None:
        caller = await run_in_threadpool(lookup_token, settings, creds.credentials)
        if caller is None:
            raise unauthorized("invalid or revoked token")
        cache.put(digest, caller)
    return caller


TokenDep = Annotated[Caller, Depends(current_token)]


async def admin_token(token: TokenDep) -> Caller:
    if not token.is_admin:
        raise forbidden("this operation needs an admin token (kiln admin create-token --admin)")
    return token


AdminDep = Annotated[Caller, Depends(admin_token)]
