"""per-token source buckets

`api_tokens.source_buckets` (JSON list, nullable): the s3:// buckets a token may name as conversion
sources, narrowing the deployment's KILN_SOURCE_BUCKETS (services/sources.py). Existing tokens get
NULL: not narrowed. Downgrade drops the column (tokens lose their narrowing).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch_op:
        batch_op.add_column(sa.Column("source_buckets", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch_op:
        batch_op.drop_column("source_buckets")
