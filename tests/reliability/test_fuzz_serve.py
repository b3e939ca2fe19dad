"""Fuzzing `kiln serve` over HTTP (bounded, derandomized): request bodies built from valid ones with
hostile values spliced in — NaN / ±Infinity, lone UTF-16 surrogates, integers past 64 bits, booleans
where numbers are expected, wrong types, deep nesting — never get a 5xx, and the keep-alive
connection keeps working after each."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from tests.reliability.fuzz_targets import fuzz_settings
from tests.runtime.artifact_factory import tiny_hf_model, write_artifact
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
