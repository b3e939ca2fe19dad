"""Load benchmark on loopback: the REST API under submissions + status polls at a fixed rate, and
`kiln serve` under concurrent streaming clients. Goal: 0 5xx, 0 lost requests.

    .venv/bin/python bench/load.py [--rate 200] [--seconds 30] [--api-workers 2]
                                   [--stream-clients 16] [--stream-requests 4] [--max-tokens 32]

API: `kiln api --workers N` (PostgreSQL throwaway database + a Redis queue
no worker consumes, so jobs stay queued and every submission is a real SQL write + broker publish).
An open-loop client sends requests on a fixed schedule (1 submission : 3 status polls of accepted
jobs) with at most --max-in-flight outstanding; a request that cannot be sent on time waits, and
the achieved rate is reported next to the target. Afterwards every accepted submission is looked up
in SQL: a 202 whose row is missing counts as lost, as does any request without a response.

serve: `kiln serve` on a tiny random Llama artifact (devtools/builders/tiny_artifacts.py), with
--stream-clients concurrent clients each sending --stream-requests streamed /v1/completions, every
request bounded by --request-timeout and the whole phase by --serve-deadline. Reports time to first
token, total latency, streamed tokens/s and errors (non-200, a stream without `[DONE]`, timeouts).

Peer in the same run: GET /openapi.json (no database) at the same schedule, so the API figures read
as a ratio against what this machine's uvicorn + client can do at all. Saves bench/results/load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "load.json"
KILN = [sys.executable, "-m", "services.cli"]

_spec = importlib.util.spec_from_file_location("kiln_bench_api", REPO / "bench" / "api.py")
assert _spec is not None and _spec.loader is not None
bench_api = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_api)
free_port, pct = bench_api.free_port, bench_api.pct


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}); see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code in (200, 503):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer in {timeout} s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.by_method: dict[str, list[float]] = {}
        self.statuses: dict[str, int] = {}
        self.no_response = 0
        self.late_s: list[float] = []  # how long a request waited past its scheduled time

    def summary(self, wall: float, target_rps: float) -> dict:
        n = len(self.latencies) + self.no_response
        five = sum(v for k, v in self.statuses.items() if k.startswith("5"))
        return {
            "requests": n,
            "target_rps": target_rps,
            "achieved_rps": round(n / wall, 1),
            "seconds": round(wall, 2),
            "p50_ms": round(1000 * pct(self.latencies, 0.50), 2) if self.latencies else None,
            "p99_ms": round(1000 * pct(self.latencies, 0.99), 2) if self.latencies else None,
            "by_method": {
                method: {
                    "requests": len(lat),
                    "p50_ms": round(1000 * pct(lat, 0.50), 2),
                    "p99_ms": round(1000 * pct(lat, 0.99), 2),
                }
                for method, lat in sorted(self.by_method.items())
            },
            "schedule_lag_p99_ms": round(1000 * pct(self.late_s, 0.99), 2) if self.late_s else None,
            "statuses": dict(sorted(self.statuses.items())),
            "5xx": five,
            "no_response": self.no_response,
        }


@dataclass
class Reply:
    method: str
    status_code: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _StaleConnection(Exception):
    """A kept-alive connection was closed by the server before it answered."""


class RawHttp:
    """The load generator's HTTP/1.1 client: keep-alive connections over asyncio streams, requests
    written as bytes and responses read by Content-Length. httpx's AsyncClient costs ≈ 4 ms of CPU
    per request on this 2-core machine — as much as the API it measures — so with it the client, not
    the server, set the achieved rate. Only what uvicorn answers is handled (no chunked bodies)."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port or 80
        self.timeout = timeout
        fixed = {"Host": f"{self.host}:{self.port}", **headers}
        self.base = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Reply:
        return await asyncio.wait_for(self._request(method, path, body, headers or {}), self.timeout)

    async def _request(self, method: str, path: str, body: Any, headers: dict[str, str]) -> Reply:
        payload = b"" if body is None else json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body is not None:
            extra += "Content-Type: application/json\r\n"
        head = f"{method} {path} HTTP/1.1\r\n{self.base}{extra}Content-Length: {len(payload)}\r\n\r\n"
        message = head.encode() + payload
        while self.idle:  # a kept-alive connection the server closed meanwhile: try the next one
            try:
                return await self._exchange(self.idle.pop(), method, path, message)
            except _StaleConnection:
                continue
        conn = await asyncio.open_connection(self.host, self.port)
        try:
            return await self._exchange(conn, method, path, message)
        except _StaleConnection as e:
            raise httpx.RemoteProtocolError(f"{method} {path}: connection closed without a response") from e

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], method: str, path: str, message: bytes
    ) -> Reply:
        reader, writer = conn
        try:
            writer.write(message)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if not e.partial:  # closed before answering: the request was never processed
                    raise _StaleConnection from e
                raise
            status_line, *lines = head.decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
            if "content-length" not in fields:
                raise httpx.RemoteProtocolError(f"{method} {path}: response without Content-Length")
            data = await reader.readexactly(int(fields["content-length"]))
        except (ConnectionResetError, BrokenPipeError) as e:
            writer.close()
            raise _StaleConnection from e
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            writer.close()
            raise httpx.TransportError(f"{method} {path}: {e!r}") from e
        except BaseException:
            writer.close()
            raise
        if fields.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append(conn)
        return Reply(method, int(status_line.split(" ", 2)[1]), data)

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def open_loop(
    url: str,
    headers: dict[str, str],
    rate: float,
    seconds: float,
    max_in_flight: int,
    request: Callable[[RawHttp, int], Awaitable[Reply]],
    on_response: Callable[[int, Reply], None] | None = None,
) -> tuple[Tally, float]:
    tally = Tally()
    sem = asyncio.Semaphore(max_in_flight)
    n = int(rate * seconds)
    client = RawHttp(url, headers, timeout=30)

    async def one(i: int, due: float) -> None:
        async with sem:
            now = time.perf_counter()
            tally.late_s.append(max(0.0, now - due))
            try:
                r = await request(client, i)
            except (httpx.HTTPError, TimeoutError):
                tally.no_response += 1
                return
            took = time.perf_counter() - now
            tally.latencies.append(took)
            tally.by_method.setdefault(r.method, []).append(took)
            tally.statuses[str(r.status_code)] = tally.statuses.get(str(r.status_code), 0) + 1
            if on_response is not None:
                on_response(i, r)

    t0 = time.perf_counter()
    tasks = []
    try:
        for i in range(n):
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
    finally:
        client.close()
    wall = time.perf_counter() - t0
    return tally, wall


class ConsoleWatcher:
    """The web console's jobs page open in headless Chromium for the whole API phase, as an operator
    would have it: it refreshes the job list every 2 s and health every 10 s through the API under
    load. Reports how many refreshes it saw and what the page logged as errors."""

    def __init__(self, url: str, token: str, workdir: Path, screenshot: Path) -> None:
        self.url, self.token, self.workdir, self.screenshot = url, token, workdir, screenshot
        self.result: dict[str, Any] = {}

    def __enter__(self) -> ConsoleWatcher:
        from devtools import browser

        self._browser = browser.chromium(self.workdir / "chromium-profile")
        self.session = self._browser.__enter__()
        self.session.get(f"{self.url}/console")
        browser.enter_console_token(self.session, self.token)
        browser.wait_until(self.session, lambda d: d.execute_script(_LOADS_JS)["jobs"] > 0, "the job list")
        self._start = self.session.execute_script(_LOADS_JS)
        return self

    def __exit__(self, *exc: object) -> None:
        from devtools import browser

        try:
            end = self.session.execute_script(_LOADS_JS)
            self.result = {
                "job_list_refreshes": end["jobs"] - self._start["jobs"],
                "health_refreshes": end["health"] - self._start["health"],
                "page_errors": browser.console_errors(self.session),
                "status_line": self.session.execute_script(
                    "return document.getElementById('console-status').textContent"
                ),
            }
            self.screenshot.parent.mkdir(parents=True, exist_ok=True)
            self.session.save_screenshot(str(self.screenshot))
            self.result["screenshot"] = str(self.screenshot)
        finally:
            self._browser.__exit__(None, None, None)


_LOADS_JS = """return {jobs: Number(document.getElementById('jobs').dataset.loads || 0),
                       health: Number(document.getElementById('health').dataset.loads || 0)}"""


def api_phase(args: argparse.Namespace, workdir: Path) -> dict:
    from sqlalchemy import create_engine, func, select, text

    run_id = secrets.token_hex(4)
    db = f"kiln_load_{run_id}"
    queue = f"kiln-load-{run_id}"
    admin = create_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{db}"'))
    db_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
    env = {
        **os.environ,
        "KILN_DATA_DIR": str(workdir / "api"),
        "KILN_ENVIRONMENT": "development",
        "KILN_DATABASE_URL": db_url,
        "KILN_BROKER_URL": args.redis_url,
        "KILN_CELERY_QUEUE": queue,
    }
    proc: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run([*KILN, "db", "upgrade"], cwd=REPO, env=env, check=True, capture_output=True)
        token = subprocess.run(
            [*KILN, "admin", "create-token", "--name", "load"],
            cwd=REPO, env=env, check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        port = free_port()
        log = workdir / "api.log"
        proc = subprocess.Popen(
            [*KILN, "api", "--host", "127.0.0.1", "--port", str(port), "--workers", str(args.api_workers)],
            cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", 60, proc, log)
        headers = {"Authorization": f"Bearer {token}"}

        accepted: list[str] = []
        rng = random.Random(0)

        async def mixed(client: RawHttp, i: int) -> Reply:
            if i % 4 == 0 or not accepted:
                body = {"source": f"/nonexistent/kiln-load/{run_id}/{i}", "targets": ["cpu"]}
                return await client.request(
                    "POST", "/v1/conversions", body, headers={"Idempotency-Key": f"{run_id}-{i}"}
                )
            return await client.request("GET", f"/v1/conversions/{rng.choice(accepted)}")

        def record(i: int, r: Reply) -> None:
            if r.method == "POST" and r.status_code == 202:
                accepted.append(r.json()["id"])

        async def peer(client: RawHttp, i: int) -> Reply:
            return await client.request("GET", "/openapi.json")

        print(
            f"api: {args.rate:.0f} req/s for {args.seconds:.0f} s (submit:poll 1:3), "
            f"{args.api_workers} uvicorn workers"
            + (", the console open in headless Chromium" if args.console else "")
        )
        shot = args.results.with_name("console-under-load.png")
        watcher = ConsoleWatcher(url, token, workdir, shot) if args.console else None
        with watcher if watcher is not None else contextlib.nullcontext() as console:
            tally, wall = asyncio.run(
                open_loop(url, headers, args.rate, args.seconds, args.max_in_flight, mixed, record)
            )
        result = tally.summary(wall, args.rate)
        if console is not None:
            result["console"] = console.result
        accepted_ids = set(accepted)
        engine = create_engine(db_url)
        from services.db.models import Job

        with engine.connect() as c:
            found = set(
                c.execute(select(Job.id).where(Job.idempotency_key.like(f"{run_id}-%"))).scalars().all()
            )
            rows = c.execute(select(func.count()).select_from(Job)).scalar_one()
        engine.dispose()
        result["submissions_accepted"] = len(accepted_ids)
        result["accepted_missing_in_sql"] = len(accepted_ids - found)
        result["job_rows"] = rows
        result["lost"] = result["no_response"] + result["accepted_missing_in_sql"]

        print(f"api peer: GET /openapi.json at the same schedule for {args.peer_seconds:.0f} s")
        ptally, pwall = asyncio.run(
            open_loop(url, headers, args.rate, args.peer_seconds, args.max_in_flight, peer)
        )
        result["peer_openapi"] = ptally.summary(pwall, args.rate)
        p = result["peer_openapi"]
        result["achieved_over_peer"] = round(result["achieved_rps"] / max(p["achieved_rps"], 1e-9), 3)
        return result
    finally:
        if proc is not None:
            stop(proc)
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()
        import redis

        r = redis.Redis.from_url(args.redis_url)
        r.delete(queue)
        r.close()


async def stream_clients(url: str, args: argparse.Namespace, model: str) -> dict:
    ttft: list[float] = []
    total: list[float] = []
    tokens = 0
    errors: dict[str, int] = {}

    def err(kind: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1

    limits = httpx.Limits(max_connections=args.stream_clients)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:

        async def one(c: int, k: int) -> None:
            nonlocal tokens
            body = {
                "model": model,
                "prompt": f"Client {c} request {k}: once upon a time",
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            t0 = time.perf_counter()
            first: float | None = None
            n = 0
            done = False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        err(str(r.status_code))
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: ") :]
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            err("stream_error")
                            return
                        if any(ch.get("text") for ch in chunk.get("choices", [])):
                            n += 1
                            if first is None:
                                first = time.perf_counter() - t0
            except (httpx.HTTPError, ValueError) as e:
                err(type(e).__name__)
                return
            if not done:
                err("no_done")
                return
            total.append(time.perf_counter() - t0)
            if first is not None:
                ttft.append(first)
            tokens += n

        async def client_loop(c: int) -> None:
            for k in range(args.stream_requests):
                await one(c, k)

        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(client_loop(c) for c in range(args.stream_clients))), args.serve_deadline
            )
        except TimeoutError:
            err("phase_deadline")
        wall = time.perf_counter() - t0
    sent = args.stream_clients * args.stream_requests
    return {
        "clients": args.stream_clients,
        "requests": sent,
        "completed": len(total),
        "lost": sent - len(total),
        "seconds": round(wall, 2),
        "requests_per_s": round(len(total) / wall, 2),
        "streamed_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * pct(ttft, 0.5), 1) if ttft else None,
        "ttft_p99_ms": round(1000 * pct(ttft, 0.99), 1) if ttft else None,
        "latency_p50_ms": round(1000 * pct(total, 0.5), 1) if total else None,
        "latency_p99_ms": round(1000 * pct(total, 0.99), 1) if total else None,
        "errors": errors,
        "5xx": sum(v for k, v in errors.items() if k.startswith("5")),
    }


def serve_phase(args: argparse.Namespace, workdir: Path) -> dict:
    from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact

    artifact = write_artifact(tiny_hf_model("llama"), workdir / "artifact")
    port = free_port()
    log = workdir / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(
        [
            *KILN, "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "tiny", "--max-num-seqs", str(args.stream_clients),
            "--device", "cpu", "--uvicorn-log-level", "warning",
        ],
        cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", 120, proc, log)
        print(
            f"serve: {args.stream_clients} streaming clients x {args.stream_requests} requests, "
            f"{args.max_tokens} tokens each"
        )
        result = asyncio.run(stream_clients(url, args, "tiny"))
        result["server_alive_after"] = proc.poll() is None
        return result
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0, help="API requests per second (target)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--peer-seconds", type=float, default=10.0)
    ap.add_argument("--max-in-flight", type=int, default=128)
    ap.add_argument("--api-workers", type=int, default=2)
    ap.add_argument("--stream-clients", type=int, default=16)
    ap.add_argument("--stream-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--serve-deadline", type=float, default=300.0)
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"JSON written here (default {RESULTS})")
    ap.add_argument("--skip-api", action="store_true")
    ap.add_argument(
        "--console",
        action="store_true",
        help="keep the web console open in headless Chromium during the API phase",
    )
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-load-"))
    results: dict = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    try:
        if not args.skip_api:
            api = results["api"] = api_phase(args, workdir)
            print(
                f"api: {api['achieved_rps']} req/s achieved (target {api['target_rps']:.0f}), "
                f"p50 {api['p50_ms']} ms, p99 {api['p99_ms']} ms "
                f"(status polls: p99 {api['by_method'].get('GET', {}).get('p99_ms')} ms; "
                f"submissions: p99 {api['by_method'].get('POST', {}).get('p99_ms')} ms), "
                f"5xx {api['5xx']}, lost {api['lost']} "
                f"(accepted {api['submissions_accepted']}), statuses {api['statuses']}; "
                f"peer /openapi.json {api['peer_openapi']['achieved_rps']} req/s "
                f"(ratio {api['achieved_over_peer']})"
            )
        if not args.skip_serve:
            s = results["serve"] = serve_phase(args, workdir)
            print(
                f"serve: {s['completed']}/{s['requests']} streams completed, {s['requests_per_s']} req/s, "
                f"{s['streamed_tokens_per_s']} tok/s, "
                f"TTFT p50 {s['ttft_p50_ms']} ms p99 {s['ttft_p99_ms']} ms, "
                f"latency p50 {s['latency_p50_ms']} ms p99 {s['latency_p99_ms']} ms, errors {s['errors']}"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["loadavg_after"] = os.getloadavg()
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {args.results}")


if __name__ == "__main__":
    main()
