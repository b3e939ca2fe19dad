"""Sampling (top-k / top-p / seeds / min_tokens / logprobs), stop strings and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from runtime.engine import Engine, RequestOutput
from runtime.loader import load_model
from runtime.request_limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from runtime.sampling import NO_TOKEN, SAMPLING_EPS, InvalidRequestError, SamplerRow, SamplingParams, sample
from runtime.tokenizer import IncrementalDetokenizer, load_tokenizer

LOGPROB_ATOL = 1e-4


def _row(params: SamplingParams, generated: int = 0, seed: int | None = None) -> SamplerRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplerRow(params, gen, generated, eos_token_ids=(3,))


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    seen_k = {sample(logits, [_row(SamplingParams(top_k=2), seed=s)])[0][0] for s in range(200)}
    assert seen_k == {0, 1}
    # probs ≈ .63 .23 .09 ...: top_p=0.8 keeps the first two tokens (0.63 < 0.8 <= 0.86)
    seen_p = {sample(logits, [_row(SamplingParams(top_p=0.8), seed=s)])[0][0] for s in range(200)}
    assert seen_p == {0, 1}


def test_seed_makes_sampling_reproducible_and_independent_of_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.5, seed=7)
    alone = [sample(logits[1:2], [_row(params, seed=7)])[0][0] for _ in range(5)]
    rows = [_row(SamplingParams(temperature=1.0)), _row(params, seed=7), _row(SamplingParams(temperature=0))]
    assert sample(logits, rows)[0][1] == alone[0]
    assert len(set(alone)) == 1


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 10.0  # eos
    logits[0, 5] = 9.0  # stop token
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [_row(p, generated=0)])[0] == [int(logits[0, :3].argmax())]
    assert sample(logits, [_row(p, generated=2)])[0] == [3]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    tokens, lps = sample(logits, [_row(SamplingParams(temperature=0, logprobs=3))])
    ref = torch.log_softmax(logits[0], -1)
    lp = lps[0]
    assert lp is not None and lp.token_id == tokens[0] == int(ref.argmax())
    assert abs(lp.logprob - float(ref.max())) < LOGPROB_ATOL
    assert list(lp.top) == ref.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0.0),
        SamplingParams(logprobs=21),
        SamplingParams(min_tokens=5, max_tokens=2),
        SamplingParams(stop=[""]),
        SamplingParams(temperature=float("nan")),
        SamplingParams(temperature=float("inf")),
        SamplingParams(top_p=float("nan")),
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)),
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]),
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
    ],
)
def test_invalid_params_are_refused(params: SamplingParams) -> None:
    with pytest.raises(InvalidRequestError):
        params.validate()


def test_incremental_detokenizer_holds_back_split_utf8(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    tok = load_tokenizer(llama_artifact[1])
    text = "héllo wörld — 日本語 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # byte-level: multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, tok("prompt: ", add_special_tokens=False)["input_ids"])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens completed no character


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(rid, prompt, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_stop_strings_are_trimmed_and_never_streamed(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    engine = Engine(load_model(llama_artifact[1]), max_num_seqs=2, max_model_len=128)
    prompt = list(range(60, 80))
    free = "".join(
        o.text_delta
        for o in _run(engine, "free", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    )
    assert len(free) >= 8
    stop = free[5:8]
    outs = _run(
        engine, "stopped", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )
    text = "".join(o.text_delta for o in outs)
    assert text == free[: free.index(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


def test_prompt_logprobs_match_transformers(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    hf, path = llama_artifact
    engine = Engine(load_model(path), max_num_seqs=1, max_model_len=128)
    prompt = list(range(30, 50))
    outs = _run(engine, "p", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    plp = outs[0].prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(prompt)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert entry is not None and entry.token_id == prompt[i]
        assert abs(entry.logprob - float(ref[i - 1, prompt[i]])) < LOGPROB_ATOL


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-45),  # greedy: dividing by it would overflow to ±inf
        SamplingParams(temperature=SAMPLING_EPS / 2, top_p=5e-324),
        SamplingParams(temperature=1.0, top_p=5e-324),  # the mode alone
        SamplingParams(temperature=2.0, top_k=1),
    ],
)
def test_degenerate_parameters_sample_the_mode(params: SamplingParams) -> None:
    logits = torch.tensor([[1.0, 7.0, 3.0, -2.0]])
    for seed in range(20):
        assert sample(logits, [_row(params, seed=seed)])[0] == [1]


def test_a_row_without_samplable_logits_fails_alone() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(2))
    logits[1, 3] = float("nan")  # a model failure in one row
    logits[2, 5] = float("inf")
    everything_banned = SamplingParams(temperature=0.8, min_tokens=3, stop_token_ids=list(range(12)))
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, logprobs=2)):
        rows = [_row(params, seed=1), _row(params, seed=1), _row(params, seed=1), _row(everything_banned)]
        tokens, lps = sample(logits, rows)
        assert tokens[1:] == [NO_TOKEN, NO_TOKEN, NO_TOKEN]
        assert 0 <= tokens[0] < 12 and tokens[0] == sample(logits[:1], rows[:1])[0][0]
        assert lps[1:] == [None, None, None]
