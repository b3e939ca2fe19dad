"""per-owner dedupe key

Identical requests now share a job only within one token: `jobs.dedupe_key` becomes
sha256("<token_id or ->:<request_digest>") instead of the bare request digest (still 64 hex
characters, still unique), and `ix_jobs_token_id` serves each token's job listing. Upgrade rewrites
the key of every live or succeeded job. Downgrade puts the bare digest back; where several owners
hold live jobs for the same request, only the oldest keeps its key (the old schema allows one), the
others simply stop deduplicating new requests.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

jobs = sa.table(
    "jobs",
    sa.column("id", sa.String),
    sa.column("token_id", sa.Integer),
    sa.column("request_digest", sa.String),
    sa.column("dedupe_key", sa.String),
    sa.column("created_at", sa.DateTime),
)


def owner_dedupe_key(token_id: int | None, digest: str) -> str:
    """A frozen copy of services.db.repo.owner_dedupe_key (migrations must not follow later code)."""
    owner = "-" if token_id is None else str(token_id)
    return hashlib.sha256(f"{owner}:{digest}".encode()).hexdigest()


def _keyed_jobs(conn: sa.Connection) -> list[sa.Row]:
    query = sa.select(jobs.c.id, jobs.c.token_id, jobs.c.request_digest).where(jobs.c.dedupe_key.is_not(None))
    return list(conn.execute(query.order_by(jobs.c.created_at, jobs.c.id)))


def _set_key(conn: sa.Connection, job_id: str, key: str | None) -> None:
    conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(dedupe_key=key))


def upgrade() -> None:
    conn = op.get_bind()
    for row in _keyed_jobs(conn):
        _set_key(conn, row.id, owner_dedupe_key(row.token_id, row.request_digest))
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.create_index("ix_jobs_token_id", ["token_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_token_id")
    conn = op.get_bind()
    rows = _keyed_jobs(conn)
    # Clear first, then restore oldest first: no transient duplicate of the unique key.
    for row in rows:
        _set_key(conn, row.id, None)
    seen: set[str] = set()
    for row in rows:
        if row.request_digest not in seen:
            seen.add(row.request_digest)
            _set_key(conn, row.id, row.request_digest)
