"""The official `openai` client against `kiln serve`'s app on loopback: streaming, batching, errors,
and the `kiln serve` command itself in a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from tests.runtime.serving import MODEL_NAME, RunningServer, free_port, serve_artifact, wait_healthy

pytestmark = pytest.mark.timeout(120)

NUM_CONCURRENT = 6
CONCURRENT_TOKENS = 40
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tiny_hf_model("smollm2", seed=1), tmp_path_factory.mktemp("client-artifact"))


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[RunningServer]:
    with serve_artifact(artifact, max_num_seqs=8, max_model_len=256) as srv:
        yield srv


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_client_streams_a_chat_completion(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        stream=True,
        temperature=0,
        max_tokens=20,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces: list[str] = []
    finish: list[str | None] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish.append(choice.finish_reason)
    assert finish[-1] == "length"
    assert usage is not None and usage.completion_tokens == 20

    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert "".join(pieces) == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens == usage.prompt_tokens


def test_concurrent_streaming_clients_are_batched(server: RunningServer, client: openai.OpenAI) -> None:
    prompts = [f"Request number {i}: write a line." for i in range(NUM_CONCURRENT)]
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "temperature": 0,
        "max_tokens": CONCURRENT_TOKENS,
        "extra_body": {"ignore_eos": True},
    }
    solo = [
        client.chat.completions.create(messages=[{"role": "user", "content": p}], **kwargs)
        .choices[0]
        .message.content
        for p in prompts
    ]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        stream = await aclient.chat.completions.create(
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
        text, finish, tokens = "", None, -1
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, tokens

    async def run_all() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        ) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    server.engine.stats.decode_batch_sizes.clear()
    results = asyncio.run(run_all())
    assert max(server.engine.stats.decode_batch_sizes) > 1  # several requests in one decode step
    for (text, finish, tokens), expected in zip(results, solo, strict=True):
        assert finish == "length" and tokens == CONCURRENT_TOKENS
        assert text == expected  # batching does not change greedy results
    assert server.engine.num_running == 0


def test_openai_client_completions_echo_logprobs(server: RunningServer, client: openai.OpenAI) -> None:
    ids = server.tokenizer("a b c d")["input_ids"]
    out = client.completions.create(
        model=MODEL_NAME, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)


def test_openai_client_sees_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100_000)
    assert too_long.value.code == "context_length_exceeded"
    assert "maximum context length" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=3)
    assert bad.value.param == "n"


def test_kiln_serve_command(artifact: Path) -> None:
    """`kiln serve` as a user runs it: a subprocess, uvicorn on loopback, vLLM-style flags."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        str(artifact),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--verify",
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "128",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base, timeout_s=90)
        except TimeoutError:
            proc.kill()
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"kiln serve did not start:\n{out[-4000:]}") from None
        models = httpx.get(f"{base}/v1/models").json()
        # The default name and `root` are the artifact id, never the server's filesystem path.
        assert models["data"][0]["id"] == artifact.name and models["data"][0]["max_model_len"] == 128
        assert models["data"][0]["root"] == artifact.name
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = c.chat.completions.create(
            model=artifact.name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage is not None
        assert reply.usage.completion_tokens == 4
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_smollm2_answers_over_the_api(request: pytest.FixtureRequest) -> None:
    """A real converted SmolLM2 artifact (FP8, CPU) streams the known greedy answer to the openai client."""
    artifact = request.getfixturevalue("smollm2_artifact_cpu_fp8_online")
    with serve_artifact(artifact, max_num_seqs=2, max_model_len=512) as srv:
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        stream = c.chat.completions.create(
            model=MODEL_NAME,
            temperature=0,
            max_tokens=32,
            stream=True,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert "Paris" in text
