"""SQL metadata: conversion jobs, committed artifacts and their files, API tokens.

The job row is the source of truth for a conversion: the broker only carries its id. `spec` holds the
request (`ConversionSpec.row()`, validated back by the worker's `stored_spec`); `source` repeats the
spec's source for `list_jobs`' filter, both written by `repo.spec_columns`. `task_id` names the one
broker message allowed to run the job (a redelivery keeps it; the reconciler replaces it), `attempts`
counts task starts, `dedupe_key` (unique, set while a job is live or succeeded; a hash of the owning
token and the request digest, see `repo.owner_dedupe_key`) makes one token's identical concurrent
submissions share one job. A job belongs to `token_id`: other non-admin tokens never see it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: DateTime(timezone=True)}  # noqa: RUF012


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    stage: Mapped[str] = mapped_column(String(64), default="queued")
    progress: Mapped[int] = mapped_column(Integer, default=0)  # 0..100
    message: Mapped[str] = mapped_column(Text, default="")
    error: Mapped[str | None] = mapped_column(Text, default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)

    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    source: Mapped[str] = mapped_column(Text)
    request_digest: Mapped[str] = mapped_column(String(64), index=True)
    dedupe_key: Mapped[str | None] = mapped_column(String(64), unique=True, default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)
    token_id: Mapped[int | None] = mapped_column(ForeignKey("api_tokens.id", ondelete="SET NULL"))
    artifact_ids: Mapped[list[str]] = mapped_column(JSON, default=list)

    task_id: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)

    __table_args__ = (
        Index("ix_jobs_status_created", "status", "created_at"),
        Index("uq_jobs_token_idempotency_key", "token_id", "idempotency_key", unique=True),
        Index("ix_jobs_token_id", "token_id", "id"),  # a token's own jobs, newest first
    )


class Artifact(Base):
    __tablename__ = "artifacts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # ka-<digest>
    model: Mapped[str] = mapped_column(String(300), index=True)  # source name (last path component)
    architecture: Mapped[str] = mapped_column(String(100))
    source_uri: Mapped[str] = mapped_column(Text)
    source_digest: Mapped[str] = mapped_column(String(64), index=True)
    source_format: Mapped[str] = mapped_column(String(40))
    target: Mapped[str] = mapped_column(String(16), index=True)
    tp: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(16))
    uri: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_id: Mapped[str | None] = mapped_column(String(40), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    files: Mapped[list[ArtifactFile]] = relationship(
        back_populates="artifact", cascade="all, delete-orphan", passive_deletes=True, lazy="selectin"
    )


class ArtifactFile(Base):
    __tablename__ = "artifact_files"

    artifact_id: Mapped[str] = mapped_column(ForeignKey("artifacts.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(500), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int | None] = mapped_column(Integer, default=None)

    artifact: Mapped[Artifact] = relationship(back_populates="files")


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the bearer token
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    # Buckets this token may name as s3:// sources, narrowing the deployment's KILN_SOURCE_BUCKETS
    # (None: not narrowed). See services/sources.py.
    source_buckets: Mapped[list[str] | None] = mapped_column(JSON, default=None)
