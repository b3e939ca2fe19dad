"""`kiln convert --int8-activations` on the real SmolLM2 GPTQ checkpoint: every 4-bit layer becomes a
verified cpu_w4a8 layer, the option is recorded (another artifact id), the runtime serves it — the
native decode step and the eager forward both on the kernel's library — and it answers as the
weight-only artifact does.

Perplexity cost on the fixed text of tests/runtime/test_real_model.py (same windows), against the
same checkpoint converted without the option: +0.44 % measured (27.019 -> 27.138, 2026-12-05, Xeon
AVX-512 VNNI); bound W4A8_PPL_REL_TOL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from devtools.eval import decode_path_logits, generate_greedy
from kernels.errors import UnsupportedError
from runtime.artifact.manifest import Manifest
from runtime.chat import apply_chat_template
from runtime.loader import load_model
from services.convert.library import plan
from tests.helpers.greedy import judge_greedy_tokens
from tests.helpers.perplexity import fixed_text_perplexities

W4A8_PPL_REL_TOL = 0.01  # int8 activations per weight group of 64
DEFAULTS_PPL_COST = 0.005  # the cpu defaults (int8 activations and head) against weight-only
# Int8 activation codes turn ulp-level differences (summation order, the step, the machine) into
# whole code steps: a 1-ulp change of half of layer 0's norm weights moved the w4a8 artifact's top
# logits by up to 0.75 (the weight-only artifact's by < 0.001; AVX2 EPYC, fp32, 2026-12-07).
W4A8_ANSWER_GAP = 1.0
ANSWER_TOKENS = 24


def test_every_4bit_layer_is_a_verified_cpu_w4a8_layer(
    smollm2_artifact_cpu_w4a8_gptq: Path, smollm2_artifact_cpu_int4_gptq: Path
) -> None:
    manifest = Manifest.parse((smollm2_artifact_cpu_w4a8_gptq / "manifest.json").read_text())
    assert {e.kernel for e in manifest.layers.values()} == {"cpu_w4a8"}
    for name, entry in manifest.layers.items():
        assert entry.linear_spec().int8_activations, name
        assert entry.verification is not None and entry.verification.ok, name
    assert manifest.options == {"int8_activations": True}
    plain = Manifest.parse((smollm2_artifact_cpu_int4_gptq / "manifest.json").read_text())
    assert plain.artifact_id != manifest.artifact_id


def test_int8_activations_cost_under_one_percent_of_perplexity(
    smollm2_artifact_cpu_w4a8_gptq: Path, smollm2_artifact_cpu_int4_gptq: Path
) -> None:
    ppl = fixed_text_perplexities(
        {"bf16": smollm2_artifact_cpu_int4_gptq, "int8": smollm2_artifact_cpu_w4a8_gptq}
    )
    change = ppl["int8"] / ppl["bf16"] - 1
    print(f"\nperplexity bf16 activations {ppl['bf16']:.4f}, int8 {ppl['int8']:.4f} ({change:+.3%})")
    assert abs(change) <= W4A8_PPL_REL_TOL, ppl


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
@pytest.mark.parametrize("decode_step", ["native", "eager"])
def test_the_w4a8_artifact_answers_paris(
    smollm2_artifact_cpu_w4a8_gptq: Path,
    smollm2_artifact_cpu_int4_gptq: Path,
    decode_step: str,
    act: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weight-only artifact's greedy chat answer ("The capital of France is Paris.") is, token by
    token, the w4a8 artifact's greedy choice too on the same prefix — through the native decode step
    and the eager one — or within W4A8_ANSWER_GAP of it. Not the w4a8 artifact's own free-running
    answer: "France" leads "Portugal" there by 0.17-0.28, less than the logits' noise under int8
    activations (an AVX2 machine's native step answered "The capital of Portugal ..."). Both
    activation dtypes, whichever this CPU would pick."""
    from devtools.demo import QUESTION
    from runtime import settings as settings_module

    monkeypatch.setenv("KILN_DECODE_STEP", decode_step)
    monkeypatch.setenv("KILN_CPU_ACT_DTYPE", act)
    monkeypatch.setattr(settings_module, "_current", None)
    weight_only = load_model(smollm2_artifact_cpu_int4_gptq)
    tok = weight_only.tokenizer
    assert tok is not None
    prompt = apply_chat_template(tok, [{"role": "user", "content": QUESTION}])
    answer = generate_greedy(weight_only, prompt, ANSWER_TOKENS).token_ids
    assert "Paris" in tok.decode(answer) and answer[-1] == tok.eos_token_id, tok.decode(answer)
    int8_activations = load_model(smollm2_artifact_cpu_w4a8_gptq)
    assert weight_only.dtype == int8_activations.dtype == getattr(torch, act)
    steps = decode_path_logits(int8_activations, prompt, answer)
    judged = judge_greedy_tokens(answer, steps, clear=W4A8_ANSWER_GAP, describe=lambda t: repr(tok.decode(t)))
    print(f"\n{tok.decode(answer)!r} under int8 activations ({decode_step}): {judged.summary(len(answer))}")


def test_the_cpu_defaults_are_w4a8_layers_and_the_int8_head_within_half_a_percent_of_perplexity(
    smollm2_artifact_cpu_gptq_default: Path, smollm2_artifact_cpu_int4_gptq: Path
) -> None:
    """A 4-bit checkpoint converted for cpu with no options (services/convert/cpu_defaults.py): every
    layer on cpu_w4a8, the tied head int8, at most DEFAULTS_PPL_COST dearer in perplexity than the
    weight-only artifact with its 16-bit head (measured +0.40 % fp32 / −0.43 % bf16, 2026-12-07)."""
    manifest = Manifest.parse((smollm2_artifact_cpu_gptq_default / "manifest.json").read_text())
    assert manifest.options == {"quantize_head": "int8", "int8_activations": "4-bit"}
    head = manifest.layers.pop("lm_head")
    assert head.kernel == "cpu_int8" and {e.kernel for e in manifest.layers.values()} == {"cpu_w4a8"}
    ppl = fixed_text_perplexities(
        {"weight-only": smollm2_artifact_cpu_int4_gptq, "defaults": smollm2_artifact_cpu_gptq_default}
    )
    change = ppl["defaults"] / ppl["weight-only"] - 1
    print(
        f"\nperplexity weight-only {ppl['weight-only']:.4f}, defaults {ppl['defaults']:.4f} ({change:+.3%})"
    )
    assert change <= DEFAULTS_PPL_COST, ppl


@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_a_gpu_target_refuses_int8_activations_by_name(smollm2_gptq: Path, target: str) -> None:
    with pytest.raises(UnsupportedError, match=f"--int8-activations is for the cpu target.*{target}"):
        plan(str(smollm2_gptq), target, int8_activations=True)


def test_the_plan_says_which_layers_take_int8_activations(smollm2_gptq: Path) -> None:
    p = plan(str(smollm2_gptq), "cpu", int8_activations=True, quantize_head="none")
    assert {r.kernel for r in p.rows} == {"cpu_w4a8"}
    assert all("int8 activations" in r.scheme for r in p.rows)
    assert any(f"{len(p.rows)} 4-bit layer(s) per token and weight group" in n for n in p.notes)
    assert p.options == {"int8_activations": True}
