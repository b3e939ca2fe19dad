"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds, logprobs).

Logprobs are those of the raw model distribution (log_softmax of the logits, before temperature,
top-k and top-p), as vLLM reports them. `min_tokens` masks EOS and `stop_token_ids` until that many
tokens were generated. A request with a `seed` samples from its own `torch.Generator`, so its output
does not depend on what else is in the batch.

One request's parameters or logits never harm another's: a temperature under `SAMPLING_EPS` is
greedy (dividing by it overflows), non-finite parameters and banned sets covering the vocabulary are
refused by `validate`, and a row whose logits hold no finite value gets `NO_TOKEN` — the engine
ends that request alone with an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from runtime import request_limits as limits
from runtime.request_limits import InvalidRequestError

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM)
NO_TOKEN = -1  # `sample`'s token for a row it could not sample (no finite logit)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed seed, as vLLM and torch take it


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-n alternatives per generated token (0: only the chosen token)
    prompt_logprobs: int | None = None  # same for prompt tokens (echo + logprobs)
    echo: bool = False  # the server prepends the prompt; the engine does not use it

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name, n in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty")
        limits.check_stop(self.stop, self.stop_token_ids)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad(f"seed must be a 64-bit signed integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n tokens of this position and their logprobs


def _apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(V,) logits with everything outside the top-k / nucleus set to -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, idx, sorted_logits)
    return logits


def token_logprobs(logprobs_row: torch.Tensor, token_id: int, n: int) -> TokenLogprob:
    """One position's logprob entry from its (V,) log-softmax row."""
    top: dict[int, float] = {}
    if n > 0:
        vals, ids = torch.topk(logprobs_row, n)
        top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs_row[token_id]), top=top)


@dataclass
class SamplerRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    generator: torch.Generator | None
    num_generated: int
    eos_token_ids: tuple[int, ...]


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token of each row of (B, V) logits, plus its logprob entry when the row asked for one.
    A row holding NaN or +inf, or no finite logit after its bans, gets `NO_TOKEN`; the other rows
    are unaffected."""
    logits = logits.float().cpu()  # per-request CPU generators; .tolist() syncs anyway
    all_greedy = all(r.params.greedy and r.params.min_tokens <= r.num_generated for r in rows)
    if all_greedy and all(r.params.logprobs is None for r in rows):
        broken = _broken_rows(logits).tolist()
        best = logits.argmax(dim=-1).tolist()
        return [NO_TOKEN if bad else t for t, bad in zip(best, broken, strict=True)], [None] * len(rows)

    tokens: list[int] = []
    lps: list[TokenLogprob | None] = []
    broken = _broken_rows(logits).tolist()
    for i, row in enumerate(rows):
        token = NO_TOKEN if broken[i] else _sample_row(logits[i], row)
        tokens.append(token)
        p = row.params
        lps.append(
            token_logprobs(torch.log_softmax(logits[i], dim=-1), token, p.logprobs)
            if p.logprobs is not None and token != NO_TOKEN
            else None
        )
    return tokens, lps


def _broken_rows(logits: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows of (B, V) logits a model failure left with NaN, +inf or no finite value."""
    return logits.isnan().any(dim=-1) | logits.isposinf().any(dim=-1) | ~logits.isfinite().any(dim=-1)


def _sample_row(raw: torch.Tensor, row: SamplerRow) -> int:
    """One row's token from its (V,) fp32 logits (no NaN / +inf), or NO_TOKEN when its bans leave
    no finite logit."""
    p = row.params
    work = raw
    if row.num_generated < p.min_tokens:
        banned = [t for t in (*row.eos_token_ids, *p.stop_token_ids) if 0 <= t < raw.numel()]
        if banned:
            work = raw.clone()
            work[banned] = float("-inf")
    best = int(work.argmax())
    if not math.isfinite(float(work[best])):
        return NO_TOKEN
    if p.greedy:
        return best
    scaled = _apply_top_k_top_p(work / p.temperature, p.top_k, p.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return best  # a distribution that degenerated numerically: its mode
    return int(torch.multinomial(probs, 1, generator=row.generator))
