"""Flakiness, measured: rerun the tests that touch timing, faults or processes N times under a CPU
hog and print failures per test.

    .venv/bin/python bench/flaky.py [--runs 10] [--hog 2] [TEST ...]

With no TEST, runs every test marked `timing` (pyproject.toml's marker list says what it means; the
marker sits on the tests themselves, so the set grows with the suite). Each run is one pytest
process over the whole set (so fixtures behave as in CI), while --hog busy-loop processes (default:
one per core) compete for the CPUs. Results come from each run's JUnit XML. Prints, per test: runs,
failures, median and max duration, and the first line of its first failure; exits 1 if any test
failed. Saves bench/results/flaky.json, and each failed run's pytest output as
bench/results/flaky-run-N.log.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "flaky.json"
MARKER = "timing"


def _spin() -> None:
    while True:
        pass


@dataclass
class Tally:
    runs: int = 0
    failures: int = 0
    durations: list[float] = field(default_factory=list)
    first_failure: str = ""


def run_once(tests: list[str], junit: Path, log: Path) -> int:
    selection = tests or ["-m", MARKER]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selection]
    with log.open("wb") as out:
        return subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode


def collect(junit: Path, tally: dict[str, Tally]) -> None:
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("skipped") is not None:
            continue
        t = tally[name]
        t.runs += 1
        t.durations.append(float(case.get("time", "0")))
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            t.failures += 1
            if not t.first_failure:
                message = (problem.get("message") or "?").strip() or "?"
                t.first_failure = message.splitlines()[0][:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help=f"pytest node ids (default: -m {MARKER})")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--hog", type=int, default=os.cpu_count() or 2, help="busy-loop processes (0: none)")
    ap.add_argument("--minutes", type=float, default=0, help="start no run after this long (0: no limit)")
    args = ap.parse_args()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)

    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    tally: dict[str, Tally] = defaultdict(Tally)
    started = time.monotonic()
    completed = 0
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-flaky-") as tmp:
            for i in range(args.runs):
                if args.minutes and time.monotonic() - started > 60 * args.minutes:
                    print(f"stopping after {i} runs: the {args.minutes:g}-minute budget is spent", flush=True)
                    break
                junit, log = Path(tmp) / f"run-{i}.xml", RESULTS.with_name(f"flaky-run-{i + 1}.log")
                t0 = time.monotonic()
                code = run_once(args.tests, junit, log)
                if not junit.exists():
                    print(f"run {i + 1}: pytest exited {code} without a report (see {log})", file=sys.stderr)
                    return 2
                if code == 0:
                    log.unlink()  # a failed run's output is kept for its diagnosis
                collect(junit, tally)
                completed += 1
                failed = sum(t.failures for t in tally.values())
                took = time.monotonic() - t0
                print(
                    f"run {i + 1}/{args.runs}: exit {code} in {took:.0f} s; {failed} failure(s) so far",
                    flush=True,
                )
    finally:
        for h in hogs:
            h.terminate()

    width = max((len(n) for n in tally), default=10)
    print(f"\n{completed} runs with {args.hog} CPU hog(s), {time.monotonic() - started:.0f} s in all\n")
    print(f"{'test':<{width}}  runs  failed  median s   max s")
    for name, t in sorted(tally.items()):
        median, worst = statistics.median(t.durations), max(t.durations)
        print(f"{name:<{width}}  {t.runs:>4}  {t.failures:>6}  {median:>8.1f}  {worst:>6.1f}")
        if t.first_failure:
            print(f"    first failure: {t.first_failure}")
    RESULTS.write_text(
        json.dumps(
            {
                "runs": completed,
                "hogs": args.hog,
                "tests": {
                    n: {
                        "runs": t.runs,
                        "failures": t.failures,
                        "durations": t.durations,
                        "first_failure": t.first_failure,
                    }
                    for n, t in tally.items()
                },
            },
            indent=1,
        )
    )
    return 1 if any(t.failures for t in tally.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
