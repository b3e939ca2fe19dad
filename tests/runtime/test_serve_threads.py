"""`kiln serve`'s threading: the engine steps on the thread that loaded the model (one OpenMP pool),
HTTP runs beside it, and SIGTERM drains the requests in flight before the process exits."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from runtime.distributed import free_port
from runtime.engine import AsyncEngine, Engine
from runtime.loader import load_model
from runtime.openai import build_app
from runtime.serve_cli import run_beside_engine
from tests.runtime.serving import MODEL_NAME, wait_healthy

pytestmark = [pytest.mark.timeout(120), pytest.mark.timing]

STREAM_TOKENS = 48


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tiny_hf_model("smollm2", seed=3), tmp_path_factory.mktemp("threads-artifact"))


def test_engine_steps_on_the_calling_thread_and_sigterm_drains(artifact: Path) -> None:
    loaded = load_model(artifact)
    engine = Engine(loaded, max_num_seqs=2, max_model_len=128)
    step_threads: set[str] = set()
    real_step = engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        step_threads.add(threading.current_thread().name)
        return real_step()

    engine.step = recording_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, MODEL_NAME, loaded.tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    base = f"http://127.0.0.1:{port}"
    events: list[dict[str, object]] = []
    client_error: list[BaseException] = []

    def client() -> None:
        try:
            wait_healthy(base)
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": STREAM_TOKENS, "stream": True}
            body |= {"ignore_eos": True, "temperature": 0}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))
                        if len(events) == 2:  # mid-stream: ask the process to stop
                            os.kill(os.getpid(), signal.SIGTERM)
        except BaseException as e:  # reported by the main thread
            client_error.append(e)

    requester = threading.Thread(target=client)
    before = signal.getsignal(signal.SIGTERM)
    requester.start()
    started = run_beside_engine(server, async_engine)
    requester.join(timeout=60)

    assert started and not client_error
    assert step_threads == {threading.current_thread().name}
    # the request in flight when SIGTERM came still ran to its end
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_server_that_cannot_bind_reports_it(artifact: Path) -> None:
    loaded = load_model(artifact)
    async_engine = AsyncEngine(Engine(loaded, max_num_seqs=1, max_model_len=64))
    app = build_app(async_engine, MODEL_NAME, loaded.tokenizer)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
        assert run_beside_engine(server, async_engine) is False
