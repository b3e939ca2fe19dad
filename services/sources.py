"""Which checkpoint sources a caller may name: one policy for POST /v1/conversions, POST /v1/plans
and the worker that runs the job (which checks again: the deployment's settings may have changed
since the job was queued).

- `s3://bucket/prefix`: the server reads it with its own S3 credentials, so only from buckets the
  deployment lists: the artifact store's bucket plus `KILN_SOURCE_BUCKETS` (comma-separated; `*`:
  any bucket the credentials reach, the behaviour before the list existed). A token created with
  `kiln admin create-token --source-buckets a,b` is narrowed further to those buckets (it can
  never widen the deployment's list).
- A server-local path: only when `KILN_ALLOW_LOCAL_SOURCES` allows it (default: outside
  production), and only absolute.
- Any other scheme is refused.

A refusal names the source and the setting, never which buckets are allowed.
"""

from __future__ import annotations

from collections.abc import Collection

from services.settings import ServiceSettings

ANY_BUCKET = "*"


def _bucket(source: str) -> str:
    return source.removeprefix("s3://").partition("/")[0]


def allowed_buckets(
    settings: ServiceSettings, token_buckets: Collection[str] | None = None
) -> set[str] | None:
    """The buckets a caller with `token_buckets` (None: not narrowed) may read; None: any bucket."""
    listed = set(settings.source_buckets)
    deployment: set[str] | None
    if ANY_BUCKET in listed:
        deployment = None
    else:
        store = settings.resolved_store_url
        deployment = listed | ({_bucket(store)} if store.startswith("s3://") else set())
    if token_buckets is None:
        return deployment
    narrowed = set(token_buckets)
    return narrowed if deployment is None else deployment & narrowed


def source_problem(
    source: str, settings: ServiceSettings, token_buckets: Collection[str] | None = None
) -> str | None:
    """Why `source` may not be read for this caller, or None when it may."""
    if source.startswith("s3://"):
        allowed = allowed_buckets(settings, token_buckets)
        if allowed is not None and _bucket(source) not in allowed:
            return (
                f"source {source!r}: this server does not read checkpoints from bucket "
                f"{_bucket(source)!r} (KILN_SOURCE_BUCKETS, and the token's --source-buckets); "
                "upload the checkpoint to an allowed bucket or ask the operator"
            )
        return None
    if "://" in source:
        return f"source {source!r}: unsupported scheme; use s3://bucket/prefix"
    allowed_local = settings.allow_local_sources
    if allowed_local is None:
        allowed_local = settings.environment != "production"
    if not allowed_local:
        return f"source {source!r}: server-local paths are disabled (KILN_ALLOW_LOCAL_SOURCES); use s3://"
    if not source.startswith("/"):
        return f"source {source!r}: a server-local path must be absolute"
    return None
