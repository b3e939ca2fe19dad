"""Security finding 10, over real HTTP against PostgreSQL and the S3 test server: a token reads
checkpoints only from buckets the deployment allows (the artifact store's bucket plus
KILN_SOURCE_BUCKETS), narrowed further per token (`--source-buckets`); the worker checks again
when it runs the job; and artifact download URLs expire after KILN_PRESIGNED_URL_TTL_S (default
300 s), which bounds how long a revoked token's URLs keep working.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import boto3
import httpx
import pytest

from services.api.app import create_app
from services.db import repo
from services.db.models import Artifact
from services.db.session import session_scope
from services.settings import ServiceSettings as Settings
from services.storage import open_store
from tests.fixtures.s3 import S3_TEST_CREDENTIALS, S3_TEST_REGION
from tests.services.conftest import create_token, failed_job_error, make_settings

pytestmark = pytest.mark.services

LISTED = "kiln-models"  # in KILN_SOURCE_BUCKETS
UNLISTED = "kiln-secrets"  # reachable with the server's credentials, but not listed


@pytest.fixture
def settings(services_env: dict[str, str]) -> Settings:
    return make_settings({**services_env, "KILN_SOURCE_BUCKETS": LISTED})


def _upload(s3_server: str, bucket: str, prefix: str, checkpoint: Path) -> str:
    key, secret = S3_TEST_CREDENTIALS
    client = boto3.client(
        "s3", endpoint_url=s3_server, aws_access_key_id=key, aws_secret_access_key=secret,
        region_name=S3_TEST_REGION,
    )  # fmt: skip
    if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)
    for f in checkpoint.iterdir():
        client.upload_file(str(f), bucket, f"{prefix}/{f.name}")
    return f"s3://{bucket}/{prefix}"


@pytest.fixture
def sources(s3_server: str, s3_bucket: str, tiny_checkpoint: Path) -> dict[str, str]:
    return {
        "store": _upload(s3_server, s3_bucket, "sources/tiny", tiny_checkpoint),
        "listed": _upload(s3_server, LISTED, "tiny", tiny_checkpoint),
        "unlisted": _upload(s3_server, UNLISTED, "tiny", tiny_checkpoint),
    }


def _plan(url: str, token: str, source: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/plans",
        json={"source": source, "targets": ["cpu"]},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def _refused(r: httpx.Response, bucket: str) -> bool:
    if r.status_code != 422:
        return False
    [err] = r.json()["detail"]
    return (
        err["loc"] == ["body", "source"]
        and f"bucket {bucket!r}" in err["msg"]
        and "KILN_SOURCE_BUCKETS" in err["msg"]
    )


def test_sources_come_only_from_the_store_bucket_and_listed_buckets(
    settings: Settings, serve_app: Callable[..., str], sources: dict[str, str]
) -> None:
    url = serve_app(create_app(settings))
    token = create_token(settings)
    assert _plan(url, token, sources["store"]).status_code == 200
    assert _plan(url, token, sources["listed"]).status_code == 200
    assert _refused(_plan(url, token, sources["unlisted"]), UNLISTED)
    # A bucket that does not exist gets the same answer: the refusal maps nothing.
    assert _refused(_plan(url, token, "s3://no-such-bucket/x"), "no-such-bucket")
    r = httpx.post(
        f"{url}/v1/conversions",
        json={"source": sources["unlisted"], "targets": ["cpu"]},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert _refused(r, UNLISTED)
    listing = httpx.get(f"{url}/v1/conversions", headers={"Authorization": f"Bearer {token}"}).json()
    assert listing["items"] == []  # nothing queued


def test_a_token_is_narrowed_to_its_own_buckets_and_cannot_widen_the_deployment(
    settings: Settings, serve_app: Callable[..., str], sources: dict[str, str]
) -> None:
    url = serve_app(create_app(settings))
    with session_scope(settings) as s:
        narrow, _ = repo.create_token(s, "narrow", source_buckets=[LISTED])
        wide, _ = repo.create_token(s, "wants-more", source_buckets=[UNLISTED])
    assert _plan(url, narrow, sources["listed"]).status_code == 200
    assert _refused(_plan(url, narrow, sources["store"]), settings.resolved_store_url[5:].split("/")[0])
    assert _refused(_plan(url, wide, sources["unlisted"]), UNLISTED)
    assert _refused(_plan(url, wide, sources["listed"]), LISTED)


def test_the_worker_refuses_a_queued_job_whose_bucket_is_no_longer_allowed(
    settings: Settings, sources: dict[str, str]
) -> None:
    """A job queued before the operator shortened KILN_SOURCE_BUCKETS is not run."""
    error = failed_job_error(settings, sources["unlisted"])
    assert f"bucket {UNLISTED!r}" in error and "KILN_SOURCE_BUCKETS" in error


def _committed_artifact(settings: Settings) -> str:
    aid = "ka-" + "7" * 32
    store = open_store(settings.resolved_store_url, settings)
    writer = store.begin(aid)
    writer.put_bytes("config.json", b"{}")
    writer.commit(json.dumps({"files": [{"name": "config.json"}]}).encode())
    with session_scope(settings) as s:
        s.add(
            Artifact(
                id=aid, model="tiny", architecture="LlamaForCausalLM", source_uri="s3://b/tiny",
                source_digest="0" * 64, source_format="safetensors", target="cpu", tp=1, method="auto",
                uri=store.uri(aid), size_bytes=2, manifest={}, job_id=None, files=[],
            )
        )  # fmt: skip
    return aid


def _expires_in(url: str) -> float:
    """Seconds from now until a presigned URL expires (SigV4 X-Amz-Expires or SigV2 Expires)."""
    query = parse_qs(urlsplit(url).query)
    if "X-Amz-Expires" in query:
        return float(query["X-Amz-Expires"][0])
    return float(query["Expires"][0]) - time.time()


def test_download_urls_expire_after_five_minutes_and_outlive_a_revocation_no_longer(
    settings: Settings, serve_app: Callable[..., str]
) -> None:
    """A presigned URL is a capability S3 honours until it expires, whoever fetched it: revoking the
    token stops the API at once (401) and its URLs within KILN_PRESIGNED_URL_TTL_S (300 s, was 3600).
    (The S3 test server does not enforce expiry; MinIO and AWS do.)"""
    assert settings.presigned_url_ttl_s == 300
    url = serve_app(create_app(settings))
    aid = _committed_artifact(settings)
    token = create_token(settings, name="leaving")
    auth = {"Authorization": f"Bearer {token}"}
    detail = httpx.get(f"{url}/v1/artifacts/{aid}", headers=auth).json()
    assert detail["urls_expire_in_s"] == 300
    assert all(290 <= _expires_in(u) <= 300 for u in detail["urls"].values()), detail["urls"]
    with session_scope(settings) as s:
        repo.revoke_tokens(s, name="leaving")
    time.sleep(settings.token_cache_s + 0.1)
    assert httpx.get(f"{url}/v1/artifacts/{aid}", headers=auth).status_code == 401
