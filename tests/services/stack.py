"""A running service stack for tests: API (uvicorn, loopback) + Celery worker process + S3 + SQL."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx

from services.settings import ServiceSettings as Settings
from services.storage.s3 import S3Store
from tests.fixtures.s3 import S3_TEST_CREDENTIALS, S3_TEST_REGION
from tests.services.conftest import WorkerProcess


@dataclass
class Stack:
    settings: Settings
    api: httpx.Client
    admin: httpx.Client
    worker: WorkerProcess
    bucket: str

    def s3(self):  # type: ignore[no-untyped-def]
        key, secret = S3_TEST_CREDENTIALS
        return boto3.client(
            "s3",
            endpoint_url=self.settings.s3_endpoint_url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=S3_TEST_REGION,
        )

    def store(self) -> S3Store:
        return S3Store(self.settings.resolved_store_url, self.settings)

    def upload_checkpoint(self, local: Path, name: str) -> str:
        """Upload a checkpoint directory to s3://bucket/checkpoints/<name>; returns its URI."""
        client = self.s3()
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            client.upload_file(
                str(path), self.bucket, f"checkpoints/{name}/{path.relative_to(local).as_posix()}"
            )
        return f"s3://{self.bucket}/checkpoints/{name}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
