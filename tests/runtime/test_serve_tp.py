"""`kiln serve` on a TP-sharded artifact launches its ranks itself (gloo on CPU): the same greedy
completions as the unsharded artifact under concurrent requests, no socket of the ranks listening
beyond loopback, a clean stop that takes the ranks with it, and a rank that dies makes the server
fail its requests and exit 1."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import write_artifact
from devtools.processes import Server
from tests.runtime.serving import MODEL_NAME, serve_artifact

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "The capital of", "1 2 3 4 5", "hello"]
MAX_TOKENS = 12


def completions(base_url: str, model: str) -> list[str]:
    def one(prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        body["ignore_eos"] = True
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: batched decode across the ranks
        return list(pool.map(one, PROMPTS))


def exposed_sockets(pids: list[int]) -> list[str]:
    """The listening TCP sockets of these processes bound beyond loopback."""
    found = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and not ipaddress.ip_address(conn.laddr.ip).is_loopback:
                found.append(f"pid {pid} listens on {conn.laddr.ip}:{conn.laddr.port}")
    return found


def rank_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@contextmanager
def kiln_serve(artifact: Path, log: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    env = {**os.environ, "KILN_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    args = ["serve", str(artifact), "--served-model-name", "tiny", "--device", "cpu", "--max-num-seqs", "4"]
    server = Server([*args, *extra], env, log)
    try:
        server.wait_ready(180)
        yield server.proc, server.url
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def expected(llama_artifact: tuple[PreTrainedModel, Path]) -> list[str]:
    with serve_artifact(llama_artifact[1]) as server:
        return completions(server.base_url, MODEL_NAME)


def test_tp2_served_by_kiln_serve_matches_tp1_and_stops_its_ranks(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path], expected: list[str]
) -> None:
    artifact = write_artifact(llama_artifact[0], tmp_path / "tp2", tp=2)
    log = tmp_path / "serve.log"
    with kiln_serve(artifact, log, "--tp", "2") as (proc, url):
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 1, log.read_text()[-2000:]  # rank 1; rank 0 is the server itself
        assert not exposed_sockets([proc.pid, *ranks])  # the ranks meet on loopback only
        assert completions(url, "tiny") == expected
        assert completions(url, "tiny") == expected  # the ranks stay in step across requests
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_rank_that_dies_stops_the_server_with_an_error(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    artifact = write_artifact(llama_artifact[0], tmp_path / "tp2", tp=2)  # --tp from the artifact
    log = tmp_path / "serve.log"
    with kiln_serve(artifact, log) as (proc, _url):
        (rank1,) = rank_pids(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    text = log.read_text()
    assert "tensor-parallel kiln-rank1 exited with code -9" in text and "Traceback" not in text


def test_the_rank_watch_reports_a_follower_that_dies_but_not_one_told_to_stop() -> None:
    """A clean shutdown tells the followers to stop and they exit 0: the watch, ended first, must not
    call that a death (it did once in CI, turning `kiln serve`'s exit code into 1)."""
    import multiprocessing as mp
    import time

    from runtime.tp_serving import watch_followers

    ctx = mp.get_context("spawn")
    deaths: list[str] = []
    told = ctx.Process(target=time.sleep, args=(1.0,), name="kiln-rank1")  # exits 0 when "told"
    told.start()
    end = watch_followers([told], deaths.append)
    end()  # what serve does before it stops the followers
    told.join(timeout=30)
    time.sleep(1.2)  # more than two polls of the watch
    assert deaths == []

    died = ctx.Process(target=time.sleep, args=(0.2,), name="kiln-rank1")
    died.start()
    watch_followers([died], deaths.append)
    died.join(timeout=30)
    deadline = time.monotonic() + 10
    while not deaths and time.monotonic() < deadline:
        time.sleep(0.1)
    assert deaths == ["tensor-parallel kiln-rank1 exited with code 0"]
