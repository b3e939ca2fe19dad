"""Greedy tokens of the runtime against a reference model, judged only where the reference decides.

A greedy choice is decided where the reference's top-2 logit margin is at least `clear`: there the
runtime must pick the reference's argmax. Where it is a near tie (margin below `clear`), ulp-level
differences of summation order, bf16 rounding points or int8 activation codes may pick the runner-up
on one machine and not on another, so the runtime's token only has to be within `clear` of the
reference's best. Both are one rule: the reference's logit of the runtime's token is at least its
maximum minus `clear`. Positions can also be marked undecided for another reason (a router
near-tie): those get `undecided_gap` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GreedyJudgement:
    decided: int  # positions held to the reference's argmax
    near_ties: list[int]  # positions whose margin was below `clear` (or marked undecided)
    departures: list[int]  # near ties where the runtime took another token than the reference's best
    worst: float  # the largest amount a token was below the reference's best

    def summary(self, total: int) -> str:
        return (
            f"{self.decided}/{total} decided, near ties at {self.near_ties}, "
            f"another token taken at {self.departures} (at most {self.worst:.3f} below the best)"
        )


def judge_greedy_tokens(
    tokens: Sequence[int],
    reference_logits: torch.Tensor,
    *,
    clear: float,
    undecided: torch.Tensor | None = None,
    undecided_gap: float | None = None,
    describe: Callable[[int], str] = str,
) -> GreedyJudgement:
    """Assert each of `tokens` against `reference_logits` (T, V), row i the reference's prediction of
    tokens[i] on the same prefix. `undecided` (T,) bool marks positions judged with `undecided_gap`.
    `describe` names a token id in the failure message."""
    assert reference_logits.shape[0] == len(tokens), (reference_logits.shape, len(tokens))
    logits = reference_logits.float()
    top2 = logits.topk(2, dim=-1).values  # (T, 2)
    margins = top2[:, 0] - top2[:, 1]
    chosen = logits.gather(1, torch.tensor(list(tokens))[:, None])[:, 0]
    decided, near_ties, departures, worst = 0, [], [], 0.0
    for i, token in enumerate(tokens):
        marked = undecided is not None and bool(undecided[i])
        gap = undecided_gap if marked and undecided_gap is not None else clear
        below = (top2[i, 0] - chosen[i]).item()
        best = int(logits[i].argmax())
        worst = max(worst, below)
        if margins[i].item() >= clear and not marked:
            decided += 1
        else:
            near_ties.append(i)
            departures += [i] if token != best else []
        assert below <= gap, (
            f"position {i}: {describe(token)} is {below:.3f} below the reference's {describe(best)} "
            f"(margin {margins[i].item():.3f}; allowed {gap})"
        )
    return GreedyJudgement(decided, near_ties, departures, worst)
