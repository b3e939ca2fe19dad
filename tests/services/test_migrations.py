"""Alembic migrations: upgrade from empty, downgrade to base and upgrade again, on PostgreSQL and SQLite."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from services.db import migrate
from services.db.models import Base
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
