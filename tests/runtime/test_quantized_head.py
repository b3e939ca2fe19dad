"""`kiln convert --quantize-head int8` on the real SmolLM2 GPTQ checkpoint (tied embeddings): the head
becomes its own cpu_int8 layer read from the embedding, which stays 16-bit for the lookup; the
artifact is served by the runtime as it is.

Perplexity cost on the fixed text of tests/runtime/test_real_model.py (same windows), against the
same artifact without the option: +0.12 % measured (2026-12-04, Xeon AVX-512), bound 0.5 %."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.artifact.manifest import Manifest
from runtime.loader import load_model
from services.convert.verify import INT8_ONLINE_REL_BOUND
from tests.helpers.perplexity import fixed_text_perplexities

HEAD_PPL_REL_TOL = 0.005


def test_the_int8_head_is_a_verified_cpu_int8_layer_beside_the_16_bit_embedding(
    smollm2_artifact_cpu_int4_gptq_int8_head: Path, smollm2_artifact_cpu_int4_gptq: Path
) -> None:
    manifest = Manifest.parse((smollm2_artifact_cpu_int4_gptq_int8_head / "manifest.json").read_text())
    head = manifest.layers["lm_head"]
    assert head.kernel == "cpu_int8" and head.source_tensors == ["model.embed_tokens.weight"]
    assert head.verification is not None and head.verification.metric == "max_rel_err"
    assert 0 < head.verification.value <= INT8_ONLINE_REL_BOUND
    assert manifest.options == {"quantize_head": "int8"}
    plain = Manifest.parse((smollm2_artifact_cpu_int4_gptq / "manifest.json").read_text())
    assert "lm_head" not in plain.layers and plain.artifact_id != manifest.artifact_id
    loaded = load_model(smollm2_artifact_cpu_int4_gptq_int8_head)
    assert loaded.model.lm_head is not None and loaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_the_int8_head_costs_under_half_a_percent_of_perplexity(
    smollm2_artifact_cpu_int4_gptq_int8_head: Path, smollm2_artifact_cpu_int4_gptq: Path
) -> None:
    ppl = fixed_text_perplexities(
        {"16-bit": smollm2_artifact_cpu_int4_gptq, "int8": smollm2_artifact_cpu_int4_gptq_int8_head}
    )
    change = ppl["int8"] / ppl["16-bit"] - 1
    print(f"\nperplexity 16-bit head {ppl['16-bit']:.4f}, int8 head {ppl['int8']:.4f} ({change:+.3%})")
    assert abs(change) <= HEAD_PPL_REL_TOL, ppl


def test_the_int8_head_artifact_answers_paris(smollm2_artifact_cpu_int4_gptq_int8_head: Path) -> None:
    from devtools.demo import answer

    result = answer(smollm2_artifact_cpu_int4_gptq_int8_head)
    assert "Paris" in result.text, result.text


@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_a_gpu_target_refuses_quantize_head_by_name(smollm2_gptq: Path, target: str) -> None:
    from kernels.errors import UnsupportedError
    from services.convert.library import plan

    with pytest.raises(
        UnsupportedError, match=f"--quantize-head is for the cpu target.*{target} keeps lm_head"
    ):
        plan(str(smollm2_gptq), target, quantize_head="int8")
