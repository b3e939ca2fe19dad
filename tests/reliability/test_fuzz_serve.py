"""Fuzzing `kiln serve` over HTTP (bounded, derandomized): request bodies built from valid ones with
hostile values spliced in — NaN / ±Infinity, lone UTF-16 surrogates, integers past 64 bits, booleans
where numbers are expected, wrong types, deep nesting — never get a 5xx, and the keep-alive
connection keeps working after each. The sampling parameters over their full accepted ranges
(subnormal temperatures and top_p included) never fail a request or the server, and schemathesis,
driven by the served OpenAPI document, finds no server error."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from devtools.builders.tiny_artifacts import VOCAB_SIZE, tiny_hf_model, write_artifact
from runtime.sampling import MAX_LOGPROBS, SAMPLING_EPS, SEED_MAX, SEED_MIN
from tests.reliability.fuzz_targets import fuzz_settings
from tests.runtime.serving import RunningServer, serve_artifact

pytestmark = pytest.mark.timeout(300)

FUZZ = fuzz_settings(150, HealthCheck.function_scoped_fixture)
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0.0, "seed": 1, "logprobs": 1},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "top_p": 0.9,
        "stop": ["x"],
    },
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = (
    "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "logprobs", "echo", "stream", "stream_options", "min_tokens", "n", "model", "role", "content", "tokens",
    "top_logprobs", "max_completion_tokens", "logit_bias", "ignore_eos",
)  # fmt: skip
HOSTILE: list[Any] = [
    math.nan, math.inf, -math.inf, 2**64, -(2**63) - 1, 2**200, True, False, None, "", "\ud800", "a\udfff",
    [True], [[True]], [-1], [2**64], {"\ud800": 1}, [["x"]], {}, [], "x" * 5000, 1e308, -0.0, [None],
    [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": "\ud83d"}],
    [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}], [[[[[[[[[[1]]]]]]]]]],
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    artifact: Path = write_artifact(tiny_hf_model("smollm2", seed=3), tmp_path_factory.mktemp("fuzz-serve"))
    with serve_artifact(artifact, max_model_len=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c


def _splice(body: Any, path: list[int], key: str, value: Any) -> Any:
    """Put `value` under `key` in one of the body's objects (chosen by `path`)."""
    objects: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            objects.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(body)
    target = objects[path[0] % len(objects)]
    target[key] = copy.deepcopy(value)  # a shared object spliced into itself would make a cycle
    return body


@FUZZ
@given(
    endpoint=st.sampled_from(sorted(BASES)),
    edits=st.lists(
        st.tuples(
            st.lists(st.integers(0, 7), min_size=1, max_size=1),
            st.sampled_from(FIELDS),
            st.sampled_from(HOSTILE),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_serve_never_answers_5xx_to_hostile_bodies(
    client: httpx.Client, endpoint: str, edits: list[tuple[list[int], str, Any]]
) -> None:
    body = json.loads(json.dumps(BASES[endpoint]))
    for path, key, value in edits:
        body = _splice(body, path, key, value)
    # allow_nan: NaN / Infinity go on the wire as the bare tokens Python's json (and many clients) emit.
    raw = json.dumps(body, allow_nan=True)
    r = client.post(endpoint, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (endpoint, raw[:300], r.text[:500])
    assert client.get("/health").status_code == 200


# The sampling parameters over their whole accepted ranges, edges and subnormals weighted in.
TINY_FLOATS = [0.0, 5e-324, 1e-320, 1e-45, 1e-30, SAMPLING_EPS / 2, SAMPLING_EPS, 1e-3]
temperature = st.one_of(st.sampled_from([*TINY_FLOATS, 2.0]), st.floats(0.0, 2.0, allow_subnormal=True))
top_p = st.one_of(
    st.sampled_from([*TINY_FLOATS[1:], 1.0]), st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True)
)


@FUZZ
@given(
    temperature=temperature,
    top_p=top_p,
    top_k=st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB_SIZE, 2**31]), st.integers(-1, 2**63)),
    min_tokens=st.integers(0, 3),
    stop_token_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB_SIZE + 5), max_size=8)),
    seed=st.one_of(st.none(), st.sampled_from([SEED_MIN, SEED_MAX, 0])),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    stream=st.booleans(),
)
def test_sampling_parameters_over_their_full_ranges_never_fail_the_server(
    client: httpx.Client,
    temperature: float,
    top_p: float,
    top_k: int,
    min_tokens: int,
    stop_token_ids: list[int] | None,
    seed: int | None,
    logprobs: int | None,
    stream: bool,
) -> None:
    body: dict[str, Any] = {
        "prompt": "Hello", "max_tokens": 3, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "min_tokens": min_tokens, "stop_token_ids": stop_token_ids, "seed": seed, "logprobs": logprobs,
        "stream": stream,
    }  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code < 500, (body, r.text[:500])
    if r.status_code == 200:
        assert '"error"' not in r.text, (body, r.text[:500])  # no stream ended by a failure
    else:
        assert r.json()["error"]["param"], (body, r.text)  # a 400 names the field
    assert client.get("/health").status_code == 200


def test_schemathesis_finds_no_server_errors_in_kiln_serve(server: RunningServer, tmp_path: Path) -> None:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    cmd = [
        exe, "run", f"{server.base_url}/openapi.json", "--max-examples", "40", "--seed", "1",
        "--checks", "not_a_server_error", "--workers", "1", "--no-color",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0 and "Server error" not in report, report[-6000:]
    assert client_ok(server.base_url)


def client_ok(base_url: str) -> bool:
    return httpx.get(f"{base_url}/health", timeout=10).status_code == 200
