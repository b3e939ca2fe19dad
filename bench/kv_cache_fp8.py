"""Perplexity cost and memory of the FP8 KV cache (`--kv-cache-dtype fp8`) vs the compute dtype.

Scores the GPL-3 text (tests/data/gpl-3.txt) with the runtime's decode path, one token at a time,
so that every prediction reads its context back from the KV cache (a prefill never reads the cache):
window of `--tokens` tokens, the first token prefilled, the rest teacher-forced through `decode`.
Both caches run in the same process on the same artifact; prints and saves the ratio.

    .venv/bin/python bench/kv_cache_fp8.py ARTIFACT_DIR [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # run as a script, bench/ comes first and bench/runtime.py shadows the package

import torch  # noqa: E402

from runtime.engine import Engine  # noqa: E402
from runtime.loader import load_model  # noqa: E402


@torch.inference_mode()
def decode_perplexity(engine: Engine, ids: list[int]) -> float:
    model, cache = engine.model, engine.cache
    logits = model.prefill(torch.tensor(ids[:1]), 0, cache)
    nll = 0.0
    for pos in range(1, len(ids)):
        nll -= float(torch.log_softmax(logits.float(), -1)[ids[pos]])
        logits = model.decode(torch.tensor([ids[pos]]), [0], [pos], cache)[0]
    return math.exp(nll / (len(ids) - 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    text = (ROOT / "tests/data/gpl-3.txt").read_text()
    results: dict[str, dict[str, float]] = {}
    for kv in ("auto", "fp8"):
        loaded = load_model(args.artifact, kv_cache_dtype=kv)  # type: ignore[arg-type]
        assert loaded.tokenizer is not None
        ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
        engine = Engine(loaded, max_num_seqs=1, max_model_len=max(args.tokens, 64))
        started = time.perf_counter()
        ppl = decode_perplexity(engine, ids)
        results[kv] = {
            "perplexity": ppl,
            "kv_bytes_per_token": engine.cache.nbytes / engine.cache.max_len,
            "seconds": time.perf_counter() - started,
        }
        print(f"{kv:>4}: perplexity {ppl:.4f}  KV bytes/token {results[kv]['kv_bytes_per_token']:.0f}")
    cost = results["fp8"]["perplexity"] / results["auto"]["perplexity"] - 1
    mem = results["fp8"]["kv_bytes_per_token"] / results["auto"]["kv_bytes_per_token"]
    print(f"fp8 KV cache: perplexity {cost * 100:+.2f}%, memory x{mem:.2f} of auto")
    out = ROOT / "bench/results/kv_cache_fp8.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "artifact": str(args.artifact),
                "tokens": args.tokens,
                **results,
                "ppl_increase": cost,
                "memory_ratio": mem,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
