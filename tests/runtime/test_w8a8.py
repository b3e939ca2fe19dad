"""W8A8 int8 as the checkpoint declares it, on a real llm-compressor SmoothQuant + W8A8 SmolLM2.

The same checkpoint runs two ways — int8 x int8 (cpu_w8a8, the default for a checkpoint declaring
dynamic per-token int8 activations) and weight-only (cpu_w8a8 disabled: cpu_int8) — next to two
transformers references in fp32: compressed-tensors' own decompression with its int8 activation
fake-quantization (the checkpoint's declared semantics), and the dequantized weights with unquantized
activations. Perplexity on the GPL-3 text, recorded in bench/results/real_model_perplexity.json.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from devtools.builders import smollm2
from devtools.eval import PerplexityResult, generate_greedy, runtime_logits_fn, text_perplexity
from runtime.loader import load_model
from tests.fixtures.checkpoints import reference_model
from tests.runtime.test_real_model import FRANCE, record_perplexity

# Kiln's W8A8 path against transformers running the checkpoint's declared int8 activations: both
# quantize every token row the same way; what is left is bf16 activations around the GEMMs
# (measured 24.28 vs 24.25: +0.12 %).
W8A8_VS_TRANSFORMERS_REL_TOL = 0.01
# Kiln's weight-only path against the dequantized weights in fp32 (measured 23.955 vs 23.950).
W8A16_VS_DEQUANTIZED_REL_TOL = 0.01
# What int8 activations cost over weight-only, Kiln's rise against transformers' own rise on this
# checkpoint: the implementation may add at most this much on top. The checkpoint is calibrated on
# the machine that runs the tests, and transformers runs it in fp32 while Kiln's activations are
# bf16: measured +1.36 % vs +1.27 % (AVX-512 machine) and +2.37 % vs +1.58 % (AVX2-only machine,
# another calibration of the same recipe; Kiln 24.54, transformers 24.33; once cpu_int8 widened to
# fp32 on such CPUs, 24.544 / 23.962 vs 24.329 / 23.949: +2.43 % vs +1.58 %).
W8A8_EXTRA_COST_TOL = 0.01


def _ppl(logits_fn: Callable[[torch.Tensor], torch.Tensor], tokenizer: Any) -> PerplexityResult:
    with torch.inference_mode():
        return text_perplexity(logits_fn, tokenizer, smollm2.PERPLEXITY_TEXT.read_text())


def _transformers_w8a8(source: Path) -> Any:
    """transformers + compressed-tensors loading the checkpoint as published (fake-quantized int8
    activations per token, decompressed int8 weights), in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()


def test_w8a8_perplexity_served_both_ways_next_to_transformers(
    smollm2_w8a8_int8: Path, smollm2_artifact_cpu_w8a8: Path, smollm2_artifact_cpu_w8a8_as_w8a16: Path
) -> None:
    torch.set_num_threads(2)
    w8a8, w8a16 = load_model(smollm2_artifact_cpu_w8a8), load_model(smollm2_artifact_cpu_w8a8_as_w8a16)
    decoder = lambda lm: {e.kernel for n, e in lm.manifest.layers.items() if n.startswith("model.layers.")}  # noqa: E731
    assert decoder(w8a8) == {"cpu_w8a8"} and decoder(w8a16) == {"cpu_int8"}
    tok = w8a8.tokenizer
    assert tok is not None
    declared, dequantized = _transformers_w8a8(smollm2_w8a8_int8), reference_model(smollm2_w8a8_int8)
    ppl = {
        "w8a8": _ppl(runtime_logits_fn(w8a8), tok),
        "w8a16": _ppl(runtime_logits_fn(w8a16), tok),
        "transformers_w8a8": _ppl(lambda x: declared(x).logits, tok),
        "dequantized_fp32": _ppl(lambda x: dequantized(x).logits, tok),
    }
    figures = {name: round(r.perplexity, 4) for name, r in ppl.items()}
    print(f"\nW8A8 SmolLM2 perplexity: {figures}")
    for name, lm in (("int8-w8a8", w8a8), ("int8-w8a8-as-w8a16", w8a16)):
        key = "w8a8" if lm is w8a8 else "w8a16"
        record_perplexity(
            name, {**ppl[key].to_json(), "artifact_id": lm.manifest.artifact_id, "peers": figures}
        )
    p = {name: r.perplexity for name, r in ppl.items()}
    assert abs(p["w8a8"] / p["transformers_w8a8"] - 1) <= W8A8_VS_TRANSFORMERS_REL_TOL, figures
    assert abs(p["w8a16"] / p["dequantized_fp32"] - 1) <= W8A16_VS_DEQUANTIZED_REL_TOL, figures
    kiln_cost = p["w8a8"] / p["w8a16"]
    declared_cost = p["transformers_w8a8"] / p["dequantized_fp32"]
    assert kiln_cost <= declared_cost + W8A8_EXTRA_COST_TOL, figures


def test_w8a8_answers_the_chat_question(smollm2_artifact_cpu_w8a8: Path) -> None:
    from runtime.chat import apply_chat_template

    lm = load_model(smollm2_artifact_cpu_w8a8)
    tok = lm.tokenizer
    assert tok is not None
    ids = apply_chat_template(tok, [{"role": "user", "content": FRANCE}])
    out = generate_greedy(lm, ids, 32).token_ids
    assert "Paris" in tok.decode(out), tok.decode(out)
