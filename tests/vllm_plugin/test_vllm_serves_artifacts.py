"""vLLM's real CPU build serves Kiln's SmolLM2 artifacts through the plugin: `vllm serve ARTIFACT
--load-format kiln` answers the chat question, its prompt log-probabilities over the OpenAI API
match `kiln serve` on the same artifact, and no tensor was transformed at load (every parameter of
vLLM's model is still a view of the artifact's memory mapping after vLLM finished loading)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.convert.library import ConversionRequest, convert
from tests.helpers.synthetic import write_checkpoint
from tests.runtime.serving import MODEL_NAME, serve_artifact
from tests.vllm_plugin.vllm_host import VllmLaunch, launch, run_to_exit

pytestmark = pytest.mark.vllm

QUESTION = "What is the capital of France?"
TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889."
)
# |Δ log-probability| of the prompt tokens, vLLM vs kiln serve on the same artifact. Both run the same
# kernels on the same bytes; they differ in the rest of the model: vLLM keeps the residual stream,
# norms, attention and logits in bf16, kiln serve keeps the residual stream and norms in fp32 (and
# everything in fp32 on a CPU without native bf16). Measured (Xeon without avx512_bf16, 51 tokens):
# max 0.25 / 0.16 / 0.27 and mean 0.032 / 0.028 / 0.048 for bf16 / online FP8 / GPTQ int4.
PROMPT_LOGPROB_MAX_ATOL = 0.5
PROMPT_LOGPROB_MEAN_ATOL = 0.1
ARTIFACTS = ["smollm2_artifact_cpu_bf16", "smollm2_artifact_cpu_fp8_online", "smollm2_artifact_cpu_int4_gptq"]


def _prompt_logprobs(body: dict[str, Any]) -> tuple[list[str], list[float]]:
    lp = body["choices"][0]["logprobs"]
    tokens, values = lp["tokens"], lp["token_logprobs"]
    n = len(tokens) - 1  # the last entry is the generated token
    return tokens[:n], [v for v in values[1:n]]  # the first prompt token has no context


@contextmanager
def launched_together(
    artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmLaunch]]:
    """`vllm serve` for every artifact, all started at once (start-up is mostly imports, one core
    each, so two cores start them in about half the time one after the other would take); each test
    waits for its own and stops it. Whatever is left is stopped at the end."""
    launches: dict[str, VllmLaunch] = {}
    try:
        for name, artifact in artifacts.items():
            launches[name] = launch(artifact, tmp_path_factory.mktemp(f"vllm-{name}"))
        yield launches
    finally:
        for started in launches.values():
            started.stop()


@pytest.fixture(scope="module")
def smollm2_launches(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmLaunch]]:
    with launched_together({f: request.getfixturevalue(f) for f in ARTIFACTS}, tmp_path_factory) as launches:
        yield launches


@pytest.mark.parametrize("fixture", ARTIFACTS)
def test_vllm_serves_a_kiln_artifact_as_kiln_serve_does(
    fixture: str, request: pytest.FixtureRequest, smollm2_launches: dict[str, VllmLaunch]
) -> None:
    artifact: Path = request.getfixturevalue(fixture)
    completion = {"prompt": TEXT, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    started = smollm2_launches[fixture]
    try:
        vllm = started.ready()
        report = vllm.report
        answer = vllm.chat(messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0)
        from_vllm = vllm.completions(**completion)
    finally:
        started.stop()

    # No tensor transform at load: after vLLM's whole load (its post-processing included), every
    # parameter is a view of the artifact's mapping, none was copied, and none was replaced.
    assert report["parameters"] > 0
    assert report["views"] == report["parameters"], report["not_views"][:5]
    assert report["copied"] == [] and report["changed_after_binding"] == []
    assert report["process_weights_after_loading_calls"] > 0  # vLLM asked; Kiln's methods had nothing to do
    assert "Paris" in answer["choices"][0]["message"]["content"]

    with serve_artifact(artifact) as kiln:
        r = httpx.post(
            f"{kiln.base_url}/v1/completions", json={"model": MODEL_NAME, **completion}, timeout=120
        )
        r.raise_for_status()
    tokens_vllm, lp_vllm = _prompt_logprobs(from_vllm)
    tokens_kiln, lp_kiln = _prompt_logprobs(r.json())
    assert tokens_vllm == tokens_kiln
    diffs = [abs(a - b) for a, b in zip(lp_vllm, lp_kiln, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"{fixture}: {len(diffs)} prompt tokens, max |Δ logprob| {max(diffs):.3f}, mean {mean:.4f}")
    assert max(diffs) <= PROMPT_LOGPROB_MAX_ATOL
    assert mean <= PROMPT_LOGPROB_MEAN_ATOL


def test_vllm_refuses_a_gpu_artifact_on_cpu_before_reading_a_weight(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", "gptq")
    artifact = Path(convert(ConversionRequest(str(src), ["sm80"], out=str(tmp_path / "out")))[0].uri)
    returncode, log = run_to_exit(artifact, tmp_path, "--skip-tokenizer-init")  # a synthetic checkpoint
    assert returncode != 0
    refusal = "TargetMismatchError: artifact built for sm80; this machine has no CUDA device"
    assert f"{refusal} — convert with --target cpu" in log
    assert "kiln: ka-" not in log  # nothing was bound


# Mixture-of-experts: tiny random Qwen3-MoE (GPTQ int4 experts) and Mixtral (FP8 experts), converted for
# cpu here. vLLM routes (softmax, top-k, renormalise) and calls Kiln's expert-group kernel on the
# stacked experts. Measured |Δ log-probability| against kiln serve over 179 prompt tokens: median
# 0.0068 / 0.0046, mean 0.0074 / 0.0061, max 0.030 / 0.111 (a router near-tie can flip an expert, so
# the bound is on the median and the mean).
MOE_ARTIFACTS = ["qwen3_moe_gptq", "mixtral_fp8_dynamic"]
MOE_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
MOE_LOGPROB_MEDIAN_ATOL = 0.03
MOE_LOGPROB_MEAN_ATOL = 0.05


@pytest.fixture(scope="module")
def moe_artifacts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("moe-artifacts")
    return {
        f: Path(convert(ConversionRequest(str(request.getfixturevalue(f)), ["cpu"], out=str(out)))[0].uri)
        for f in MOE_ARTIFACTS
    }


@pytest.fixture(scope="module")
def moe_launches(
    moe_artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmLaunch]]:
    with launched_together(moe_artifacts, tmp_path_factory) as launches:
        yield launches


@pytest.mark.parametrize("fixture", MOE_ARTIFACTS)
def test_vllm_serves_a_kiln_moe_artifact_as_kiln_serve_does(
    fixture: str, moe_artifacts: dict[str, Path], moe_launches: dict[str, VllmLaunch]
) -> None:
    artifact = moe_artifacts[fixture]
    completion = {"prompt": MOE_PROMPT, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    started = moe_launches[fixture]
    try:
        vllm = started.ready()
        report = vllm.report
        from_vllm = vllm.completions(**completion)
    finally:
        started.stop()
    # The only copies: the tiny models' 259-row embeddings and lm_head, which vLLM pads to 320 rows.
    assert report["views"] + len(report["copied"]) == report["parameters"], report["not_views"][:5]
    assert all("(padded from 259 to 320 rows)" in c for c in report["copied"]), report["copied"]
    assert report["changed_after_binding"] == []
    assert any(name.endswith("_experts") for name in (k.split(":")[1] for k in report["layers_run_on"]))

    with serve_artifact(artifact) as kiln:
        r = httpx.post(
            f"{kiln.base_url}/v1/completions", json={"model": MODEL_NAME, **completion}, timeout=120
        )
        r.raise_for_status()
    tokens_vllm, lp_vllm = _prompt_logprobs(from_vllm)
    tokens_kiln, lp_kiln = _prompt_logprobs(r.json())
    assert tokens_vllm == tokens_kiln
    diffs = sorted(abs(a - b) for a, b in zip(lp_vllm, lp_kiln, strict=True))
    median, mean = diffs[len(diffs) // 2], sum(diffs) / len(diffs)
    print(
        f"{fixture}: {len(diffs)} prompt tokens, |Δ logprob| median {median:.4f}, mean {mean:.4f}, "
        f"max {diffs[-1]:.3f}"
    )
    assert median <= MOE_LOGPROB_MEDIAN_ATOL
    assert mean <= MOE_LOGPROB_MEAN_ATOL
