"""The one boto3 S3 client factory: used by `kiln pull` and by the services' S3 store and sources."""

from __future__ import annotations

from typing import Any

from runtime.settings import RuntimeSettings


def make_client(settings: RuntimeSettings, *, max_pool_connections: int | None = None) -> Any:
    """A boto3 S3 client configured from settings (endpoint, credentials, region, retries; path-style
    addressing, which MinIO and AWS both serve). `max_pool_connections` sizes the HTTP pool for
    callers that issue many concurrent requests (parallel ranged GETs)."""
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {
        "region_name": settings.s3_region,
        "retries": {"max_attempts": settings.s3_max_attempts, "mode": "standard"},
        "s3": {"addressing_style": "path"},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }
    if max_pool_connections is not None:
        options["max_pool_connections"] = max_pool_connections
    return boto3.session.Session().client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=settings.s3_secret_access_key,
        region_name=settings.s3_region,
        config=Config(**options),
    )
