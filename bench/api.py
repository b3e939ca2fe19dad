"""REST API benchmark on loopback: submission throughput and latency, status polls, end-to-end job time.

    .venv/bin/python bench/api.py [--requests 1000] [--concurrency 16] [--skip-e2e]

Each backend is a real `kiln api` process (uvicorn): the embedded default (SQLite, jobs in a worker
thread; sources are absent local paths so each job fails at once and adds realistic write load) and
the service configuration (PostgreSQL + Redis broker, no worker consuming). Clients are asyncio +
httpx with a bounded number of requests in flight. The end-to-end figure is SmolLM2-135M bf16 -> cpu
through the embedded API, against the conversion library called directly (the peer) in the same run.
Results are printed and saved to bench/results/api.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# `python bench/api.py` puts bench/ first on sys.path, where bench/runtime.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "api.json"
KILN = [sys.executable, "-m", "services.cli"]

from runtime.distributed import free_port  # noqa: E402  (after the sys.path fix above)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class ApiProcess:
    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.env = {**os.environ, **env}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def kiln(self, *args: str) -> str:
        out = subprocess.run(
            [*KILN, *args], cwd=REPO, env=self.env, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    def __enter__(self) -> ApiProcess:
        log = (self.workdir / f"api-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(
            [*KILN, "api", "--port", str(self.port)],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"kiln api did not start; see {log.name}")

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


async def load(url: str, token: str, n: int, concurrency: int, make_request) -> dict:  # type: ignore[no-untyped-def]
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await make_request(client, i)
                latencies.append(time.perf_counter() - t0)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {
        "requests": n,
        "concurrency": concurrency,
        "seconds": round(wall, 3),
        "throughput_rps": round(n / wall, 1),
        "p50_ms": round(1000 * pct(latencies, 0.50), 2),
        "p99_ms": round(1000 * pct(latencies, 0.99), 2),
        "mean_ms": round(1000 * statistics.fmean(latencies), 2),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def bench_backend(name: str, api: ApiProcess, n: int, concurrency: int, run_id: str) -> dict:
    token = api.kiln("admin", "create-token", "--name", "bench")

    async def submit(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"source": f"/nonexistent/kiln-bench/{run_id}/{i}", "targets": ["cpu"]}
        return await client.post("/v1/conversions", json=body, headers={"Idempotency-Key": f"{run_id}-{i}"})

    async def poll(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.get("/v1/conversions", params={"limit": 20})

    async def health(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.get("/openapi.json")

    result = {
        "submit": asyncio.run(load(api.url, token, n, concurrency, submit)),
        "poll_list": asyncio.run(load(api.url, token, n, concurrency, poll)),
        "static_peer": asyncio.run(load(api.url, token, n, concurrency, health)),
    }
    s, p = result["submit"], result["static_peer"]
    result["submit_vs_static_throughput"] = round(s["throughput_rps"] / p["throughput_rps"], 3)
    ratio = result["submit_vs_static_throughput"]
    print(
        f"{name:>10}: submit {s['throughput_rps']:7.1f} req/s "
        f"p50 {s['p50_ms']:6.1f} ms p99 {s['p99_ms']:6.1f} ms"
        f" | list {result['poll_list']['throughput_rps']:7.1f} req/s"
        f" | /openapi.json peer {p['throughput_rps']:7.1f} req/s (submit/peer {ratio})"
        f" | statuses {s['statuses']}"
    )
    return result


def bench_e2e(workdir: Path) -> dict | None:
    try:
        from devtools.builders import smollm2

        source = smollm2.build_bf16()
    except Exception as e:
        print(f"e2e: SmolLM2 bf16 checkpoint unavailable ({e}); skipped")
        return None
    from services.convert.library import ConversionRequest, convert

    t0 = time.perf_counter()
    convert(ConversionRequest(source=str(source), targets=["cpu"], out=str(workdir / "direct")))
    direct = time.perf_counter() - t0

    env = {"KILN_DATA_DIR": str(workdir / "e2e"), "KILN_ENVIRONMENT": "development"}
    with ApiProcess(env, workdir) as api:
        token = (workdir / "e2e" / "admin-token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        t0 = time.perf_counter()
        r = httpx.post(
            f"{api.url}/v1/conversions", json={"source": str(source), "targets": ["cpu"]}, headers=headers
        )
        r.raise_for_status()
        job_id = r.json()["id"]
        while True:
            job = httpx.get(f"{api.url}/v1/conversions/{job_id}", headers=headers).json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.2)
        e2e = time.perf_counter() - t0
    if job["status"] != "succeeded":
        print(f"e2e: job {job['status']}: {job['error']}")
        return {"status": job["status"], "error": job["error"]}
    result = {
        "model": "SmolLM2-135M-Instruct bf16 -> cpu",
        "api_job_seconds": round(e2e, 2),
        "direct_library_seconds": round(direct, 2),
        "api_over_direct": round(e2e / direct, 3),
    }
    print(
        f"e2e: SmolLM2 bf16 -> cpu via REST {e2e:.1f} s vs library directly {direct:.1f} s "
        f"(ratio {result['api_over_direct']})"
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    args = ap.parse_args()

    from sqlalchemy import create_engine, text

    run_id = secrets.token_hex(4)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-api-"))
    results: dict = {"requests": args.requests, "concurrency": args.concurrency, "cpus": os.cpu_count()}
    try:
        env = {"KILN_DATA_DIR": str(workdir / "sqlite"), "KILN_ENVIRONMENT": "development"}
        with ApiProcess(env, workdir) as api:
            results["embedded_sqlite"] = bench_backend("sqlite", api, args.requests, args.concurrency, run_id)

        db = f"kiln_bench_{run_id}"
        admin = create_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{db}"'))
        queue = f"kiln-bench-{run_id}"
        try:
            env = {
                "KILN_DATA_DIR": str(workdir / "pg"),
                "KILN_ENVIRONMENT": "development",
                "KILN_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}",
                "KILN_BROKER_URL": args.redis_url,
                "KILN_CELERY_QUEUE": queue,
            }
            api = ApiProcess(env, workdir)
            api.kiln("db", "upgrade")
            with api:
                results["postgres_redis"] = bench_backend(
                    "postgres", api, args.requests, args.concurrency, run_id
                )
        finally:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
            admin.dispose()
            import redis

            r = redis.Redis.from_url(args.redis_url)
            r.delete(queue)
            r.close()
        sq, pg = results["embedded_sqlite"]["submit"], results["postgres_redis"]["submit"]
        results["postgres_over_sqlite_submit_throughput"] = round(
            pg["throughput_rps"] / sq["throughput_rps"], 3
        )
        print(f"postgres/sqlite submit throughput: {results['postgres_over_sqlite_submit_throughput']}")
        if not args.skip_e2e:
            results["e2e_smollm2"] = bench_e2e(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
