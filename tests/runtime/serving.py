"""Runs the real OpenAI-compatible app under uvicorn on a loopback port, in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from runtime.distributed import free_port
from runtime.engine import AsyncEngine, Engine
from runtime.loader import LoadedModel, load_model
from runtime.openai import build_app

MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 30.0


def wait_healthy(base_url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become healthy in {timeout_s} s")


@dataclass
class RunningServer:
    base_url: str
    loaded: LoadedModel
    engine: Engine
    async_engine: AsyncEngine
    app: Any

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer


@contextmanager
def serve_artifact(
    artifact: Path,
    *,
    max_num_seqs: int = 8,
    max_model_len: int = 512,
    tokenizer: Callable[[Any], Any] | None = None,
    api_key: str | None = None,
) -> Iterator[RunningServer]:
    """Serve `artifact` on a loopback port; `tokenizer` may wrap the artifact's tokenizer."""
    loaded = load_model(artifact)
    engine = Engine(loaded, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    async_engine = AsyncEngine(engine)
    tok = loaded.tokenizer if tokenizer is None else tokenizer(loaded.tokenizer)
    app = build_app(async_engine, MODEL_NAME, tok, root=str(artifact), api_key=api_key)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url)
        yield RunningServer(base_url, loaded, engine, async_engine, app)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
