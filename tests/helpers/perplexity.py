"""Perplexity of artifacts on the fixed text of the real-model tests (devtools/builders/smollm2.py's
PERPLEXITY_TEXT, the same four windows of 512 tokens), for tests that compare two conversions."""

from __future__ import annotations

from pathlib import Path

from devtools.builders import smollm2
from devtools.eval import runtime_logits_fn, text_perplexity
from runtime.engine import torch_threads
from runtime.loader import load_model

WINDOWS = 4
SCORED_PER_WINDOW = 511


def fixed_text_perplexities(artifacts: dict[str, Path]) -> dict[str, float]:
    """name -> perplexity of that artifact, served by the runtime at 2 threads (the caller's count
    restored after)."""
    text = smollm2.PERPLEXITY_TEXT.read_text()
    out = {}
    with torch_threads(2):
        for name, path in artifacts.items():
            loaded = load_model(path)
            assert loaded.tokenizer is not None
            result = text_perplexity(runtime_logits_fn(loaded), loaded.tokenizer, text)
            assert result.windows == WINDOWS and result.tokens_scored == WINDOWS * SCORED_PER_WINDOW
            out[name] = result.perplexity
    return out
