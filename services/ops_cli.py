"""Service commands: `kiln api`, `kiln worker`, `kiln db upgrade|downgrade|current`, `kiln admin ...`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from services.settings import ServiceSettings

log = logging.getLogger(__name__)
console = Console(stderr=True)
db_app = typer.Typer(help="Database migrations (Alembic); run `kiln db upgrade` before starting services.")
admin_app = typer.Typer(help="Administration: API tokens, reconciliation.")


def get_settings() -> ServiceSettings:
    """The service settings, imported on first use: runtime commands (`kiln generate`, `kiln serve`)
    share this CLI and must not pay for pydantic-settings on their way to the first token."""
    from services.settings import get_settings as load

    return load()


def _is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def ensure_schema() -> None:
    """Embedded SQLite: upgrade first (one command gives a working service or a token). Otherwise
    refuse an out-of-date schema (`kiln api`, `kiln admin ...`): migrations are their own step in
    production."""
    from services.db import migrate

    settings = get_settings()
    url = settings.resolved_database_url
    if _is_sqlite(url):
        migrate.upgrade(url)
        return
    if not migrate.is_up_to_date(url):
        raise typer.BadParameter(
            f"database schema is at {migrate.current(url)!r}, code expects {migrate.head()!r}: "
            "run `kiln db upgrade` first"
        )


def ensure_bootstrap_token() -> None:
    """Embedded mode with no token yet: create an admin token and save it (0600) under data_dir."""
    from services.db import repo
    from services.db.session import session_scope

    settings = get_settings()
    with session_scope(settings) as s:
        if repo.count_tokens(s):
            return
        plain, _ = repo.create_token(s, "bootstrap-admin", is_admin=True)
    path = settings.data_dir / "admin-token"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(plain + "\n")
    console.print(f"[bold]created an admin API token[/bold]; saved to {path.resolve()}")


def startup_banner(settings: ServiceSettings, host: str, port: int) -> str:
    from services.redact import redact_url

    mode = f"celery on {redact_url(settings.broker_url)}" if settings.broker_url else "embedded worker"
    return f"kiln api on http://{host}:{port} ({mode}; store {redact_url(settings.resolved_store_url)})"


def api(
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="API processes, e.g. one per core (needs KILN_BROKER_URL: without a broker, jobs run "
            "in the one API process)",
        ),
    ] = 1,
) -> None:
    """Serve the REST API. With no KILN_BROKER_URL, jobs run in worker threads inside this process."""
    import uvicorn

    from services.api.app import create_app

    settings = get_settings()
    if workers > 1 and not settings.broker_url:
        raise typer.BadParameter(
            "several API processes need a broker (KILN_BROKER_URL): without one, jobs run inside the "
            "single API process",
            param_hint="--workers",
        )
    ensure_schema()
    if not settings.broker_url and _is_sqlite(settings.resolved_database_url):
        ensure_bootstrap_token()
    console.print(startup_banner(settings, host, port))
    if workers > 1:  # each process builds its app (and settings) from the environment
        uvicorn.run(
            "services.api.app:create_app", factory=True, workers=workers, host=host, port=port,
            log_level="info", access_log=False,
        )  # fmt: skip
    else:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="info", access_log=False)


def worker(
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Worker processes")] = 1,
    loglevel: Annotated[str, typer.Option(help="Celery log level")] = "INFO",
) -> None:
    """Run a Celery worker (prefork) consuming conversion jobs from KILN_BROKER_URL."""
    settings = get_settings()
    if not settings.broker_url:
        raise typer.BadParameter("KILN_BROKER_URL is not set: `kiln worker` needs a Redis broker")
    from services.worker.app import worker_app

    worker_app().worker_main(
        [
            "worker",
            "--pool=prefork",
            f"--concurrency={concurrency}",
            f"--loglevel={loglevel}",
            "-Q",
            settings.celery_queue,
            "--without-gossip",
            "--without-mingle",
        ]
    )


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply migrations up to REVISION (default: head)."""
    from services.db import migrate

    url = get_settings().resolved_database_url
    migrate.upgrade(url, revision)
    console.print(f"database at {migrate.current(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()] = "-1") -> None:
    """Revert migrations down to REVISION (default: one step; `base` empties the schema)."""
    from services.db import migrate

    url = get_settings().resolved_database_url
    migrate.downgrade(url, revision)
    console.print(f"database at {migrate.current(url)}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's current revision and the code's head."""
    from services.db import migrate

    url = get_settings().resolved_database_url
    typer.echo(f"current: {migrate.current(url)}  head: {migrate.head()}")


@admin_app.command("create-token")
def create_token(
    name: Annotated[str, typer.Option(help="A label for the token")] = "cli",
    admin: Annotated[bool, typer.Option("--admin", help="May delete artifacts")] = False,
    out: Annotated[Path | None, typer.Option(help="Write the token to this file (0600) too")] = None,
    source_buckets: Annotated[
        str | None,
        typer.Option(
            "--source-buckets",
            help="Comma-separated s3:// buckets this token may convert from, within KILN_SOURCE_BUCKETS "
            "(default: all the deployment allows)",
        ),
    ] = None,
) -> None:
    """Create an API token; it is printed once (only its sha256 is stored)."""
    buckets = None
    if source_buckets is not None:
        buckets = [b.strip() for b in source_buckets.split(",") if b.strip()]
        if not buckets:
            raise typer.BadParameter("name at least one bucket", param_hint="--source-buckets")
    ensure_schema()
    from services.db import repo
    from services.db.session import session_scope

    with session_scope(get_settings()) as s:
        plain, row = repo.create_token(s, name, is_admin=admin, source_buckets=buckets)
        token_id = row.id
    scope = f", sources from bucket(s) {', '.join(buckets)} only" if buckets else ""
    console.print(f"created {'admin ' if admin else ''}token {token_id} ({name!r}{scope})")
    if out is not None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(plain + "\n")
    typer.echo(plain)


@admin_app.command("list-tokens")
def list_tokens() -> None:
    """List API tokens: id, name, admin or not, created, revoked, source buckets when narrowed (never
    the token itself)."""
    ensure_schema()
    from services.db import repo
    from services.db.session import session_scope

    with session_scope(get_settings()) as s:
        rows = [
            (
                t.id,
                t.name,
                t.is_admin,
                repo.as_aware(t.created_at),
                repo.as_aware(t.revoked_at),
                t.source_buckets,
            )
            for t in repo.list_tokens(s)
        ]
    for token_id, name, is_admin, created, revoked, buckets in rows:
        state = f"revoked {revoked:%Y-%m-%d %H:%M:%S}" if revoked else "active"
        role = "admin" if is_admin else "user"
        scope = f"\tsource buckets {','.join(buckets)}" if buckets is not None else ""
        typer.echo(f"{token_id}\t{name}\t{role}\tcreated {created:%Y-%m-%d %H:%M:%S}\t{state}{scope}")


@admin_app.command("revoke-token")
def revoke_token(
    token_id: Annotated[int | None, typer.Option("--id", min=1, help="Revoke the token with this id")] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Revoke every token with this name (digits are a name)")
    ] = None,
) -> None:
    """Revoke API tokens at once (`--id N` or `--name NAME`): later requests with them get 401 within
    KILN_TOKEN_CACHE_S. Their jobs are kept."""
    if (token_id is None) == (name is None):
        raise typer.BadParameter("give exactly one of --id N and --name NAME (`kiln admin list-tokens`)")
    ensure_schema()
    from services.db import repo
    from services.db.session import session_scope

    try:
        with session_scope(get_settings()) as s:
            result = repo.revoke_tokens(s, token_id=token_id, name=name)
            revoked = [(t.id, t.name) for t in result.revoked]
            already = [(t.id, t.name) for t in result.already]
    except repo.UnknownToken as e:
        from runtime.cli_output import print_error

        print_error(e)
        raise typer.Exit(1) from e
    for revoked_id, revoked_name in revoked:
        typer.echo(f"revoked token {revoked_id} ({revoked_name!r})")
    for revoked_id, revoked_name in already:
        typer.echo(f"token {revoked_id} ({revoked_name!r}) was already revoked")


@admin_app.command("reconcile")
def reconcile() -> None:
    """Re-enqueue queued/running jobs that have no live broker message (e.g. after a Redis restart)."""
    from services.worker.reconcile import reconcile_once

    ids = reconcile_once(get_settings())  # a one-off pass: its own Celery dispatcher
    typer.echo(f"re-enqueued {len(ids)} job(s)" + (": " + ", ".join(ids) if ids else ""))


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `kiln` app."""
    app.command("api")(api)
    app.command("worker")(worker)
    app.add_typer(db_app, name="db")
    app.add_typer(admin_app, name="admin")
