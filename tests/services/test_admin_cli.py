"""`kiln admin create-token / list-tokens / revoke-token`, as an operator runs them, and the
repository rule underneath on PostgreSQL and SQLite: a revoked token authenticates nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.db import repo
from services.db.session import session_scope
from services.settings import ServiceSettings as Settings
from tests.services.conftest import REPO


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


def test_kiln_admin_revoke_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {"KILN_DATABASE_URL": url, "PATH": "/usr/bin:/bin", "COLUMNS": "200"}

    def kiln(*args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == rc, out.stdout + out.stderr
        return out

    kiln("db", "upgrade")
    created = kiln("admin", "create-token", "--name", "alice")
    plain = created.stdout.strip()
    assert plain.startswith(repo.TOKEN_PREFIX) and "created token 1 ('alice')" in created.stderr
    assert "1\talice\tuser" in kiln("admin", "list-tokens").stdout

    assert kiln("admin", "revoke-token", "--name", "alice").stdout.strip() == "revoked token 1 ('alice')"
    with session_scope(Settings(_env_file=None, database_url=url)) as s:  # type: ignore[call-arg]
        assert repo.find_token(s, plain) is None  # the API now answers 401 for it
    assert "already revoked" in kiln("admin", "revoke-token", "--id", "1").stdout
    assert "revoked 20" in kiln("admin", "list-tokens").stdout  # revoked <timestamp>

    unknown = kiln("admin", "revoke-token", "--name", "bob", rc=1)
    assert "no API token with name 'bob'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_a_token_named_with_digits_is_revoked_by_name_not_taken_for_an_id(tmp_path: Path) -> None:
    """Security finding 11: `revoke-token 1` revoked the bootstrap admin (id 1), not the token named "1".
    The id and the name are now separate options, and a bare argument is refused before anything."""
    env = {"KILN_DATABASE_URL": f"sqlite:///{tmp_path / 'cli.db'}", "PATH": "/usr/bin:/bin", "COLUMNS": "200"}

    def kiln(*args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == rc, out.stdout + out.stderr
        return out

    kiln("db", "upgrade")
    kiln("admin", "create-token", "--name", "bootstrap-admin", "--admin")  # id 1
    kiln("admin", "create-token", "--name", "1")  # id 2, named "1"

    def states() -> dict[str, str]:
        rows = [line.split("\t") for line in kiln("admin", "list-tokens").stdout.splitlines()]
        return {f"{r[0]}:{r[1]}": r[4].split()[0] for r in rows}

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


def test_a_token_can_be_narrowed_to_source_buckets(tmp_path: Path) -> None:
    env = {"KILN_DATABASE_URL": f"sqlite:///{tmp_path / 'cli.db'}", "PATH": "/usr/bin:/bin", "COLUMNS": "200"}

    def kiln(*args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == rc, out.stdout + out.stderr
        return out

    kiln("db", "upgrade")
    created = kiln("admin", "create-token", "--name", "ci", "--source-buckets", "models, data")
    assert "sources from bucket(s) models, data only" in created.stderr
    kiln("admin", "create-token", "--name", "any")
    assert kiln("admin", "create-token", "--name", "x", "--source-buckets", " , ", rc=2).stdout == ""
    lines = kiln("admin", "list-tokens").stdout.splitlines()
    assert lines[0].startswith("1\tci\tuser") and lines[0].endswith("\tsource buckets models,data")
    assert lines[1].startswith("2\tany\tuser") and "source buckets" not in lines[1]
    with session_scope(Settings(_env_file=None, database_url=env["KILN_DATABASE_URL"])) as s:  # type: ignore[call-arg]
        assert [t.source_buckets for t in repo.list_tokens(s)] == [["models", "data"], None]
