"""job request as one JSON spec

`jobs.spec` (JSON, not null) holds the whole conversion request as `ConversionSpec.row()` writes it
({"source", "targets", "method", "tp", "options"}); the worker validates it back. `jobs.source` stays,
a copy of the spec's source for the job listing's filter. Upgrade fills `spec` from the old columns
(a row written before options existed keeps `options: {}`, which validates to the defaults) and
drops `targets`, `method`, `tp` and `options`. Downgrade restores those columns from `spec`.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 1000
FIELDS = ("targets", "method", "tp", "options")  # the columns the spec replaces (`source` stays)

jobs = sa.table(
    "jobs",
    sa.column("id", sa.String),
    sa.column("source", sa.Text),
    sa.column("targets", sa.JSON),
    sa.column("method", sa.String),
    sa.column("tp", sa.Integer),
    sa.column("options", sa.JSON),
    sa.column("spec", sa.JSON),
)


def _rows(conn: sa.Connection, *columns: str) -> Iterator[list[sa.Row]]:
    """Every job (its id and these columns), in pages ordered by id."""
    last = ""
    while True:
        query = sa.select(jobs.c.id, *(jobs.c[c] for c in columns)).where(jobs.c.id > last)
        page = list(conn.execute(query.order_by(jobs.c.id).limit(BATCH)))
        if not page:
            return
        yield page
        last = page[-1].id


def _set(conn: sa.Connection, values: list[dict[str, Any]], columns: Sequence[str]) -> None:
    stmt = sa.update(jobs).where(jobs.c.id == sa.bindparam("job_id"))
    conn.execute(stmt.values({c: sa.bindparam(f"new_{c}") for c in columns}), values)


def _spec(row: sa.Row) -> dict[str, Any]:
    return {
        "source": row.source,
        "targets": list(row.targets),
        "method": row.method,
        "tp": row.tp,
        "options": dict(row.options or {}),
    }


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("spec", sa.JSON(), nullable=True))
    conn = op.get_bind()
    for page in _rows(conn, "source", *FIELDS):
        _set(conn, [{"job_id": r.id, "new_spec": _spec(r)} for r in page], ["spec"])
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("spec", existing_type=sa.JSON(), nullable=False)
        for column in FIELDS:
            batch_op.drop_column(column)


def downgrade() -> None:
    restored = {
        "targets": sa.JSON(),
        "method": sa.String(length=16),
        "tp": sa.Integer(),
        "options": sa.JSON(),
    }
    with op.batch_alter_table("jobs") as batch_op:
        for column, type_ in restored.items():
            batch_op.add_column(sa.Column(column, type_, nullable=True))
    conn = op.get_bind()
    for page in _rows(conn, "spec"):
        values = [{"job_id": r.id, **{f"new_{c}": r.spec[c] for c in FIELDS}} for r in page]
        _set(conn, values, FIELDS)
    with op.batch_alter_table("jobs") as batch_op:
        for column, type_ in restored.items():
            batch_op.alter_column(column, existing_type=type_, nullable=False)
        batch_op.drop_column("spec")
