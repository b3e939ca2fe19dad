"""The OpenAI-compatible server over a real engine and a tiny random artifact, via HTTP on loopback."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from runtime.chat import apply_chat_template
from runtime.request_limits import max_prompt_chars
from tests.runtime.serving import MODEL_NAME, RunningServer, serve_artifact

pytestmark = pytest.mark.timeout(120)

# The artifact holds the reference model's own fp32 weights (dense kernel): the only differences are
# summation order, so prompt logprobs agree to float32 rounding.
LOGPROB_ATOL = 1e-4
MAX_MODEL_LEN = 256
# While a multi-megabyte prompt is tokenized (SLOW_TOKENIZATION_S), /health must still answer within
# HEALTH_DURING_TOKENIZATION_MAX_S (it waited for the whole tokenization when that ran on the loop).
SLOW_TOKENIZATION_S = 3.0
HEALTH_DURING_TOKENIZATION_MAX_S = 1.0
ERROR_KEYS = {"message", "type", "param", "code"}
METRIC_NAMES = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


@pytest.fixture(scope="module")
def reference_model() -> Any:
    return tiny_hf_model("smollm2", seed=0)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory, reference_model: Any) -> Path:
    return write_artifact(reference_model, tmp_path_factory.mktemp("server-artifact"))


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[RunningServer]:
    with serve_artifact(artifact, max_model_len=MAX_MODEL_LEN) as srv:
        yield srv


@pytest.fixture
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c


def _chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **kw}


def _metrics(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def _sse_events(lines: Iterator[str]) -> list[Any]:
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_models_version(client: httpx.Client, server: RunningServer) -> None:
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/version").json()["version"]


def test_echo_logprobs_match_direct_forward(
    client: httpx.Client, server: RunningServer, reference_model: Any
) -> None:
    """lm-evaluation-harness `local-completions` loglikelihood request and parsing, verbatim in shape."""
    tok = server.tokenizer
    contexts = ["The quick brown fox", "Kiln turns checkpoints into"]
    continuations = [" jumps over", " artifacts."]
    prompts = [tok(c + x)["input_ids"] for c, x in zip(contexts, continuations, strict=True)]
    ctxlens = [len(tok(c)["input_ids"]) for c in contexts]
    payload = {
        "model": MODEL_NAME,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    body = client.post("/v1/completions", json=payload).json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    for ids, ctxlen, choice in zip(prompts, ctxlens, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert choice["text"].startswith(tok.decode(ids))
        with torch.no_grad():
            logits = reference_model(torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
        torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)
        # The top dict holds the actual token too, so lm-eval's is_greedy check is meaningful.
        for pos in range(1, len(ids)):
            top = lp["top_logprobs"][pos]
            assert lp["token_logprobs"][pos] in top.values()
            greedy = int(logits[pos - 1].argmax()) == ids[pos]
            assert (lp["token_logprobs"][pos] == max(top.values())) == greedy
        # lm-eval's parse_logprobs
        continuation_lp = sum(lp["token_logprobs"][ctxlen:-1])
        assert continuation_lp == pytest.approx(
            float(expected[ctxlen - 1 :].sum()), abs=LOGPROB_ATOL * len(ids)
        )
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert body["usage"]["completion_tokens"] == len(prompts)


def test_echo_with_max_tokens_zero_returns_the_prompt_only(
    client: httpx.Client, server: RunningServer
) -> None:
    ids = server.tokenizer("Hello there")["input_ids"]
    body = client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0},
    ).json()
    choice = body["choices"][0]
    assert choice["text"] == "Hello there"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_completion_logprobs_and_usage(client: httpx.Client, server: RunningServer) -> None:
    body = client.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": "abc",
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
        },
    ).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert body["usage"]["completion_tokens"] == len(lp["tokens"]) == 7
    assert body["usage"]["prompt_tokens"] == len(server.tokenizer("abc")["input_ids"])
    assert choice["finish_reason"] == "length"
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and 1 <= len(top) <= 3
        assert value == max(top.values())  # greedy: the chosen token is the most likely one


def test_chat_usage_counts_and_finish_reason(client: httpx.Client, server: RunningServer) -> None:
    messages = [{"role": "user", "content": "Count to three."}]
    body = client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_completion_tokens": 12, "ignore_eos": True},
    ).json()
    prompt_ids = apply_chat_template(server.tokenizer, messages)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
    }


def _printable_stop(text: str) -> str:
    """A short substring of `text`, away from its start, made of plain characters."""
    for i in range(3, len(text) - 2):
        candidate = text[i : i + 2]
        if candidate.isprintable() and "\ufffd" not in candidate and text.index(candidate) == i:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_trim_text_and_finish(client: httpx.Client) -> None:
    base = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "temperature": 0,
        "max_tokens": 48,
        "ignore_eos": True,
    }
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = _printable_stop(full)
    cut = full[: full.index(stop)]

    stopped = client.post("/v1/completions", json={**base, "stop": [stop, "never-in-output"]}).json()
    assert stopped["choices"][0]["text"] == cut
    assert stopped["choices"][0]["finish_reason"] == "stop"

    with client.stream("POST", "/v1/completions", json={**base, "stop": stop, "stream": True}) as r:
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_seed_makes_sampling_reproducible(client: httpx.Client) -> None:
    req = _chat(
        "Tell me a story", temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True
    )
    first = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    second = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    assert first == second


def test_chat_logprobs(client: httpx.Client) -> None:
    body = client.post(
        "/v1/chat/completions",
        json=_chat("hi", max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3),
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 5
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])  # greedy
        assert entry["bytes"] == list(entry["token"].encode())


def test_chat_stream_sse_format_and_usage_chunk(client: httpx.Client) -> None:
    req = _chat(
        "hi",
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/chat/completions", _chat("hi", model="no-such-model"), 404, "model", "model_not_found"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", _chat("word " * 400), 400, "messages", "context_length_exceeded"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 10_000},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/chat/completions", _chat("hi", temperature=-1), 400, "temperature", None),
        ("/v1/chat/completions", _chat("hi", n=2), 400, "n", None),
        ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages", None),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
            None,
        ),
        ("/v1/chat/completions", _chat("hi", max_tokens=4, min_tokens=8), 400, None, None),
        ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ],
)
def test_error_bodies(
    client: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["code"] == code


def test_malformed_json_and_unknown_route(client: httpx.Client) -> None:
    r = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS


def test_metrics_names_and_counts_move(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    for name in METRIC_NAMES:
        assert f"\n{name}{{" in text or f"\n{name}_bucket{{" in text, name
    before = _metrics(client)
    body = client.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": "metrics please",
            "max_tokens": 9,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    after = _metrics(client)

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("vllm:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 9
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 8
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 1
    assert after[("vllm:num_requests_running", ())] == 0


def _assert_one_abort(before: dict[Any, float], after: dict[Any, float], max_tokens: int) -> None:
    """One more request finished as aborted, before generating all its tokens."""
    aborted = (("finished_reason", "abort"),)
    assert (
        after.get(("vllm:request_success_total", aborted), 0)
        - before.get(("vllm:request_success_total", aborted), 0)
        == 1
    )
    assert (
        after[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())]
        < max_tokens
    )


def test_client_disconnect_aborts_the_request(client: httpx.Client, server: RunningServer) -> None:
    before = _metrics(client)
    max_tokens = MAX_MODEL_LEN - 32
    req = _chat("go on", max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True)
    with (
        httpx.Client(base_url=server.base_url, timeout=30.0) as other,
        other.stream("POST", "/v1/chat/completions", json=req) as r,
    ):
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # role chunk + a couple of tokens (blank separators)
        assert any(line.startswith("data: ") for line in received)
    # Leaving the `with` closed the connection: the engine must drop the request and free its slot.
    deadline = time.monotonic() + 10
    while server.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.num_running == 0
    _assert_one_abort(before, _metrics(client), max_tokens)


def test_streaming_completions_with_several_prompts_and_echo(
    client: httpx.Client, server: RunningServer
) -> None:
    prompts = ["first prompt", "the second one"]
    req = {
        "model": MODEL_NAME,
        "prompt": prompts,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=req) as r:
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for e in events[:-2]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    whole = client.post("/v1/completions", json={**req, "stream": False, "stream_options": None}).json()
    for i, prompt in enumerate(prompts):
        assert texts[i].startswith(prompt)
        assert texts[i] == whole["choices"][i]["text"]
    prompt_tokens = sum(len(server.tokenizer(p)["input_ids"]) for p in prompts)
    assert usage == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 10,
        "total_tokens": prompt_tokens + 10,
    }


def test_non_streaming_client_disconnect_aborts_the_request(
    client: httpx.Client, server: RunningServer
) -> None:
    before = _metrics(client)
    max_tokens = MAX_MODEL_LEN - 32
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection(
        (host, int(port))
    ) as sock:  # a raw client, so the test decides when it leaves
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 10
        while not server.engine.num_running and time.monotonic() < deadline:
            time.sleep(0.001)
        assert server.engine.num_running == 1
    deadline = time.monotonic() + 10
    while server.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    _assert_one_abort(before, _metrics(client), max_tokens)


def test_tokenize_detokenize_and_tokenizer_info(client: httpx.Client, server: RunningServer) -> None:
    """vLLM's tokenizer endpoints, as lm-evaluation-harness's remote tokenizer calls them."""
    tok = server.tokenizer
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    out = client.post("/tokenize", json={"prompt": "héllo wörld", "add_special_tokens": False}).json()
    assert out["tokens"] == tok("héllo wörld", add_special_tokens=False)["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": "héllo wörld"}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == apply_chat_template(tok, messages)
    r = client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# --- request data that must give a 4xx, never a 500 (issue: 5xx from request data) --------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": True}, "seed"),
        ("/v1/completions", {"prompt": "\ud800 hi"}, None),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, None),
        ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud83d"}]}, None),
        ("/tokenize", {"prompt": "\ud800"}, None),
        ("/v1/completions", {"prompt": [True]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, False]]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids.0"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "", "content": "hi"}]}, "messages.0.role"),
    ],
)
def test_hostile_request_data_gets_a_400(
    client: httpx.Client, path: str, body: dict[str, Any], param: str | None
) -> None:
    # json.dumps escapes a lone surrogate as \ud800, which is what a hostile client sends.
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param.split(".")[0]), err
    if "\\u" in json.dumps(body) and "\\ud" in json.dumps(body):
        assert "surrogate" in err["message"]
    assert client.get("/health").status_code == 200  # the keep-alive connection still works


def test_non_finite_floats_get_a_400(client: httpx.Client) -> None:
    for raw in (b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}'):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
    assert client.get("/health").status_code == 200


def test_oversized_bodies_get_a_413_before_they_are_read(client: httpx.Client) -> None:
    from runtime.settings import get_settings

    limit = get_settings().serve_max_request_bytes
    big = json.dumps({"prompt": "x" * (limit + 16)}).encode()
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while the body streams
        yield b'{"prompt": "'
        for _ in range(limit // (1 << 20) + 1):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert client.get("/health").status_code == 200


class SlowTokenizer:
    """The artifact's tokenizer, taking `delay_s` longer on every prompt over 1,000 characters: a
    stand-in for the time a real tokenizer spends on the longest prompt a large context admits."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def __call__(self, text: str, **kw: Any) -> Any:
        if len(text) > 1000:
            time.sleep(self._delay_s)
        return self._inner(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


def test_a_huge_prompt_does_not_stall_the_event_loop(artifact: Path) -> None:
    """Tokenization runs in a worker thread: /health keeps answering while a huge prompt is tokenized.
    (The prompt is then refused for its length; the point is that the loop stays free meanwhile.)"""
    import threading

    prompt = "x" * max_prompt_chars(MAX_MODEL_LEN)  # the most characters a prompt may have
    slow = SLOW_TOKENIZATION_S
    with serve_artifact(
        artifact, max_model_len=MAX_MODEL_LEN, tokenizer=lambda t: SlowTokenizer(t, slow)
    ) as srv:
        done = threading.Event()
        status: list[int] = []

        def post() -> None:
            with httpx.Client(base_url=srv.base_url, timeout=120.0) as c:
                status.append(c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code)
            done.set()

        worker = threading.Thread(target=post)
        worker.start()
        latencies = []
        with httpx.Client(base_url=srv.base_url, timeout=30.0) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
        worker.join()
    assert status == [400]  # longer than the context
    assert len(latencies) >= 3, latencies
    assert max(latencies) < HEALTH_DURING_TOKENIZATION_MAX_S, latencies
