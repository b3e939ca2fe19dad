"""Request and response bodies of the REST API (pydantic; the OpenAPI document is generated from them)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kernels.targets import Target
from services.convert import spec
from services.convert.spec import TargetName

__all__ = ["TargetName"]  # a target by name ("sm80"), as the conversion spec takes it
# s3://bucket[/prefix] or an absolute path; no whitespace or control characters anywhere.
_SOURCE_FORM_RE = re.compile(
    r"^(?:s3://[A-Za-z0-9][A-Za-z0-9._-]*(?:/[^\x00-\x20\x7f]*)?|/[^\x00-\x20\x7f]*)$"
)
# ... and no '.', '..' or empty path segments (what the OpenAPI document states, without lookarounds).
_CHAR = r"[^/\x00-\x20\x7f]"
_NOT_DOT = r"[^./\x00-\x20\x7f]"
_SEGMENT = rf"(?:{_NOT_DOT}{_CHAR}*|\.{_NOT_DOT}{_CHAR}*|\.\.{_CHAR}+)"
SOURCE_PATTERN = rf"^(?:s3://[A-Za-z0-9][A-Za-z0-9._-]*(?:/{_SEGMENT})*/?|(?:/{_SEGMENT})+/?|/)$"
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
# Free-text query filters: no control characters (PostgreSQL text cannot even hold NUL).
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # job and artifact ids
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def refuse_surrogates(value: object, where: str = "the value") -> None:
    """Raise ValueError when a string (or a string in a list) holds a lone UTF-16 surrogate (JSON
    `"\\ud800"`): it is not text, and neither the database nor the response encoder can store it."""
    if isinstance(value, str) and _SURROGATE_RE.search(value):
        raise ValueError(
            f"{where} contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode "
            "text; send valid UTF-8"
        )
    if isinstance(value, list):
        for i, item in enumerate(value):
            refuse_surrogates(item, f"item {i}")


class StrictRequest(BaseModel):
    """A request body: unknown fields refused, no type coercion (`tp: "2"` or `true` is a 422),
    no lone surrogates in any string (a 422 naming the field, before any other check)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_text(cls, value: object) -> object:
        refuse_surrogates(value)
        return value


def _check_segments(source: str) -> None:
    """No '.', '..' or empty segments: a source names its location directly, and an S3 key with
    '..' would mean different objects to different S3 implementations."""
    path = source.removeprefix("s3://") if source.startswith("s3://") else source[1:]
    trailing = path.endswith("/")  # one trailing slash is allowed ("s3://bucket/prefix/")
    path = path.removesuffix("/")
    segments = path.split("/") if path or trailing else []
    if any(seg in ("", ".", "..") for seg in segments):
        raise ValueError(
            "must not contain '.', '..' or empty ('//') path segments; "
            "name the location directly, e.g. s3://bucket/models/llama or /data/models/llama"
        )


class ConversionOptions(spec.ConversionOptions, StrictRequest):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ConversionCreate(spec.ConversionSpec, StrictRequest):
    """The conversion spec (services/convert/spec.py) as a request body: strict types, and `source` in
    the form the API accepts (no relative paths, no '.', '..' or empty segments)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    source: str = Field(
        min_length=1,
        max_length=spec.MAX_SOURCE_CHARS,
        json_schema_extra={"pattern": SOURCE_PATTERN},  # checked below, with an actionable message
        description=spec.ConversionSpec.model_fields["source"].description,
        examples=spec.ConversionSpec.model_fields["source"].examples,
    )
    options: ConversionOptions = Field(default_factory=ConversionOptions)

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str) -> str:
        if not _SOURCE_FORM_RE.fullmatch(v):
            raise ValueError(
                "must be s3://bucket/prefix or an absolute server path, "
                "without whitespace or control characters"
            )
        _check_segments(v)
        return v

    @field_validator("targets")
    @classmethod
    def _unique(cls, v: list[Target]) -> list[Target]:
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


class PlanRejection(BaseModel):
    kernel: str
    reason: str


class PlanLayer(BaseModel):
    layer: str = Field(description="Runtime (fused) layer name, e.g. model.layers.0.self_attn.qkv_proj")
    shards: list[str] = Field(description="Checkpoint modules fused into it")
    scheme: str
    kernel: str
    fallback: bool = Field(description="A kernel ahead of this one would take the scheme at another shape")
    rejections: list[PlanRejection]
    n: int = Field(description="Output features per rank")
    k: int = Field(description="Input features per rank")


class ExpectedBytes(BaseModel):
    per_rank: list[int]
    total: int


class Plan(BaseModel):
    """What a conversion would do for one target, as `kiln plan --json` prints it."""

    source: str
    format: str
    quantization: dict[str, Any] | None
    target: str
    tp: int
    method: str
    options: dict[str, Any]
    act_dtype: str
    architecture: str
    notes: list[str]
    layers: list[PlanLayer]
    other_tensors: list[str]
    fallbacks: int
    expected_bytes: ExpectedBytes


class PlanSet(BaseModel):
    plans: list[Plan] = Field(description="One per distinct requested target, in target name order")


class Problem(BaseModel):
    detail: str


class Unprocessable(BaseModel):
    """A 422: field errors (FastAPI's list) for an invalid body, or one message for a checkpoint or
    shape Kiln cannot handle."""

    detail: str | list[dict[str, Any]]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str]
