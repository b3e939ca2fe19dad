"""The security probe's denial-of-service findings, replayed against a real `kiln api` on loopback.

    .venv/bin/python bench/security_probe.py [--case engines|regex|layers|slow-body|all] [--skip 16]

- `engines` (no server): the pattern `(?:.*.*)*!` against names of growing length, Python's `re`
  (backtracking; up to 15 characters, about 3.4x longer per character) against RE2 (what
  services/convert/patterns.py uses; up to 10,000 characters), seconds per match.

The other cases start `kiln api` (SQLite, local store, embedded worker) in a throwaway directory:

- `regex`: POST /v1/plans for a tiny checkpoint whose compressed-tensors `ignore` holds the
  backtracking pattern `re:^.{SKIP}(?:.*.*)*!` (a smaller --skip leaves a longer tail of every
  module name to backtrack over), while another client polls `/health` and GET /v1/conversions.
  Prints the plan's time and status and the worst latency of the other two.
- `layers`: POST /v1/plans for a 1 KB config.json claiming `num_hidden_layers: 1e6` over a 2-layer
  checkpoint: the plan's time and status and the API's peak resident memory.
- `slow-body`: 4 connections send headers and half a body, then nothing: how long until the server
  closes each, and whether a normal request is served meanwhile.

Results are printed as JSON (one object per case).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

from devtools.builders.synthetic import write_checkpoint  # noqa: E402
from tests.reliability.kiln_api import kiln_api  # noqa: E402

HOSTILE_CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        }
    },
}


def peak_rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / (1 << 20)
    return float("nan")


def checkpoint(workdir: Path, name: str, **config_changes: Any) -> Path:
    path = write_checkpoint(workdir / name, "dense", dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def timed_plan(url: str, token: str, source: Path, timeout: float, out: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        r = httpx.post(
            f"{url}/v1/plans",
            json={"source": str(source), "targets": ["cpu"]},
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )
        out.update(status=r.status_code, detail=r.text[:300])
    except httpx.HTTPError as e:
        out.update(status=None, detail=f"{type(e).__name__} after {timeout} s")
    out["plan_s"] = round(time.perf_counter() - t0, 3)


def case_regex(workdir: Path, skip: int, timeout: float) -> dict[str, Any]:
    ignore = [f"re:^.{{{skip}}}(?:.*.*)*!"]
    source = checkpoint(workdir, "hostile-regex", quantization_config={**HOSTILE_CT, "ignore": ignore})
    with kiln_api(workdir) as api:
        url, token = api.url, api.admin_token
        result: dict[str, Any] = {"case": "regex", "pattern": ignore[0]}
        plan = threading.Thread(target=timed_plan, args=(url, token, source, timeout, result))
        plan.start()
        worst = {"health_s": 0.0, "other_tenant_s": 0.0}
        auth = {"Authorization": f"Bearer {token}"}
        polls = 0
        while plan.is_alive() or polls < 5:
            polls += 1
            for key, path, headers in (
                ("health_s", "/health", {}),
                ("other_tenant_s", "/v1/conversions", auth),
            ):
                t0 = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(f"{url}{path}", headers=headers, timeout=timeout)
                worst[key] = max(worst[key], round(time.perf_counter() - t0, 3))
            time.sleep(0.05)
        plan.join()
        return {**result, **{f"worst_{k}": v for k, v in worst.items()}}


def case_engines() -> dict[str, Any]:
    import re

    import re2

    pattern = "(?:.*.*)*!"
    python_re: dict[int, float] = {}
    for n in range(10, 16):
        t0 = time.perf_counter()
        re.match(pattern, "x" * n)
        python_re[n] = round(time.perf_counter() - t0, 6)
    options = re2.Options()
    options.log_errors = False
    compiled = re2.compile(pattern, options)
    linear: dict[int, float] = {}
    for n in (10, 15, 30, 100, 1000, 10000):
        t0 = time.perf_counter()
        compiled.match("x" * n)
        linear[n] = round(time.perf_counter() - t0, 6)
    return {"case": "engines", "pattern": pattern, "python_re_s": python_re, "re2_s": linear}


def case_layers(workdir: Path, timeout: float) -> dict[str, Any]:
    source = checkpoint(workdir, "hostile-layers", num_hidden_layers=1e6)
    with kiln_api(workdir) as api:
        url, token, proc = api.url, api.admin_token, api.proc
        before = peak_rss_gb(proc.pid)
        result: dict[str, Any] = {"case": "layers", "config_bytes": (source / "config.json").stat().st_size}
        timed_plan(url, token, source, timeout, result)
        return {
            **result,
            "peak_rss_gb_before": round(before, 2),
            "peak_rss_gb_after": round(peak_rss_gb(proc.pid), 2),
        }


def case_slow_body(workdir: Path, wait: float) -> dict[str, Any]:
    with kiln_api(workdir) as api:
        url, token, port = api.url, api.admin_token, api.port
        socks = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(
                b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {token}\r\nContent-Length: 100\r\n\r\n".encode()
                + b'{"source": "/x", '
            )
            s.settimeout(0.2)
            socks.append(s)
        t0 = time.perf_counter()
        closed_at: dict[int, float] = {}
        answers: dict[int, str] = {}
        served_meanwhile = httpx.get(f"{url}/health", timeout=5).status_code
        while len(closed_at) < len(socks) and time.perf_counter() - t0 < wait:
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                try:
                    data = s.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    data = b""
                if data:
                    answers[i] = answers.get(i, "") + data.decode(errors="replace")
                if not data:
                    closed_at[i] = round(time.perf_counter() - t0, 2)
        for s in socks:
            s.close()
        return {
            "case": "slow-body",
            "waited_s": wait,
            "still_open": len(socks) - len(closed_at),
            "closed_after_s": sorted(closed_at.values()),
            "status_lines": sorted({a.split("\r\n", 1)[0] for a in answers.values()}),
            "health_while_open": served_meanwhile,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=["engines", "regex", "layers", "slow-body", "all"], default="all")
    ap.add_argument("--skip", type=int, default=16, help="regex: name characters skipped before backtracking")
    ap.add_argument("--timeout", type=float, default=120, help="client timeout per request (s)")
    ap.add_argument("--wait", type=float, default=40, help="slow-body: how long to watch the sockets (s)")
    args = ap.parse_args()
    cases = ["engines", "regex", "layers", "slow-body"] if args.case == "all" else [args.case]
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="kiln-probe-") as tmp:
            workdir = Path(tmp)
            if case == "engines":
                out = case_engines()
            elif case == "regex":
                out = case_regex(workdir, args.skip, args.timeout)
            elif case == "layers":
                out = case_layers(workdir, args.timeout)
            else:
                out = case_slow_body(workdir, args.wait)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
