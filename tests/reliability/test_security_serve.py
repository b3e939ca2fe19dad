"""Security of `kiln serve` (a real subprocess over HTTP): one client's request harms no one else.

- Degenerate sampling parameters (a subnormal temperature or top_p, stop_token_ids covering the
  vocabulary with min_tokens) are normalised or refused with a 400; the streams beside them finish.
- Prompts, messages, stop strings and ids to detokenize over their caps are refused before any
  tokenizing or searching; while a client sends such requests, /health answers within a second.
- `--api-key` guards every path but /health, /metrics and /version.
- A request body that stalls is a 408 and its connection is closed.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.builders.tiny_artifacts import VOCAB_SIZE, tiny_hf_model, write_artifact
from devtools.processes import Server
from runtime.request_limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, max_prompt_chars

pytestmark = [pytest.mark.timing, pytest.mark.timeout(600)]

MODEL = "tiny"
MAX_MODEL_LEN = 512  # the tiny config's max_position_embeddings
HEALTH_LIMIT_S = 1.0
API_KEY = "k3y-for-tests"
LONG = 400  # tokens of the innocent stream: long enough to share the batch with the hostile ones


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tiny_hf_model("llama"), tmp_path_factory.mktemp("security-serve"))


def _serve(artifact: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    env = {**os.environ, "KILN_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    args = ["serve", str(artifact), "--served-model-name", MODEL, "--device", "cpu", "--max-num-seqs", "8"]
    server = Server([*args, *extra], env, log)
    server.wait_ready(180)
    return server


@pytest.fixture(scope="module")
def url(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = _serve(artifact, tmp_path_factory.mktemp("serve-log") / "serve.log")
    try:
        yield server.url
    finally:
        server.stop()


class HealthWatch:
    """Polls /health from its own thread while the block runs; `worst` is the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert client.get(f"{self.url}/health").status_code == 200
                self.worst = max(self.worst, time.perf_counter() - start)
                self.polls += 1
                self._stop.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _stream(url: str, body: dict[str, Any], first_chunk: threading.Event | None = None) -> dict[str, Any]:
    """A streamed completion: its text, finish reason, error (if the stream carried one), tokens."""
    text, finish, error, tokens = "", None, None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.json()["error"]}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                error = event["error"]
                continue
            if first_chunk is not None:
                first_chunk.set()
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"status": 200, "text": text, "finish": finish, "error": error, "tokens": tokens}


def _innocent_beside(url: str, hostile: Callable[[], list[Any]]) -> tuple[dict[str, Any], list[Any], float]:
    """Run a long innocent stream and, once it produced its first chunk, the hostile calls; returns
    the innocent's outcome, the hostile results and the slowest /health answer meanwhile."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": LONG, "ignore_eos": True, "temperature": 0.7}
    first = threading.Event()
    with HealthWatch(url) as health, ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(_stream, url, {**body, "seed": 11}, first)
        assert first.wait(60)
        results = hostile()
        outcome = innocent.result(timeout=120)
    assert health.polls > 0
    return outcome, results, health.worst


DEGENERATE: list[dict[str, Any]] = [
    {"temperature": 1e-45},
    {"temperature": 5e-324, "top_p": 5e-324},
    {"temperature": 1.0, "top_p": 5e-324},
    {"temperature": 2.0, "top_p": 1e-300, "top_k": 1},
    {"temperature": 1e-300, "top_k": -1, "seed": -(2**63)},
    {"temperature": 1.0, "min_tokens": 5, "stop_token_ids": list(range(VOCAB_SIZE))},
]


def test_degenerate_sampling_parameters_harm_no_other_stream(url: str) -> None:
    def hostile() -> list[Any]:
        bodies = [
            {"model": MODEL, "prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, **p} for p in DEGENERATE
        ]
        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(lambda b: _stream(url, b), bodies))

    innocent, results, worst = _innocent_beside(url, hostile)
    assert innocent["error"] is None and innocent["finish"] == "length" and innocent["tokens"] == LONG, (
        innocent
    )
    for params, result in zip(DEGENERATE, results, strict=True):
        if "stop_token_ids" in params:  # no token could be generated: refused up front, naming why
            assert result["status"] == 400 and "stop_token_ids" in result["error"]["message"], result
        else:  # normalised: greedy, or the mode of a degenerate nucleus
            assert result["status"] == 200 and result["error"] is None and result["tokens"] == LONG, result
    assert worst < HEALTH_LIMIT_S, worst


def test_oversized_inputs_are_refused_before_any_work_and_never_stall_health(url: str) -> None:
    huge = "lorem ipsum " * 650_000  # 7.8 MB: under the 8 MiB body limit
    over = "x" * (max_prompt_chars(MAX_MODEL_LEN) + 1)
    calls: list[tuple[str, dict[str, Any], str]] = [
        ("/tokenize", {"prompt": huge}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", over], "max_tokens": 1}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": huge}]},
            "messages",
        ),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 5000}, "messages"),
        ("/detokenize", {"tokens": [1] * 1_500_000}, "tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": ["s" * 400] * 19_000}, "stop"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "stop": ["s" * (MAX_STOP_STRING_CHARS + 1)]},
            "stop",
        ),
    ]

    def hostile() -> list[Any]:
        answers = []
        with httpx.Client(timeout=120) as client:
            for path, body, _ in calls:
                start = time.perf_counter()
                r = client.post(f"{url}{path}", json=body)
                answers.append((r.status_code, r.json(), time.perf_counter() - start))
        return answers

    innocent, results, worst = _innocent_beside(url, hostile)
    assert innocent["error"] is None and innocent["tokens"] == LONG, innocent
    for (path, _, param), (status, body, _seconds) in zip(calls, results, strict=True):
        assert status == 400, (path, body)
        assert body["error"]["param"] == param and "at most" in body["error"]["message"], (path, body)
    assert worst < HEALTH_LIMIT_S, worst
    at_cap = "x" * max_prompt_chars(MAX_MODEL_LEN)
    r = httpx.post(f"{url}/tokenize", json={"prompt": at_cap}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > MAX_MODEL_LEN  # tokenized; the context check is later


def test_stop_strings_at_their_cap_cost_little(url: str) -> None:
    """The most stop strings a client may send, each as long as allowed and each nearly matching
    at every token: the request finishes promptly and /health stays quick."""
    stops = [f"{i:02d}" + "x" * (MAX_STOP_STRING_CHARS - 2) for i in range(MAX_STOP_STRINGS)]
    base = {"model": MODEL, "prompt": "Once", "max_tokens": 120, "ignore_eos": True, "temperature": 0}

    def hostile() -> list[Any]:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={**base, "stop": stops}, timeout=120)
        return [(r.status_code, r.json(), time.perf_counter() - start)]

    innocent, [(status, body, seconds)], worst = _innocent_beside(url, hostile)
    assert status == 200 and body["usage"]["completion_tokens"] == 120, body
    assert innocent["error"] is None and innocent["tokens"] == LONG, innocent
    assert seconds < 10 and worst < HEALTH_LIMIT_S, (seconds, worst)


@pytest.fixture(scope="module")
def strict(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server with an API key and a 1 s pause allowed within a request body."""
    env = {"KILN_API_KEY": API_KEY, "KILN_REQUEST_BODY_IDLE_TIMEOUT_S": "1"}
    server = _serve(artifact, tmp_path_factory.mktemp("strict-log") / "serve.log", env=env)
    try:
        yield server.url
    finally:
        server.stop()


def test_api_key_guards_every_path_but_health_metrics_and_version(strict: str) -> None:
    guarded = [
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/tokenizer_info", None),
        ("GET", "/docs", None),
        ("GET", "/openapi.json", None),
        ("GET", "/redoc", None),
        ("GET", "/v1/models", None),
        ("GET", "/no-such-path", None),
    ]
    with httpx.Client(base_url=strict, timeout=30) as client:
        for method, path, body in guarded:
            r = client.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            ok = client.request(method, path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
            assert ok.status_code in (200, 404), (path, ok.text)
        for path in ("/health", "/metrics", "/version"):
            assert client.get(path).status_code == 200, path


def test_a_stalled_request_body_is_a_408_and_the_connection_closes(strict: str) -> None:
    host, port = strict.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": ')  # and then nothing
        start = time.perf_counter()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        waited = time.perf_counter() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer and waited < 10, waited
