"""Perplexity of a causal LM over a fixed text, comparable across Kiln artifacts and peers.

The protocol (the one the reference figures in `docs/formats.md §17.3` were measured with): tokenize
the text without special tokens, keep the first `max_tokens` (2048) tokens, cut them into
non-overlapping windows of `window` (512) tokens, run each window from an empty context, and score
every token of a window but its first (511 predictions per window). Perplexity is
exp(total NLL / number of predictions). SmolLM2-135M-Instruct fp32 on the GPL-3 text: 23.762.

The model is any callable mapping token ids (1, T) int64 to logits (1, T, V); this keeps the module
free of a particular model class (the runtime's model, transformers, a reference forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PPL_MAX_TOKENS = 2048
PPL_WINDOW = 512

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens_scored: int
    windows: int
    window_perplexities: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "perplexity": self.perplexity,
            "nll": self.nll,
            "tokens_scored": self.tokens_scored,
            "windows": self.windows,
            "window_perplexities": list(self.window_perplexities),
        }


def perplexity_windows(
    token_ids: Sequence[int], *, max_tokens: int = PPL_MAX_TOKENS, window: int = PPL_WINDOW
) -> list[list[int]]:
    """The windows scored: the first `max_tokens` ids in non-overlapping chunks of `window` (a shorter
    tail chunk is dropped so every window has the same context length)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    ids = list(token_ids[:max_tokens])
    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise ValueError(f"text has {len(ids)} tokens; at least one window of {window} is needed")
    return windows


@torch.inference_mode()
def perplexity(
    logits_fn: LogitsFn,
    token_ids: Sequence[int],
    *,
    max_tokens: int = PPL_MAX_TOKENS,
    window: int = PPL_WINDOW,
) -> PerplexityResult:
    total_nll = 0.0
    total_tokens = 0
    per_window: list[float] = []
    for chunk in perplexity_windows(token_ids, max_tokens=max_tokens, window=window):
        ids = torch.tensor([chunk], dtype=torch.long)
        logits = logits_fn(ids)  # (1, T, V)
        if logits.shape[:2] != ids.shape:
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for input {tuple(ids.shape)}")
        nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum").item()
        total_nll += nll
        total_tokens += len(chunk) - 1
        per_window.append(math.exp(nll / (len(chunk) - 1)))
    mean = total_nll / total_tokens
    return PerplexityResult(
        perplexity=math.exp(mean),
        nll=mean,
        tokens_scored=total_tokens,
        windows=len(per_window),
        window_perplexities=tuple(per_window),
    )


def text_perplexity(
    logits_fn: LogitsFn,
    tokenizer: Any,
    text: str,
    *,
    max_tokens: int = PPL_MAX_TOKENS,
    window: int = PPL_WINDOW,
) -> PerplexityResult:
    """Tokenize `text` with a Hugging Face tokenizer (no special tokens) and score it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return perplexity(logits_fn, ids, max_tokens=max_tokens, window=window)


def runtime_logits_fn(loaded: Any) -> LogitsFn:
    """A `LogitsFn` over a model loaded by `runtime.loader.load_model`: one prefill per call, from an
    empty one-slot KV cache sized to the input (so each window starts from an empty context)."""
    from runtime.engine import Engine

    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        engine = Engine(loaded, max_num_seqs=1, max_model_len=ids.shape[1])
        return engine.model.prefill(ids[0], 0, engine.cache, all_logits=True)[None]

    return logits_fn


@torch.inference_mode()
def decode_path_logits(loaded: Any, prompt_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """The runtime's logits along a fixed continuation, as a generation computes them: the prompt's
    prefill predicts tokens[0], then one decode step per token (the engine's step: native where it
    covers the model) predicts the next. (len(tokens), V) fp32: row i is the prediction of tokens[i]."""
    from runtime.engine import Engine

    engine = Engine(loaded, max_num_seqs=1, max_model_len=len(prompt_ids) + len(tokens))
    rows = [engine.model.prefill(torch.tensor(list(prompt_ids)), 0, engine.cache).float()]
    for i, token in enumerate(tokens[:-1]):
        step = engine.decode(torch.tensor([token]), [0], [len(prompt_ids) + i], engine.cache)
        rows.append(step[0].float())
    return torch.stack(rows)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    first_token_s: float  # request start -> first token (prefill)
    decode_s: float  # first token -> last token

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def generate_greedy(
    loaded: Any, prompt_ids: Sequence[int], max_tokens: int, *, ignore_eos: bool = False
) -> Generation:
    """One greedy request through the runtime's engine (batch of one), timed."""
    import time

    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    engine = Engine(loaded, max_num_seqs=1, max_model_len=len(prompt_ids) + max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    started = time.perf_counter()
    engine.add_request("greedy", list(prompt_ids), params)
    tokens: list[int] = []
    text: list[str] = []
    first = last = started
    finish: str | None = None
    while engine.has_unfinished():
        for out in engine.step():
            last = time.perf_counter()
            if not tokens:
                first = last
            tokens.extend(out.new_token_ids)
            text.append(out.text_delta)
            if out.finished:
                finish = out.finish_reason
    return Generation(tokens, "".join(text), finish, first - started, last - first)
