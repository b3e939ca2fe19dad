"""Request and response bodies of the REST API (pydantic; the OpenAPI document is generated from them)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from kernels.base import Target

TargetName = Literal["sm75", "sm80", "sm86", "sm89", "sm90", "cpu"]
assert set(TargetName.__args__) == {t.value for t in Target}  # type: ignore[attr-defined]

KernelName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,64}$")]
# s3://bucket[/prefix] or an absolute path; no whitespace or control characters anywhere.
SOURCE_PATTERN = r"^(?:s3://[A-Za-z0-9._-]+(?:/[^\x00-\x20\x7f]*)?|/[^\x00-\x20\x7f]*)$"
_SOURCE_RE = re.compile(SOURCE_PATTERN)
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class ConversionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fp8_scheme: Literal["tensor", "channel", "block"] = "tensor"
    disabled_kernels: list[KernelName] = Field(default_factory=list, max_length=32)


class ConversionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        min_length=1,
        max_length=2048,
        json_schema_extra={"pattern": SOURCE_PATTERN},  # checked below, with an actionable message
        description="Checkpoint location: s3://bucket/prefix, or an absolute directory on the server "
        "(allowed outside production unless KILN_ALLOW_LOCAL_SOURCES=false)",
        examples=["s3://checkpoints/SmolLM2-135M-Instruct"],
    )
    targets: list[TargetName] = Field(min_length=1, max_length=6, examples=[["cpu", "sm80"]])
    method: Literal["auto", "fp8"] = "auto"
    tp: int = Field(default=1, ge=1, le=64)
    options: ConversionOptions = Field(default_factory=ConversionOptions)

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str) -> str:
        if not _SOURCE_RE.fullmatch(v):
            raise ValueError(
                "must be s3://bucket/prefix or an absolute server path, "
                "without whitespace or control characters"
            )
        return v

    @field_validator("targets")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return sorted(set(v))  # repeats are harmless: one artifact per distinct target


class Job(BaseModel):
    id: str
    status: JobStatus
    stage: str
    progress: int = Field(ge=0, le=100)
    message: str
    error: str | None
    attempts: int
    max_attempts: int
    cancel_requested: bool
    source: str
    targets: list[str]
    method: str
    tp: int
    options: dict[str, Any]
    artifact_ids: list[str]
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobPage(BaseModel):
    items: list[Job]
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page; null on the last")


class ArtifactFile(BaseModel):
    name: str
    size: int
    sha256: str
    rank: int | None


class ArtifactSummary(BaseModel):
    id: str
    model: str
    architecture: str
    source_uri: str
    source_digest: str
    source_format: str
    target: str
    tp: int
    method: str
    uri: str
    size_bytes: int
    job_id: str | None
    created_at: datetime


class ArtifactDetail(ArtifactSummary):
    manifest: dict[str, Any]
    files: list[ArtifactFile]
    urls: dict[str, str] = Field(description="file name -> presigned GET URL (file:// for a local store)")
    urls_expire_in_s: int


class ArtifactPage(BaseModel):
    items: list[ArtifactSummary]
    next_cursor: str | None


class Problem(BaseModel):
    detail: str


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str]
