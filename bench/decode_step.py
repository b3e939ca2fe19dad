"""The decode step alone: the native step (runtime/native_decode.py) against the eager torch forward
on the same artifact, at 1 and 2 threads, batch 1 / 8 / 16, in one run.

    .venv/bin/python bench/decode_step.py [--artifact DIR] [--threads 1,2] [--batches 1,8,16]
                                          [--steps 64] [--rounds 3]

Each (threads, step) pair runs in a fresh process (the native pool's size is fixed per process);
a process prefills every sequence with the same 40 tokens, then times `--steps` greedy decode steps
at positions 40.. (after 8 warm-up steps), the fastest of `--rounds`. Default artifact: the SmolLM2
GPTQ int4 CPU artifact with the cpu defaults (cpu_w4a8, int8 head; devtools/builders/smollm2.py,
built on first use). Prints ms per step and
the ratios native / eager (> 1: native is faster) and 2 threads / 1 thread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)

PROMPT_TOKENS = 40
WARMUP_STEPS = 8


def child(
    path: str, step: str, threads: int, batches: list[int], steps: int, rounds: int
) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    from runtime.kv_cache import KVCache
    from runtime.loader import load_model
    from runtime.native_decode import native_decoder

    lm = load_model(Path(path))
    cfg = lm.config
    max_len = PROMPT_TOKENS + WARMUP_STEPS + steps + 8
    lm.model.setup(lm.dtype, max_len, "cpu")
    cache = KVCache(
        num_layers=cfg.num_layers, num_slots=max(batches), max_len=max_len, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=lm.dtype,
    )  # fmt: skip
    decode = lm.model.decode
    if step == "native":
        native = native_decoder(lm.model, cache, threads=threads, spin_us=2000)
        if native is None:
            raise SystemExit("the native step does not cover this artifact")
        decode = native.decode
    prompt = torch.randint(0, 1000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    out: dict[str, float] = {}
    with torch.inference_mode():
        for b in batches:
            for slot in range(b):
                lm.model.prefill(prompt, slot, cache)
            slots = list(range(b))
            best = float("inf")
            for _ in range(rounds):
                tokens = torch.full((b,), 42, dtype=torch.long)
                for i in range(WARMUP_STEPS):
                    tokens = decode(tokens, slots, [PROMPT_TOKENS + i] * b, cache).argmax(-1)
                t0 = time.perf_counter()
                for i in range(steps):
                    tokens = decode(tokens, slots, [PROMPT_TOKENS + WARMUP_STEPS + i] * b, cache).argmax(-1)
                best = min(best, (time.perf_counter() - t0) / steps)
            out[str(b)] = best * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # STEP THREADS
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        step, threads = args.child
        print(json.dumps(child(args.artifact, step, int(threads), batches, args.steps, args.rounds)))
        return
    artifact = args.artifact
    if artifact is None:
        from devtools.builders import smollm2

        artifact = str(smollm2.build_artifact(smollm2.build_gptq(None), "cpu"))
    results: dict[tuple[str, int], dict[str, float]] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        for step in ("eager", "native"):
            cmd = [
                sys.executable, __file__, "--artifact", artifact, "--batches", args.batches,
                "--steps", str(args.steps), "--rounds", str(args.rounds), "--child", step, str(threads),
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
            results[(step, threads)] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"artifact {artifact}")
    print(f"{'threads':>7} {'batch':>5} {'eager ms':>9} {'native ms':>9} {'native/eager':>12}")
    thread_counts = sorted({t for _, t in results})
    for threads in thread_counts:
        for b in batches:
            e, n = results[("eager", threads)][str(b)], results[("native", threads)][str(b)]
            print(f"{threads:>7} {b:>5} {e:>9.2f} {n:>9.2f} {e / n:>11.2f}x")
    if len(thread_counts) == 2:
        lo, hi = thread_counts
        for step in ("eager", "native"):
            ratios = ", ".join(
                f"b{b} {results[(step, lo)][str(b)] / results[(step, hi)][str(b)]:.2f}x" for b in batches
            )
            print(f"{step}: {hi} threads / {lo} thread: {ratios}")


if __name__ == "__main__":
    main()
