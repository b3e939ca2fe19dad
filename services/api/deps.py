"""Dependencies of the routes, as `Annotated` aliases: settings, dispatcher, store, the caller's token.

Routes reach SQL through `run_unit` (services/db/session.py): a unit of work that survives a dropped
pooled connection."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.api.errors import forbidden, store_unavailable, unauthorized
from services.api.token_cache import Caller, TokenCache
from services.db import repo
from services.db.session import run_unit
from services.settings import ServiceSettings
from services.storage import open_store
from services.storage.base import ArtifactStore
from services.worker.dispatch import Dispatcher

_bearer = HTTPBearer(auto_error=False, description="API token from `kiln admin create-token`")


async def get_settings_dep(request: Request) -> ServiceSettings:
    return request.app.state.settings


SettingsDep = Annotated[ServiceSettings, Depends(get_settings_dep)]


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
    row = run_unit(settings, lambda s: repo.find_token(s, presented), what="a token lookup", read_only=True)
    if row is None:
        return None
    buckets = tuple(row.source_buckets) if row.source_buckets is not None else None
    return Caller(id=row.id, name=row.name, is_admin=row.is_admin, source_buckets=buckets)


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
