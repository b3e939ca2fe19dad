"""`kiln admin create-token / list-tokens / revoke-token`, as an operator runs them, and the
repository rule underneath on PostgreSQL and SQLite: a revoked token authenticates nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.db import migrate, repo
from services.db.session import session_scope
from services.settings import ServiceSettings as Settings
from tests.services.conftest import REPO


class AdminCli:
    """`kiln admin …` run as an operator runs it (a subprocess) against its own migrated SQLite."""

    def __init__(self, tmp_path: Path) -> None:
        self.url = f"sqlite:///{tmp_path / 'cli.db'}"
        self.env = {"KILN_DATABASE_URL": self.url, "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
        migrate.upgrade(self.url)  # `kiln db upgrade` has its own test (test_migrations.py)

    def __call__(self, *args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == rc, out.stdout + out.stderr
        return out

    def settings(self) -> Settings:
        return Settings(_env_file=None, database_url=self.url)  # type: ignore[call-arg]


@pytest.fixture
def kiln(tmp_path: Path) -> AdminCli:
    return AdminCli(tmp_path)


@pytest.fixture
def settings(db_url: str) -> Settings:
    return Settings(_env_file=None, database_url=db_url)  # type: ignore[call-arg]


def test_revoke_by_id_or_name_is_idempotent_and_refuses_unknown(settings: Settings) -> None:
    with session_scope(settings) as s:
        plain_a, a = repo.create_token(s, "ci")
        plain_b, _ = repo.create_token(s, "ci")
        plain_c, c = repo.create_token(s, "laptop")
        a_id, c_id = a.id, c.id
    with session_scope(settings) as s:
        assert [t.id for t in repo.revoke_tokens(s, token_id=c_id).revoked] == [c_id]
    with session_scope(settings) as s:
        result = repo.revoke_tokens(s, name="ci")  # every token of that name
        assert len(result.revoked) == 2 and result.already == []
    with session_scope(settings) as s:
        again = repo.revoke_tokens(s, token_id=a_id)
        assert again.revoked == [] and [t.id for t in again.already] == [a_id]
        for plain in (plain_a, plain_b, plain_c):
            assert repo.find_token(s, plain) is None
        with pytest.raises(repo.UnknownToken, match="no API token with id 9999"):
            repo.revoke_tokens(s, token_id=9999)
        with pytest.raises(repo.UnknownToken, match="no API token with name 'nobody'"):
            repo.revoke_tokens(s, name="nobody")


def test_kiln_admin_revoke_token(kiln: AdminCli) -> None:
    created = kiln("admin", "create-token", "--name", "alice")
    plain = created.stdout.strip()
    assert plain.startswith(repo.TOKEN_PREFIX) and "created token 1 ('alice')" in created.stderr
    assert "1\talice\tuser" in kiln("admin", "list-tokens").stdout

    assert kiln("admin", "revoke-token", "--name", "alice").stdout.strip() == "revoked token 1 ('alice')"
    with session_scope(kiln.settings()) as s:
        assert repo.find_token(s, plain) is None  # the API now answers 401 for it
    assert "already revoked" in kiln("admin", "revoke-token", "--id", "1").stdout
    assert "revoked 20" in kiln("admin", "list-tokens").stdout  # revoked <timestamp>

    unknown = kiln("admin", "revoke-token", "--name", "bob", rc=1)
    assert "no API token with name 'bob'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_a_token_named_with_digits_is_revoked_by_name_not_taken_for_an_id(kiln: AdminCli) -> None:
    """Security finding 11: `revoke-token 1` revoked the bootstrap admin (id 1), not the token named "1".
    The id and the name are now separate options, and a bare argument is refused before anything."""
    with session_scope(kiln.settings()) as s:
        repo.create_token(s, "bootstrap-admin", is_admin=True)  # id 1
        repo.create_token(s, "1")  # id 2, named "1"

    def states() -> dict[str, str]:
        with session_scope(kiln.settings()) as s:
            return {f"{t.id}:{t.name}": "revoked" if t.revoked_at else "active" for t in repo.list_tokens(s)}

    bare = kiln("admin", "revoke-token", "1", rc=2)
    assert "Traceback" not in bare.stderr
    neither = kiln("admin", "revoke-token", rc=2)
    assert "exactly one of --id N and --name NAME" in neither.stderr
    both = kiln("admin", "revoke-token", "--id", "2", "--name", "1", rc=2)
    assert "exactly one of --id N and --name NAME" in both.stderr
    assert states() == {"1:bootstrap-admin": "active", "2:1": "active"}  # nothing revoked so far

    assert kiln("admin", "revoke-token", "--name", "1").stdout.strip() == "revoked token 2 ('1')"
    assert states() == {"1:bootstrap-admin": "active", "2:1": "revoked"}
    assert kiln("admin", "revoke-token", "--id", "1").stdout.strip() == "revoked token 1 ('bootstrap-admin')"
    assert states() == {"1:bootstrap-admin": "revoked", "2:1": "revoked"}


def test_a_token_can_be_narrowed_to_source_buckets(kiln: AdminCli) -> None:
    created = kiln("admin", "create-token", "--name", "ci", "--source-buckets", "models, data")
    assert "sources from bucket(s) models, data only" in created.stderr
    kiln("admin", "create-token", "--name", "any")
    assert kiln("admin", "create-token", "--name", "x", "--source-buckets", " , ", rc=2).stdout == ""
    lines = kiln("admin", "list-tokens").stdout.splitlines()
    assert lines[0].startswith("1\tci\tuser") and lines[0].endswith("\tsource buckets models,data")
    assert lines[1].startswith("2\tany\tuser") and "source buckets" not in lines[1]
    with session_scope(kiln.settings()) as s:
        assert [t.source_buckets for t in repo.list_tokens(s)] == [["models", "data"], None]


def test_the_admin_commands_import_no_torch() -> None:
    """`kiln admin …` is an operator's quick command: no torch import (1.7 s) on its path."""
    code = "import sys, services.ops_cli, services.db.repo; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
