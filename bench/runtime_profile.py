"""Per-step decode time and a torch.profiler op table for one Kiln artifact (where a token's time goes).

    .venv/bin/python bench/runtime_profile.py ARTIFACT_DIR [--batch 1] [--tokens 48] [--threads 1] [--profile]

Greedy decode of `--batch` copies of a fixed prompt after a short warm-up; prints ms per decode step
and tok/s, then (with --profile) the op table of 16 more steps sorted by self CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)  # this folder would shadow the `runtime` package

PROMPT = (
    "The printing press changed how knowledge spread across Europe. Before it, books were copied by hand."
)
WARMUP_TOKENS = 8
PROFILE_TOKENS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from runtime.engine import Engine
    from runtime.loader import load_model
    from runtime.sampling import SamplingParams

    loaded = load_model(args.artifact)
    assert loaded.tokenizer is not None
    ids = list(loaded.tokenizer(PROMPT)["input_ids"])
    engine = Engine(loaded, max_num_seqs=max(args.batch, 1), max_model_len=len(ids) + args.tokens + 64)

    def run(n: int, tag: str) -> float:
        """Seconds per decode step (after every sequence's prefill)."""
        for i in range(args.batch):
            engine.add_request(
                f"{tag}{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            )
        engine.step()
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return (time.perf_counter() - t0) / max(steps, 1)

    run(WARMUP_TOKENS, "warm")
    step_s = run(args.tokens, "measure")
    print(
        f"{args.artifact.name} batch {args.batch}: {step_s * 1e3:.2f} ms/step, "
        f"{args.batch / step_s:.1f} tok/s (dtype {loaded.dtype}, threads {args.threads})"
    )
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            run(PROFILE_TOKENS, "profile")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
