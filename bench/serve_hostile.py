"""What a hostile client costs the others on `kiln serve`: an innocent client's completion time beside
each kind of hostile request, as a ratio to the same completion alone (measured in the same run), and
the slowest /health answer meanwhile.

The hostile kinds are the ones the request caps and the per-row sampler answer (docs/security.md):
degenerate sampling parameters, a 7.8 MB prompt (to /tokenize and /v1/completions), 1.5 M ids to
detokenize, 19,000 stop strings, and the most stop strings allowed at their longest. Run:

    .venv/bin/python bench/serve_hostile.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact  # noqa: E402
from devtools.processes import Server  # noqa: E402
from runtime.request_limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS  # noqa: E402

MODEL = "tiny"
INNOCENT = {"model": MODEL, "prompt": "Once upon", "max_tokens": 200, "ignore_eos": True, "temperature": 0.7}
HUGE = "lorem ipsum " * 650_000
HOSTILE: dict[str, tuple[str, dict[str, Any]]] = {
    "temperature 1e-45": ("/v1/completions", {"prompt": "Hi", "max_tokens": 200, "temperature": 1e-45}),
    "top_p 5e-324": ("/v1/completions", {"prompt": "Hi", "max_tokens": 200, "top_p": 5e-324}),
    "7.8 MB prompt /tokenize": ("/tokenize", {"prompt": HUGE}),
    "7.8 MB prompt /v1/completions": ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}),
    "1.5 M ids /detokenize": ("/detokenize", {"tokens": [1] * 1_500_000}),
    "19,000 stop strings": ("/v1/completions", {"prompt": "a", "stop": ["s" * 400] * 19_000}),
    "stops at their cap": (
        "/v1/completions",
        {
            "prompt": "Once",
            "max_tokens": 120,
            "ignore_eos": True,
            "stop": [f"{i:02d}" + "x" * (MAX_STOP_STRING_CHARS - 2) for i in range(MAX_STOP_STRINGS)],
        },
    ),
}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def innocent(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json=INNOCENT, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == INNOCENT["max_tokens"], r.text


def beside(url: str, path: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(innocent seconds, slowest /health seconds, hostile status) with the hostile request repeated
    for as long as the innocent one runs."""
    done = threading.Event()
    worst = [0.0]
    statuses: list[int] = []

    def hostile() -> None:
        with httpx.Client(timeout=300) as client:
            while not done.is_set():
                statuses.append(client.post(f"{url}{path}", json={"model": MODEL, **body}).status_code)

    def health() -> None:
        with httpx.Client(timeout=300) as client:
            while not done.is_set():
                worst[0] = max(worst[0], timed(lambda: client.get(f"{url}/health")))
                time.sleep(0.05)

    threads = [threading.Thread(target=hostile), threading.Thread(target=health)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    seconds = timed(lambda: innocent(url))
    done.set()
    for t in threads:
        t.join()
    return seconds, worst[0], statuses[0] if statuses else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-hostile-"))
    artifact = write_artifact(tiny_hf_model("llama"), work)
    env = {**os.environ, "KILN_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    args_ = ["serve", str(artifact), "--served-model-name", MODEL, "--device", "cpu"]
    server = Server(args_, env, work / "log")
    server.wait_ready(180)
    try:
        innocent(server.url)  # warm-up
        alone = statistics.median(timed(lambda: innocent(server.url)) for _ in range(args.rounds))
        print(f"innocent completion alone: {alone:.3f} s ({INNOCENT['max_tokens']} tokens)")
        print(f"{'hostile request':32} {'status':>6} {'innocent ×':>10} {'worst /health':>14}")
        for name, (path, body) in HOSTILE.items():
            runs = [beside(server.url, path, body) for _ in range(args.rounds)]
            ratio = statistics.median(r[0] for r in runs) / alone
            worst = max(r[1] for r in runs)
            print(f"{name:32} {runs[0][2]:>6} {ratio:>10.2f} {worst:>12.3f} s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
