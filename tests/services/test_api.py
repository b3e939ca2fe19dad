"""REST API over real HTTP (uvicorn on loopback) against PostgreSQL, Redis and the S3 test server.

No worker consumes this test's queue, so submitted jobs stay queued: these tests pin the API's own
behaviour (auth, validation, limits, idempotency, pagination, cancellation, health, CORS).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from devtools.builders.synthetic import write_checkpoint
from services.api.app import create_app
from services.settings import ServiceSettings as Settings
from tests.services.conftest import create_token, free_port, make_settings

MAX_BODY = 4096


@pytest.fixture
def settings(services_env: dict[str, str]) -> Settings:
    return make_settings({**services_env, "KILN_MAX_REQUEST_BYTES": str(MAX_BODY)})


@pytest.fixture
def base_url(settings: Settings, serve_app: Callable[..., str]) -> str:
    return serve_app(create_app(settings))


@pytest.fixture
def client(base_url: str, settings: Settings) -> Iterator[httpx.Client]:
    token = create_token(settings)
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        yield c


def body(source: str = "s3://checkpoints/tiny", targets: list[str] | None = None) -> dict:
    return {"source": source, "targets": targets or ["cpu"], "method": "auto", "tp": 1}


def test_auth_401_without_or_with_a_bad_token_and_403_for_non_admins(
    base_url: str, client: httpx.Client, settings: Settings
) -> None:
    anon = httpx.get(f"{base_url}/v1/conversions")
    assert anon.status_code == 401 and anon.headers["www-authenticate"] == "Bearer"
    bad = httpx.get(f"{base_url}/v1/artifacts", headers={"Authorization": "Bearer kiln_wrong"})
    assert bad.status_code == 401 and "invalid" in bad.json()["detail"]
    assert client.get("/v1/artifacts").status_code == 200
    assert client.delete("/v1/artifacts/ka-0123").status_code == 403
    admin = create_token(settings, admin=True)
    r = httpx.delete(f"{base_url}/v1/artifacts/ka-0123", headers={"Authorization": f"Bearer {admin}"})
    assert r.status_code == 404


def test_422_names_the_field(client: httpx.Client) -> None:
    r = client.post("/v1/conversions", json=body(targets=["sm99"]))
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "targets", 0]
    r = client.post("/v1/conversions", json={"targets": ["cpu"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "source"]
    r = client.post("/v1/conversions", json=body(source="relative/dir"))
    assert r.status_code == 422
    err = r.json()["detail"][0]
    assert err["loc"] == ["body", "source"] and "absolute server path" in err["msg"]
    r = client.post("/v1/conversions", json={**body(), "tp": 0})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "tp"]


def test_oversized_bodies_get_413(client: httpx.Client) -> None:
    big = {**body(), "options": {"fp8_scheme": "tensor", "disabled_kernels": ["x" * 60] * 100}}
    assert client.post("/v1/conversions", json=big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while streaming
        yield b'{"source": "s3://b/x", "targets": ["cpu"], "pad": "'
        for _ in range(10):
            yield b"y" * 1024
        yield b'"}'

    r = client.post("/v1/conversions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_idempotency_key_and_identical_requests(client: httpx.Client) -> None:
    r1 = client.post("/v1/conversions", json=body("s3://b/idem"), headers={"Idempotency-Key": "key-1"})
    assert r1.status_code == 202
    job = r1.json()
    assert r1.headers["location"] == f"/v1/conversions/{job['id']}" and job["status"] == "queued"
    r2 = client.post("/v1/conversions", json=body("s3://b/idem"), headers={"Idempotency-Key": "key-1"})
    assert r2.status_code == 202 and r2.json()["id"] == job["id"]
    r3 = client.post("/v1/conversions", json=body("s3://b/other"), headers={"Idempotency-Key": "key-1"})
    assert r3.status_code == 409 and "key-1" in r3.json()["detail"]
    r4 = client.post("/v1/conversions", json=body("s3://b/idem"))  # no key, identical request
    assert r4.json()["id"] == job["id"]
    assert client.get(job_url := r1.headers["location"]).json()["id"] == job["id"]
    assert job_url.startswith("/v1/conversions/")


def test_cursor_pagination_and_filters(client: httpx.Client) -> None:
    created = [client.post("/v1/conversions", json=body(f"s3://b/page-{i}")).json()["id"] for i in range(7)]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/conversions", params=params).json()
        seen += [j["id"] for j in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3 and seen == sorted(created, reverse=True)  # newest first, no gaps or repeats
    one = client.get("/v1/conversions", params={"source": "s3://b/page-4"}).json()["items"]
    assert [j["id"] for j in one] == [created[4]]
    client.post(f"/v1/conversions/{created[0]}/cancel")
    cancelled = client.get("/v1/conversions", params={"status": "cancelled"}).json()["items"]
    assert [j["id"] for j in cancelled] == [created[0]]
    assert client.get("/v1/conversions", params={"cursor": "nope"}).status_code == 422


def test_cancel_a_queued_job(client: httpx.Client) -> None:
    job = client.post("/v1/conversions", json=body("s3://b/cancel-me")).json()
    r = client.post(f"/v1/conversions/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert client.get(f"/v1/conversions/{job['id']}").json()["status"] == "cancelled"
    assert client.post(f"/v1/conversions/{job['id']}/cancel").status_code == 200  # idempotent
    assert client.post("/v1/conversions/job-missing/cancel").status_code == 404
    # A cancelled request may be submitted again: it gets a new job.
    again = client.post("/v1/conversions", json=body("s3://b/cancel-me")).json()
    assert again["id"] != job["id"] and again["status"] == "queued"


def test_health_metrics_openapi(client: httpx.Client, base_url: str) -> None:
    h = httpx.get(f"{base_url}/health")
    assert h.status_code == 200 and h.json()["checks"] == {"db": "ok", "broker": "ok", "store": "ok"}
    client.get("/v1/artifacts")
    m = httpx.get(f"{base_url}/metrics").text
    assert 'kiln_api_requests_total{method="GET",route="/v1/artifacts",status="200"}' in m
    assert "kiln_jobs{" in m
    paths = httpx.get(f"{base_url}/openapi.json").json()["paths"]
    assert {"/v1/conversions", "/v1/conversions/{job_id}/cancel", "/v1/artifacts/{artifact_id}"} <= set(paths)


def test_health_names_what_is_down(settings: Settings, serve_app: Callable[..., str]) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    url = serve_app(create_app(settings.model_copy(update={"broker_url": dead})))
    h = httpx.get(f"{url}/health", timeout=30)
    assert h.status_code == 503
    checks = h.json()["checks"]
    assert checks["db"] == "ok" and checks["store"] == "ok" and checks["broker"].startswith("down")


def test_cors_off_unless_configured(settings: Settings, base_url: str, serve_app: Callable[..., str]) -> None:
    origin = {"Origin": "https://ui.example", "Access-Control-Request-Method": "GET"}
    r = httpx.options(f"{base_url}/v1/artifacts", headers=origin)
    assert "access-control-allow-origin" not in r.headers
    url = serve_app(create_app(settings.model_copy(update={"cors_origins": ["https://ui.example"]})))
    r = httpx.options(f"{url}/v1/artifacts", headers=origin)
    assert r.headers["access-control-allow-origin"] == "https://ui.example"


def test_plans_show_the_conversion_without_queueing_it(
    client: httpx.Client, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    r = client.post("/v1/plans", json=body(str(tiny_checkpoint), ["sm80", "cpu"]) | {"tp": 2})
    assert r.status_code == 200, r.text
    plans = r.json()["plans"]
    assert [p["target"] for p in plans] == ["cpu", "sm80"] and all(p["tp"] == 2 for p in plans)
    cpu = plans[0]
    qkv = next(row for row in cpu["layers"] if row["layer"] == "model.layers.0.self_attn.qkv_proj")
    assert qkv["kernel"] == "dense" and qkv["shards"][0] == "model.layers.0.self_attn.q_proj"
    assert all(rej["reason"] for row in cpu["layers"] for rej in row["rejections"])
    size = cpu["expected_bytes"]
    assert len(size["per_rank"]) == 2 and size["total"] == sum(size["per_rank"]) > 0
    assert client.get("/v1/conversions").json()["items"] == []  # nothing queued

    disabled = body(str(tiny_checkpoint), ["cpu"]) | {"options": {"disabled_kernels": ["dense"]}}
    r = client.post("/v1/plans", json=disabled)
    assert r.status_code == 422 and "no kernel" in r.json()["detail"] and "dense" in r.json()["detail"]

    gemv = write_checkpoint(tmp_path / "awq-gemv", "awq")
    config = json.loads((gemv / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (gemv / "config.json").write_text(json.dumps(config))
    r = client.post("/v1/plans", json=body(str(gemv)))
    assert r.status_code == 422 and "GEMV" in r.json()["detail"].upper()

    r = client.post("/v1/plans", json=body(str(tmp_path / "nowhere")))
    assert r.status_code == 404 and "no checkpoint at this path" in r.json()["detail"], r.text
    r = client.post("/v1/plans", json=body("s3://no-such-bucket/model"))
    assert r.status_code == 404 and "does not exist" in r.json()["detail"], r.text
    r = client.post("/v1/plans", json=body(str(tmp_path)))
    assert r.status_code == 404 and "config.json" in r.json()["detail"]
    r = client.post("/v1/plans", json=body("relative/path"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "source"]


def test_plans_need_a_token(base_url: str, tiny_checkpoint: Path) -> None:
    assert httpx.post(f"{base_url}/v1/plans", json=body(str(tiny_checkpoint))).status_code == 401
