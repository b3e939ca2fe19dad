"""Alembic migrations: upgrade from empty, downgrade to base and upgrade again, on PostgreSQL and SQLite."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import JSON, Connection, column, create_engine, insert, inspect, table, text

from services.api.routes.conversions import to_schema
from services.convert.spec import ConversionOptions, ConversionSpec
from services.db import migrate, repo
from services.db.models import Base, Job
from services.db.session import dispose_engines, session_scope
from services.settings import ServiceSettings as Settings
from services.worker.jobs import stored_spec
from tests.services.conftest import PG_ADMIN_URL, REPO

EXPECTED_TABLES = {"jobs", "artifacts", "artifact_files", "api_tokens"}


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'kiln.db'}"
        return
    request.getfixturevalue("pg_url")  # skips when PostgreSQL is absent
    name = f"kiln_test_mig_{secrets.token_hex(4)}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _columns(url: str) -> dict[str, set[str]]:
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        return {t: {c["name"] for c in insp.get_columns(t)} for t in EXPECTED_TABLES}
    finally:
        engine.dispose()


def test_upgrade_from_empty_then_round_trip(empty_db: str) -> None:
    assert migrate.current(empty_db) is None
    migrate.upgrade(empty_db)
    assert migrate.current(empty_db) == migrate.head()
    assert _tables(empty_db) == EXPECTED_TABLES
    # The migration creates exactly the columns the models declare.
    assert _columns(empty_db) == {t: set(Base.metadata.tables[t].columns.keys()) for t in EXPECTED_TABLES}

    migrate.downgrade(empty_db, "base")
    assert migrate.current(empty_db) is None
    assert _tables(empty_db) == set()

    migrate.upgrade(empty_db)
    assert migrate.is_up_to_date(empty_db)
    assert _tables(empty_db) == EXPECTED_TABLES


def test_kiln_db_commands(tmp_path: Path) -> None:
    """`kiln db upgrade` / `current` / `downgrade` as an operator runs them (embedded SQLite)."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {"KILN_DATABASE_URL": url, "PATH": "/usr/bin:/bin"}

    def kiln(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr

    kiln("db", "upgrade")
    assert f"current: {migrate.head()}" in kiln("db", "current")
    kiln("db", "downgrade", "base")
    assert "current: None" in kiln("db", "current")


def _digest(source: str) -> str:
    return repo.request_digest(ConversionSpec(source=source, targets=["cpu"]))


# The jobs table as revisions 0001-0003 wrote it (a request field per column): rows written
# before 0004, independent of today's models.
OLD_JOBS = table(
    "jobs", *(column(c) for c in (
        "id", "status", "stage", "progress", "message", "attempts", "max_attempts", "cancel_requested",
        "source", "request_digest", "dedupe_key", "token_id", "created_at", "updated_at",
    )),
    column("targets", JSON), column("options", JSON), column("artifact_ids", JSON),
    column("method"), column("tp"),
)  # fmt: skip


def _insert_job(
    conn: Connection, job_id: str, token_id: int | None, source: str, live: bool, **request: object
) -> None:
    """A job row in the 0001-0003 shape; `request` overrides targets / method / tp / options."""
    now, digest = datetime.now(UTC), _digest(source)
    conn.execute(
        insert(OLD_JOBS).values(
            id=job_id, status="queued" if live else "failed", stage="queued", progress=0, message="",
            attempts=0, max_attempts=3, cancel_requested=False, source=source,
            **({"targets": ["cpu"], "method": "auto", "tp": 1, "options": {}} | request),
            request_digest=digest, dedupe_key=digest if live else None,
            token_id=token_id, artifact_ids=[], created_at=now, updated_at=now,
        )
    )  # fmt: skip


def _dedupe_keys(url: str) -> dict[str, str | None]:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return {row.id: row.dedupe_key for row in c.execute(text("SELECT id, dedupe_key FROM jobs"))}
    finally:
        engine.dispose()


def test_0002_scopes_existing_dedupe_keys_to_their_owner(empty_db: str) -> None:
    """Rows written under 0001 (dedupe key = bare request digest) keep deduplicating for their own
    token after the upgrade, and no longer capture another token's identical request; downgrade
    restores the bare digest, keeping it on the oldest job where several owners now hold one."""
    shared, other = "s3://b/shared", "s3://b/other"
    migrate.upgrade(empty_db, "0001")
    engine = create_engine(empty_db)
    with engine.begin() as c:
        for name in ("alice", "bob"):
            c.execute(
                insert(Base.metadata.tables["api_tokens"]).values(
                    name=name, token_hash=name * 8, is_admin=False, created_at=datetime.now(UTC)
                )
            )
        _insert_job(c, "job-1", 1, shared, live=True)  # alice's live job
        _insert_job(c, "job-2", None, other, live=True)  # a job submitted without a token
        _insert_job(c, "job-3", 2, shared, live=False)  # bob's failed attempt: no key
    engine.dispose()

    migrate.upgrade(empty_db)
    assert _dedupe_keys(empty_db) == {
        "job-1": repo.owner_dedupe_key(1, _digest(shared)),
        "job-2": repo.owner_dedupe_key(None, _digest(other)),
        "job-3": None,
    }
    settings = Settings(_env_file=None, database_url=empty_db)  # type: ignore[call-arg]
    with session_scope(settings) as s:
        submit = partial(
            repo.submit_job, s, ConversionSpec(source=shared, targets=["cpu"]),
            idempotency_key=None, max_attempts=3,
        )  # fmt: skip
        assert submit(token_id=1).job.id == "job-1"
        bobs = submit(token_id=2).job.id
    assert bobs not in {"job-1", "job-3"}
    dispose_engines(close=True)

    migrate.downgrade(empty_db, "0001")
    assert _dedupe_keys(empty_db) == {
        "job-1": _digest(shared), "job-2": _digest(other), "job-3": None, bobs: None,
    }  # fmt: skip
    migrate.upgrade(empty_db)
    assert _dedupe_keys(empty_db)["job-1"] == repo.owner_dedupe_key(1, _digest(shared))


def test_the_schema_matches_the_models_indexes(empty_db: str) -> None:
    """Alembic's autogenerate finds nothing to do at head: the migrations create what models declare."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    migrate.upgrade(empty_db)
    engine = create_engine(empty_db)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def _old_requests(url: str) -> dict[str, tuple[object, ...]]:
    """Each job's request as the 0001-0003 columns hold it."""
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            rows = c.execute(OLD_JOBS.select())
            return {r.id: (r.source, r.targets, r.method, r.tp, r.options) for r in rows}
    finally:
        engine.dispose()


def _shown(job: Job) -> tuple[object, ...]:
    """The request as the API's job response shows it."""
    body = to_schema(job).model_dump()
    return tuple(body[k] for k in ("source", "targets", "method", "tp", "options"))


def _claim_specs(settings: Settings, job_ids: list[str]) -> dict[str, ConversionSpec]:
    """What the worker's claim reads for each job: the row validated back into a ConversionSpec."""
    specs = {}
    with session_scope(settings) as s:
        for job_id in job_ids:
            claim = repo.claim_job(s, job_id, None)
            assert claim.outcome == "run" and claim.job is not None
            specs[job_id] = stored_spec(claim.job)
    dispose_engines(close=True)
    return specs


def test_0004_moves_old_rows_into_the_spec_and_they_still_run(empty_db: str) -> None:
    """Rows written under 0003 (a column per request field) hold their request in `spec` after the
    upgrade: the worker claims them and validates the same ConversionSpec (a row from before options
    existed gets the defaults), the API shows what it showed, `source` still filters the listing.
    Downgrade restores the columns as they were."""
    moe = {"fp8_scheme": "block", "disabled_kernels": ["dense"], "expert_parallel": True}
    migrate.upgrade(empty_db, "0003")
    engine = create_engine(empty_db)
    with engine.begin() as c:
        _insert_job(
            c, "job-1", None, "s3://b/moe", True, targets=["cpu", "sm90"], method="fp8", tp=2, options=moe
        )
        _insert_job(c, "job-2", None, "/models/old", True)  # written before options existed
    engine.dispose()
    before = _old_requests(empty_db)

    migrate.upgrade(empty_db)
    assert {"targets", "method", "tp", "options"}.isdisjoint(_columns(empty_db)["jobs"])
    expected = {
        "job-1": ConversionSpec(
            source="s3://b/moe", targets=["cpu", "sm90"], method="fp8", tp=2, options=ConversionOptions(**moe)
        ),
        "job-2": ConversionSpec(source="/models/old", targets=["cpu"]),
    }
    settings = Settings(_env_file=None, database_url=empty_db)  # type: ignore[call-arg]
    assert _claim_specs(settings, list(expected)) == expected
    with session_scope(settings) as s:
        listed, _ = repo.list_jobs(s, limit=10, source="s3://b/moe")
        assert [j.id for j in listed] == ["job-1"]
        assert {j.id: _shown(j) for j in repo.list_jobs(s, limit=10)[0]} == before
    dispose_engines(close=True)

    migrate.downgrade(empty_db, "0003")
    assert _old_requests(empty_db) == before
    migrate.upgrade(empty_db)
    assert _claim_specs(settings, list(expected)) == expected
