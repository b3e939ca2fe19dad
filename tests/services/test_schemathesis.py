"""Property-based API fuzzing: schemathesis (bounded, seeded) against the served OpenAPI document.

Runs the schemathesis CLI against uvicorn on loopback with a valid token and every check enabled;
the run must find no server error (5xx) and no response that contradicts the document. A second run
splices what a schema cannot describe (NaN, Infinity, lone surrogates, wrong-typed scalars) into
schema-generated bodies: each must be a 4xx with compliant JSON on a connection that stays usable.
"""

from __future__ import annotations

import copy
import http.client
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args
from urllib.parse import urlsplit

import hypothesis
import pytest
from hypothesis import strategies as st

from services.api.app import create_app
from services.convert.spec import ConversionOptions
from tests.services.conftest import create_token, make_settings

MAX_EXAMPLES = 25
SEED = 1


def test_schemathesis_finds_no_server_errors(
    services_env: dict[str, str], serve_app: Callable[..., str], tmp_path: Path
) -> None:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(exe).exists():
        pytest.skip("schemathesis is not installed")
    settings = make_settings(services_env)
    url = serve_app(create_app(settings))
    token = create_token(settings, admin=True)
    cmd = [
        exe, "run", f"{url}/openapi.json",
        "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--checks", "all", "--workers", "1",
        "-H", f"Authorization: Bearer {token}", "--no-color",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert "Server error" not in report and " 500 " not in report, report[-6000:]
    assert out.returncode == 0, report[-6000:]


# Values JSON parsers accept but JSON cannot carry back (NaN, ±Infinity, lone surrogates), and a
# boolean: spliced into schema-generated request bodies in place of any value (the boolean not in
# place of the options that take one).
POISON = ["NaN", "Infinity", "-Infinity", "1e400", '"\\ud800"', '"ok\\udfff"', '"\\ud83d"', "true"]
SENTINEL = "__kiln_poison__"
BOOLEAN_OPTIONS = {
    name
    for name, field in ConversionOptions.model_fields.items()
    if field.annotation is bool or bool in get_args(field.annotation)
}


def _slots(value: object) -> list[tuple[dict | list, str | int]]:
    """Every place a value sits in a JSON document (dict entries and list items), depth first."""
    found: list[tuple[dict | list, str | int]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found.append((value, key))
            found.extend(_slots(item))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.append((value, i))
            found.extend(_slots(item))
    return found


def poisoned(body: object, poison: str, pick: int) -> tuple[str, str | int]:
    """`body` as JSON text with one value (or a new unknown field) replaced by the raw `poison`, and
    the key it replaced."""
    doc = copy.deepcopy(body) if isinstance(body, dict) else {}
    slots = [*_slots(doc), (doc, "unknown_field")]
    container, key = slots[pick % len(slots)]
    container[key] = SENTINEL  # type: ignore[index]
    return json.dumps(doc).replace(json.dumps(SENTINEL), poison), key


def _refuse_constant(name: str) -> None:
    raise ValueError(f"response carries the non-JSON constant {name}")


def post_then_get(url: str, token: str, raw: str) -> tuple[int, bytes]:
    """POST a raw JSON body, then GET on the same keep-alive connection, which must still serve it."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    conn.auto_open = 0  # a connection the server dropped fails the GET instead of reopening
    auth = {"Authorization": f"Bearer {token}"}
    try:
        conn.connect()
        conn.request(
            "POST", "/v1/conversions", body=raw.encode(), headers={**auth, "Content-Type": "application/json"}
        )
        r = conn.getresponse()
        status, data = r.status, r.read()
        conn.request("GET", "/v1/conversions?limit=1", headers=auth)
        follow_up = conn.getresponse()
        follow_up.read()
        assert follow_up.status == 200, f"the request after {raw!r} got {follow_up.status}"
    finally:
        conn.close()
    return status, data


def test_schemathesis_bodies_with_non_json_values_never_get_a_5xx(
    services_env: dict[str, str], serve_app: Callable[..., str]
) -> None:
    """POST /v1/conversions with schema-generated bodies, one value swapped for a poison: always a
    4xx with a strictly JSON-compliant body, and the keep-alive connection keeps working."""
    schemathesis = pytest.importorskip("schemathesis")
    settings = make_settings(services_env)
    url = serve_app(create_app(settings))
    token = create_token(settings)
    cases = schemathesis.openapi.from_url(f"{url}/openapi.json")["/v1/conversions"]["POST"].as_strategy()

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES * 4, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )  # fmt: skip
    @hypothesis.given(case=cases, poison=st.sampled_from(POISON), pick=st.integers(min_value=0, max_value=64))
    def post(case: object, poison: str, pick: int) -> None:
        raw, key = poisoned(getattr(case, "body", None), poison, pick)
        hypothesis.assume(not (poison == "true" and key in BOOLEAN_OPTIONS))  # a valid value there
        status, data = post_then_get(url, token, raw)
        assert 400 <= status < 500, (raw, status, data[:500])
        json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)

    post()
