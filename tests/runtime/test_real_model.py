"""Acceptance on the real SmolLM2-135M-Instruct: CPU artifacts (bf16 passthrough, llm-compressor
FP8_DYNAMIC, llm-compressor GPTQ W4A16, AutoAWQ-packed AWQ) against a reference forward.

The reference is transformers' `LlamaForCausalLM` in fp32 holding the *source checkpoint's*
weights, dequantized by the format's own library (tests/fixtures/checkpoints.py) — so the only
differences left are the runtime's kernels computing in bf16 activations. Perplexity on the GPL-3
text is reported per artifact (printed and saved to bench/results/real_model_perplexity.json) and
checked against the figures measured on this machine (docs/formats.md §17.3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from devtools.builders import smollm2
from devtools.eval import generate_greedy, runtime_logits_fn, text_perplexity
from runtime.chat import apply_chat_template
from runtime.loader import LoadedModel, load_model
from tests.fixtures.checkpoints import WEIGHT_ONLY, reference_model
from tests.helpers.greedy import GreedyJudgement, judge_greedy_tokens

# Tolerances between the runtime (bf16 activations through 30 layers) and the fp32 reference on the
# same weights. Measured on the fixed prompts: max |Δlogit| ≈ 0.8–1.1 with logits of std ≈ 6.5.
LOGITS_MAX_ABS_TOL = 2.0  # any position, any vocabulary entry
LOGITS_MEAN_ABS_TOL = 0.25  # averaged over positions and vocabulary
# Where the runtime's argmax differs from the reference's, it must be a near-tie in the reference.
ARGMAX_MARGIN_TOL = 0.5  # reference logit of the runtime's argmax >= reference max - this

GREEDY_TOKENS = 32
GREEDY_PROMPTS = 2  # the chat question and the first text prompt (decode is the slow part on 2 cores)

# Perplexity (GPL-3 text, first 2048 tokens in 4 windows of 512), measured in fp32 on this machine:
PUBLISHED_PPL = {"fp32": 23.762, "gptq": 27.195, "fp8_dynamic": 24.203}
PPL_REL_TOL = 0.05  # bf16 activations vs fp32, and a re-run GPTQ calibration vs the published one
# AWQ-packed uses AWQ's round-to-nearest zero-point recipe without the activation-aware scale
# search, so it sits above GPTQ and llm-compressor's searched AWQ (26.787): measured 30.437 here.
AWQ_RTN_PPL_RANGE = (PUBLISHED_PPL["fp32"], PUBLISHED_PPL["fp32"] * 1.35)

PPL_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "real_model_perplexity.json"

FRANCE = "What is the capital of France? Answer in one sentence."
TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Meanwhile, in the capital of France,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]

# case -> (artifact fixture, source checkpoint fixture, perplexity expectation (low, high))
CASES: dict[str, tuple[str, str, tuple[float, float]]] = {
    "bf16": (
        "smollm2_artifact_cpu_bf16",
        "smollm2_bf16",
        (PUBLISHED_PPL["fp32"] * (1 - PPL_REL_TOL), PUBLISHED_PPL["fp32"] * (1 + PPL_REL_TOL)),
    ),
    "fp8-dynamic": (
        "smollm2_artifact_cpu_fp8",
        "smollm2_fp8_dynamic",
        (PUBLISHED_PPL["fp8_dynamic"] * (1 - PPL_REL_TOL), PUBLISHED_PPL["fp8_dynamic"] * (1 + PPL_REL_TOL)),
    ),
    "int4-gptq": (
        "smollm2_artifact_cpu_int4_gptq",
        "smollm2_gptq",
        (PUBLISHED_PPL["gptq"] * (1 - PPL_REL_TOL), PUBLISHED_PPL["gptq"] * (1 + PPL_REL_TOL)),
    ),
    "int4-awq": ("smollm2_artifact_cpu_int4_awq", "smollm2_awq_packed", AWQ_RTN_PPL_RANGE),
}


@dataclass
class Case:
    name: str
    loaded: LoadedModel
    reference: Any  # transformers LlamaForCausalLM, fp32
    ppl_range: tuple[float, float]

    def prompt_ids(self) -> list[list[int]]:
        tok = self.loaded.tokenizer
        assert tok is not None
        chat = apply_chat_template(tok, [{"role": "user", "content": FRANCE}])
        return [chat] + [tok(p, add_special_tokens=False)["input_ids"] for p in TEXT_PROMPTS]


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    torch.set_num_threads(2)
    artifact_fixture, source_fixture, ppl_range = CASES[request.param]
    artifact: Path = request.getfixturevalue(artifact_fixture)
    source: Path = request.getfixturevalue(source_fixture)
    return Case(request.param, load_model(artifact), reference_model(source), ppl_range)


@torch.inference_mode()
def test_logits_match_reference(case: Case) -> None:
    logits_fn = runtime_logits_fn(case.loaded)
    for ids in case.prompt_ids():
        x = torch.tensor([ids])
        got = logits_fn(x)[0].float()  # (T, V)
        want = case.reference(x).logits[0].float()
        diff = (got - want).abs()
        assert diff.max().item() <= LOGITS_MAX_ABS_TOL, f"max |Δ| {diff.max().item():.3f}"
        assert diff.mean().item() <= LOGITS_MEAN_ABS_TOL, f"mean |Δ| {diff.mean().item():.3f}"
        chosen = want.gather(1, got.argmax(-1, keepdim=True))[:, 0]
        margin = (want.max(-1).values - chosen).max().item()
        assert margin <= ARGMAX_MARGIN_TOL, f"runtime argmax {margin:.3f} below the reference's max"


@torch.inference_mode()
def _judge_on_own_prefix(case: Case, prompt: list[int], got: list[int]) -> GreedyJudgement:
    """The runtime's greedy tokens against the reference's logits on the same prefix."""
    tok = case.loaded.tokenizer
    logits = case.reference(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]  # (len(got), V)
    return judge_greedy_tokens(got, logits, clear=ARGMAX_MARGIN_TOL, describe=lambda t: repr(tok.decode(t)))


def test_greedy_answer_identical_to_reference(case: Case) -> None:
    """The chat answer, up to and including end-of-turn: token for token the reference's greedy
    choice on the same prefix wherever the reference's top-2 margin is at least ARGMAX_MARGIN_TOL;
    at its near ties (e.g. "Paris." vs "Paris" + end-of-turn, 0.1 apart) either token."""
    tok = case.loaded.tokenizer
    assert tok is not None
    ids = case.prompt_ids()[0]
    got = generate_greedy(case.loaded, ids, GREEDY_TOKENS).token_ids
    judged = _judge_on_own_prefix(case, ids, got)
    print(f"\n{case.name}: {tok.decode(got)!r}: {judged.summary(len(got))}")
    assert got[-1] == tok.eos_token_id and "Paris" in tok.decode(got)


def test_greedy_32_tokens_follow_reference(case: Case) -> None:
    """32 greedy tokens (past end-of-turn), each judged as the chat answer's are.

    With bf16 activations against an fp32 reference, exact equality of a long free-running
    continuation only holds by luck: on this model every 32-token path passes positions whose top-2
    reference logits differ by < 0.1, and logits carry ≈1 of bf16 noise. Checking every step against
    the reference on the runtime's own prefix catches any real deviation at every position.
    """
    for ids in case.prompt_ids()[:GREEDY_PROMPTS]:
        got = generate_greedy(case.loaded, ids, GREEDY_TOKENS, ignore_eos=True).token_ids
        assert len(got) == GREEDY_TOKENS
        _judge_on_own_prefix(case, ids, got)


def record_perplexity(name: str, result: dict[str, Any]) -> None:
    from filelock import FileLock

    PPL_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(PPL_RESULTS) + ".lock"):
        data = json.loads(PPL_RESULTS.read_text()) if PPL_RESULTS.is_file() else {}
        data[name] = result
        PPL_RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def test_perplexity_on_gpl3(case: Case) -> None:
    tok = case.loaded.tokenizer
    assert tok is not None
    result = text_perplexity(runtime_logits_fn(case.loaded), tok, smollm2.PERPLEXITY_TEXT.read_text())
    low, high = case.ppl_range
    print(f"\nperplexity {case.name} ({case.loaded.manifest.artifact_id}): {result.perplexity:.3f}")
    record_perplexity(
        case.name,
        {
            **result.to_json(),
            "artifact_id": case.loaded.manifest.artifact_id,
            "kernels": sorted({e.kernel for e in case.loaded.manifest.layers.values()}),
            "expected_range": [low, high],
        },
    )
    assert result.windows == 4 and result.tokens_scored == 4 * 511
    assert low <= result.perplexity <= high, (
        f"{case.name}: {result.perplexity:.3f} not in [{low:.3f}, {high:.3f}]"
    )


@pytest.mark.parametrize(
    "artifact_fixture", ["smollm2_artifact_cpu_fp8_online", "smollm2_artifact_cpu_int4_gptq"]
)
def test_demo_answers_paris(artifact_fixture: str, request: pytest.FixtureRequest) -> None:
    """The two artifacts `make demo` builds answer its question correctly through the demo's own path."""
    from devtools.demo import answer

    result = answer(request.getfixturevalue(artifact_fixture))
    assert "Paris" in result.text, result.text
    assert result.tokens > 0 and result.load_s > 0


LLMCOMPRESSOR_AWQ_PPL = 26.787  # measured here (docs/formats.md §17.3)


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_llmcompressor_awq_end_to_end(smollm2_bf16: Path) -> None:
    """llm-compressor's real AWQ (≈18 min on 2 quiet cores): quantize, convert for cpu and sm80,
    verify, then serve the cpu artifact: perplexity near the published figure, and the demo answer."""
    from devtools.demo import answer
    from runtime.artifact.manifest import Manifest

    source = smollm2.build_awq_llmcompressor()
    qcfg = json.loads((source / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "pack-quantized"
    (group,) = qcfg["config_groups"].values()
    assert group["weights"]["symmetric"] is False and group["weights"]["group_size"] == smollm2.GROUP_SIZE

    for target in ("cpu", "sm80"):
        manifest = Manifest.load(smollm2.build_artifact(source, target))
        assert manifest.verification.ok and manifest.verification.layers_checked == len(manifest.layers)
    cpu = smollm2.build_artifact(source, "cpu", **WEIGHT_ONLY)  # the published figure is weight-only's
    loaded = load_model(cpu)
    assert {e.kernel for e in loaded.manifest.layers.values()} == {"cpu_int4"}
    assert loaded.tokenizer is not None
    result = text_perplexity(runtime_logits_fn(loaded), loaded.tokenizer, smollm2.PERPLEXITY_TEXT.read_text())
    print(f"\nperplexity llmcompressor-awq ({loaded.manifest.artifact_id}): {result.perplexity:.3f}")
    record_perplexity(
        "int4-awq-llmcompressor", {**result.to_json(), "artifact_id": loaded.manifest.artifact_id}
    )
    low, high = LLMCOMPRESSOR_AWQ_PPL * (1 - PPL_REL_TOL), LLMCOMPRESSOR_AWQ_PPL * (1 + PPL_REL_TOL)
    assert low <= result.perplexity <= high
    assert "Paris" in answer(cpu).text
