"""Security regressions of the REST API (issue findings 3, 5 and 6), over real HTTP against
PostgreSQL, Redis and the S3 test server, plus the job runner and `kiln api` start-up in-process.

- Request data never causes a 5xx: NaN / Infinity and lone surrogates are a 422 with a clear,
  strictly JSON-compliant message, and the keep-alive connection stays usable.
- Inputs are strict: `tp: true` / `"2"` are refused; `..` segments in sources are refused up front.
- Nothing leaks: credentials in logged URLs are redacted; unauthenticated /health shows component
  status only; a store outage is a 503; job errors for server-local sources neither tell a missing
  directory from an existing one nor describe any server path but the one submitted.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from services.api.app import create_app
from services.db import migrate
from services.db.models import Artifact
from services.db.session import session_scope
from services.redact import NO_LOCAL_CHECKPOINT, redact_text, redact_url
from services.settings import ServiceSettings as Settings
from tests.services.conftest import REPO, create_token, failed_job_error, free_port, make_settings

pytestmark = pytest.mark.services

VALID = '"source": "s3://b/x", "targets": ["cpu"]'


@pytest.fixture
def settings(services_env: dict[str, str]) -> Settings:
    return make_settings(services_env)


@pytest.fixture
def base_url(settings: Settings, serve_app: Callable[..., str]) -> str:
    return serve_app(create_app(settings))


@pytest.fixture
def token(settings: Settings) -> str:
    return create_token(settings)


def _strict_json(data: bytes) -> object:
    """Parse as a strict client would: UTF-8 only, no NaN / Infinity constants."""

    def refuse(name: str) -> None:
        raise ValueError(f"non-compliant JSON constant {name}")

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def _post_then_get(base_url: str, token: str, raw: str | bytes) -> tuple[int, object]:
    """POST a raw JSON body, then GET on the same keep-alive connection (which must still work)."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    conn.auto_open = 0  # a connection the server dropped must fail the second request, not reopen
    conn.connect()
    auth = {"Authorization": f"Bearer {token}"}
    try:
        conn.request(
            "POST",
            "/v1/conversions",
            body=raw.encode() if isinstance(raw, str) else raw,
            headers={**auth, "Content-Type": "application/json"},
        )
        first = conn.getresponse()
        status, body = first.status, _strict_json(first.read())
        assert first.getheader("connection", "").lower() != "close"
        conn.request("GET", "/v1/conversions?limit=1", headers=auth)
        second = conn.getresponse()
        second.read()
        assert second.status == 200
    finally:
        conn.close()
    return status, body


# --- finding 3: 5xx from request data -----------------------------------------------------------


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    "raw",
    [
        "{" + VALID + ', "tp": %s}',
        "{" + VALID + ', "options": {"fp8_scheme": %s}}',
        '{"source": "s3://b/x", "targets": [%s]}',
        "{" + VALID + ', "unknown": %s}',
    ],
    ids=["tp", "options", "targets", "unknown-field"],
)
def test_non_finite_numbers_are_a_422_and_keep_the_connection(
    base_url: str, token: str, raw: str, constant: str
) -> None:
    status, body = _post_then_get(base_url, token, raw % constant)
    assert status == 422, body
    assert isinstance(body, dict) and body["detail"][0]["loc"][0] == "body"
    assert body["detail"][0]["input"] == constant  # echoed as a string, never as a bare constant


@pytest.mark.parametrize(
    ("raw", "loc"),
    [
        ('{"source": "s3://b/x\\ud800", "targets": ["cpu"]}', ["body", "source"]),
        ('{"source": "/data/\\udfff", "targets": ["cpu"]}', ["body", "source"]),
        ('{"source": "s3://b/x", "targets": ["\\ud800"]}', ["body", "targets"]),
        (
            "{" + VALID + ', "options": {"disabled_kernels": ["dense", "\\ud83d"]}}',
            ["body", "options", "disabled_kernels"],
        ),
        ("{" + VALID + ', "method": "\\ud800"}', ["body", "method"]),
    ],
    ids=["s3-source", "local-source", "targets", "disabled_kernels", "method"],
)
def test_lone_surrogates_are_a_422_naming_the_field(
    base_url: str, token: str, raw: str, loc: list[str]
) -> None:
    status, body = _post_then_get(base_url, token, raw)
    assert status == 422, body
    assert isinstance(body, dict)
    [err] = body["detail"]
    assert err["loc"] == loc and "lone UTF-16 surrogate" in err["msg"] and "valid UTF-8" in err["msg"]


def test_a_lone_surrogate_in_a_field_name_is_a_422(base_url: str, token: str) -> None:
    status, body = _post_then_get(base_url, token, "{" + VALID + ', "\\ud800": 1}')
    assert status == 422 and isinstance(body, dict)
    assert body["detail"] and all(err["loc"][0] == "body" for err in body["detail"])


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"\xef\xbf", b'{"source": "\xc3(", "targets": ["cpu"]}'])
def test_a_body_that_is_not_utf8_is_a_422_not_an_undocumented_400(
    base_url: str, token: str, raw: bytes
) -> None:
    """Schemathesis' stateful phase found FastAPI's own 400 ("There was an error parsing the body"),
    which the OpenAPI document does not list, for a body that does not decode."""
    status, body = _post_then_get(base_url, token, raw)
    assert status == 422, body
    assert isinstance(body, dict) and body["detail"][0]["loc"][0] == "body"


@pytest.mark.parametrize("job_id", ["%00", "%ED%A0%80", "x%20y"])
def test_odd_job_ids_are_4xx(base_url: str, token: str, job_id: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{base_url}/v1/conversions/{job_id}", headers=auth).status_code in (404, 422)
    assert httpx.post(f"{base_url}/v1/conversions/{job_id}/cancel", headers=auth).status_code in (404, 422)


# --- finding 6: lax inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("tp", ["true", '"2"', "2.5", "false", "[2]"])
def test_tp_must_be_a_json_integer(base_url: str, token: str, tp: str) -> None:
    status, body = _post_then_get(base_url, token, "{" + VALID + f', "tp": {tp}}}')
    assert status == 422 and isinstance(body, dict)
    assert body["detail"][0]["loc"] == ["body", "tp"] and "valid integer" in body["detail"][0]["msg"]


def test_tp_written_as_a_whole_float_is_still_a_json_integer(base_url: str, token: str) -> None:
    """JSON Schema counts 2.0 as an integer (schemathesis sends it as valid data)."""
    r = httpx.post(
        f"{base_url}/v1/conversions",
        json={"source": "s3://b/tp-float", "targets": ["cpu"], "tp": 2.0},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 202 and r.json()["tp"] == 2


# --- finding 5: leaks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("s3://b/../x", "'..'"),
        ("s3://b/models/../../other/x", "'..'"),
        ("s3://b/./x", "'..'"),
        ("s3://b/a//x", "'..'"),
        ("/data/../etc", "'..'"),
        ("s3://../x", "s3://bucket/prefix"),  # a bucket name starts with a letter or digit
    ],
)
def test_dot_dot_and_empty_segments_in_sources_are_refused_up_front(
    base_url: str, token: str, source: str, says: str
) -> None:
    r = httpx.post(
        f"{base_url}/v1/conversions",
        json={"source": source, "targets": ["cpu"]},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == ["body", "source"] and says in err["msg"]


def test_redaction_helpers() -> None:
    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert (
        redact_url("postgresql+psycopg://kiln:pw@db:5432/kiln")
        == "postgresql+psycopg://kiln:***@db:5432/kiln"
    )
    assert redact_url("http://minio:9000") == "http://minio:9000"
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    signed = redact_url("http://h/k?X-Amz-Signature=abc&X-Amz-Credential=AKIA%2Fx&partNumber=1")
    assert "abc" not in signed and "AKIA" not in signed and "partNumber=1" in signed
    text = redact_text('Error connecting to "redis://user:hunter2@10.0.0.5:6379/0": refused')
    assert "hunter2" not in text and "redis://user:***@10.0.0.5:6379/0" in text


def test_kiln_api_start_up_line_redacts_the_broker_password(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "COLUMNS": "400",
        "KILN_DATA_DIR": str(tmp_path / "var"),
        "KILN_BROKER_URL": f"redis://:hunter2-pw@127.0.0.1:{free_port()}/0",
    }
    cmd = [sys.executable, "-m", "services.cli", "api", "--port", str(free_port())]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        banner = ""
        deadline = time.monotonic() + 60
        while "kiln api on" not in banner and time.monotonic() < deadline and proc.stderr is not None:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            banner = line if "kiln api on" in line else banner
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert "kiln api on" in banner and "celery on redis://:***@127.0.0.1" in banner, banner
    assert "hunter2" not in banner


@pytest.fixture
def dead_store_settings(services_env: dict[str, str]) -> Settings:
    dead = f"http://127.0.0.1:{free_port()}"
    return make_settings({**services_env, "KILN_S3_ENDPOINT_URL": dead, "KILN_S3_MAX_ATTEMPTS": "1"})


def test_health_shows_details_only_to_authenticated_callers(
    dead_store_settings: Settings, serve_app: Callable[..., str]
) -> None:
    url = serve_app(create_app(dead_store_settings))
    endpoint = dead_store_settings.s3_endpoint_url or ""
    store_url = dead_store_settings.resolved_store_url  # s3://bucket/prefix
    anon = httpx.get(f"{url}/health", timeout=30)
    assert anon.status_code == 503
    assert anon.json() == {"status": "unavailable", "checks": {"db": "ok", "broker": "ok", "store": "down"}}
    bucket, prefix = store_url.removeprefix("s3://").split("/", 1)
    for secret in (endpoint, str(urlsplit(endpoint).port), bucket, prefix):
        assert secret not in anon.text
    bad = httpx.get(f"{url}/health", headers={"Authorization": "Bearer kiln_wrong"}, timeout=30)
    assert bad.json() == anon.json()

    token = create_token(dead_store_settings)
    detailed = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
    assert detailed["checks"]["store"].startswith("down: ") and len(detailed["checks"]["store"]) > len(
        "down: "
    )


def _insert_artifact(settings: Settings, aid: str) -> None:
    with session_scope(settings) as s:
        s.add(
            Artifact(
                id=aid, model="tiny", architecture="LlamaForCausalLM", source_uri="s3://b/tiny",
                source_digest="0" * 64, source_format="safetensors", target="cpu", tp=1, method="auto",
                uri=f"s3://b/artifacts/{aid}", size_bytes=1, manifest={}, job_id=None, files=[],
            )
        )  # fmt: skip


def test_artifact_reads_and_deletes_are_503_while_the_store_is_down(
    dead_store_settings: Settings, serve_app: Callable[..., str]
) -> None:
    url = serve_app(create_app(dead_store_settings))
    aid = "ka-" + "1" * 32
    _insert_artifact(dead_store_settings, aid)
    user = {"Authorization": f"Bearer {create_token(dead_store_settings)}"}
    admin = {"Authorization": f"Bearer {create_token(dead_store_settings, admin=True)}"}
    for r in (
        httpx.get(f"{url}/v1/artifacts/{aid}", headers=user, timeout=30),
        httpx.delete(f"{url}/v1/artifacts/{aid}", headers=admin, timeout=30),
    ):
        assert r.status_code == 503, r.text
        assert "artifact store is unavailable" in r.json()["detail"] and int(r.headers["retry-after"]) > 0
        assert str(urlsplit(dead_store_settings.s3_endpoint_url or "").port) not in r.text
    assert httpx.get(f"{url}/v1/artifacts", headers=user, timeout=30).json()["items"][0]["id"] == aid


@pytest.fixture
def embedded_settings(tmp_path: Path) -> Settings:
    settings = Settings(_env_file=None, data_dir=tmp_path / "var", environment="development")  # type: ignore[call-arg]
    migrate.upgrade(settings.resolved_database_url)
    return settings


def test_local_source_errors_do_not_map_the_server_filesystem(
    embedded_settings: Settings, tmp_path: Path
) -> None:
    """Missing, a file, an empty directory, a directory that is not a checkpoint, /proc/self/cwd
    (the server's working directory): one message, naming only the submitted path."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "not-a-checkpoint" / "notes.txt").write_text("not weights")
    sources = [
        str(tmp_path / "missing"),
        str(tmp_path / "a-file"),
        str(tmp_path / "empty"),
        str(tmp_path / "not-a-checkpoint"),
        "/proc/self/cwd",
        "/proc/self/root/etc",
    ]
    errors = {src: failed_job_error(embedded_settings, src) for src in sources}
    assert {err.replace(repr(src), "<source>") for src, err in errors.items()} == {
        f"source <source>: {NO_LOCAL_CHECKPOINT}"
    }, errors
    for err in errors.values():
        assert os.getcwd() not in err


def test_symlinks_out_of_a_local_checkpoint_are_refused_without_naming_their_target(
    embedded_settings: Settings, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in tiny_checkpoint.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    secret = tmp_path / "elsewhere" / "server-secret.json"
    secret.parent.mkdir()
    secret.write_text("{}")
    (ckpt / "tokenizer.json").unlink(missing_ok=True)
    (ckpt / "tokenizer.json").symlink_to(secret)
    via_proc = f"/proc/self/root{ckpt}"
    error = failed_job_error(embedded_settings, via_proc)
    assert "outside the checkpoint directory" in error and via_proc in error, error
    assert (
        str(secret) not in error and "elsewhere" not in error and str(ckpt) not in error.replace(via_proc, "")
    )
