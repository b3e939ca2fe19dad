"""Fuzz the untrusted-input readers with >= 10,000 cases per target and report any crash.

Targets (tests/reliability/fuzz_targets.py): the safetensors header validator + converter reader +
runtime mmap loader, the config detector (+ plan), Manifest.parse, and the GGUF container parser
(checked against gguf.GGUFReader on every file it accepts). A crash is any exception other than the
target's documented error class (SafetensorsFormatError / KilnError / ManifestError /
GgufFormatError). Each case is generated from random.Random(seed + i), so a crash is replayed with
its seed.

    .venv/bin/python bench/fuzz.py [--cases 10000] [--seconds 600] [--seed 0] [--targets gguf,...]

Results: printed, and saved to bench/results/fuzz.json (all targets) or fuzz-<targets>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.errors import KilnError  # noqa: E402
from runtime.artifact.manifest import ManifestError  # noqa: E402
from runtime.artifact.safetensors_header import SafetensorsFormatError  # noqa: E402
from services.convert.gguf.container import GgufFormatError  # noqa: E402
from tests.reliability.fuzz_targets import (  # noqa: E402
    ConfigTarget,
    GgufTarget,
    ManifestTarget,
    SafetensorsTarget,
    gen_gguf,
    gen_safetensors,
    manifest_from_conversion,
)

TARGETS = ("safetensors", "config", "manifest", "gguf")
Target = tuple[Callable[[random.Random], Any], Callable[[Any], bool], type[Exception]]


def fuzz(
    name: str,
    generate: Callable[[random.Random], Any],
    run: Callable[[Any], bool],
    documented: type[Exception],
    cases: int,
    seconds: float,
    seed: int,
) -> dict[str, Any]:
    crashes: list[dict[str, Any]] = []
    done = accepted = 0
    t0 = time.perf_counter()
    for i in range(cases):
        if time.perf_counter() - t0 > seconds:
            break
        case = generate(random.Random(seed + i))
        try:
            accepted += bool(run(case))
        except documented:  # run() already swallows these; re-raised only by a wrong subclass
            pass
        except Exception as e:  # anything else is the crash we are looking for
            frame = traceback.extract_tb(e.__traceback__)[-1]
            crashes.append(
                {
                    "seed": seed + i,
                    "error": f"{type(e).__module__}.{type(e).__name__}",
                    "message": str(e)[:300],
                    "at": f"{Path(frame.filename).name}:{frame.lineno}",
                    "input": repr(case)[:300],
                }
            )
        done += 1
    elapsed = time.perf_counter() - t0
    out = {
        "target": name,
        "documented_error": documented.__name__,
        "cases": done,
        "accepted": accepted,  # inputs that were valid (the rest raised the documented error)
        "seconds": round(elapsed, 2),
        "cases_per_s": round(done / elapsed, 1) if elapsed else None,
        "crashes": len(crashes),
        "crash_samples": crashes[:20],
    }
    status = "OK" if not crashes else f"{len(crashes)} CRASHES"
    print(
        f"{name:<12} {done:>7} cases ({accepted:>6} accepted)  {elapsed:7.1f} s  "
        f"{out['cases_per_s']:>8} cases/s  {status}"
    )
    for c in crashes[:5]:
        print(f"    seed {c['seed']}: {c['error']} at {c['at']}: {c['message'][:160]}")
    return out


def target(name: str, work: Path) -> Target:
    """(generate, run, documented error) of one target, built only when selected."""
    if name == "safetensors":
        return gen_safetensors, SafetensorsTarget(with_loader=True).run, SafetensorsFormatError
    if name == "config":
        config_target = ConfigTarget(work / "configs")
        return config_target.generate, config_target.run, KilnError
    if name == "manifest":
        manifest_target = ManifestTarget(manifest_from_conversion(work))
        return manifest_target.generate, manifest_target.run, ManifestError
    return gen_gguf, GgufTarget(differential=True).run, GgufFormatError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000, help="cases per target")
    ap.add_argument("--seconds", type=float, default=600.0, help="time budget per target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    args = ap.parse_args()
    names = [n for n in args.targets.split(",") if n]
    if not names or set(names) - set(TARGETS):
        ap.error(f"--targets: choose among {', '.join(TARGETS)}")
    logging_off()
    with tempfile.TemporaryDirectory(prefix="kiln-fuzz-") as tmp:
        results = [
            fuzz(name, *target(name, Path(tmp)), args.cases, args.seconds, args.seed) for name in names
        ]
    stem = "fuzz" if names == list(TARGETS) else f"fuzz-{'-'.join(names)}"
    out = REPO / "bench" / "results" / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"seed": args.seed, "cases_requested": args.cases, "targets": results}, indent=2)
    )
    total = sum(r["crashes"] for r in results)
    print(f"total crashes: {total}; saved {out.relative_to(REPO)}")
    sys.exit(1 if total else 0)


def logging_off() -> None:
    import logging

    logging.disable(logging.WARNING)


if __name__ == "__main__":
    main()
