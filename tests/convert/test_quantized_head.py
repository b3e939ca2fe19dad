"""`--quantize-head int8` on tiny checkpoints: an untied lm_head and a tied one become cpu_int8
layers within INT8_ONLINE_REL_BOUND of the source, the plan says so, the request's other spellings
stay as they were (the real SmolLM2 artifact, and the refusal for GPU targets, are in
tests/runtime/test_quantized_head.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from devtools.builders.synthetic import TINY, write_checkpoint
from devtools.eval import runtime_logits_fn
from kernels.codecs.int8 import CODE_BIAS, quantize_channelwise_int8
from runtime.loader import load_model
from services.convert.library import ConversionRequest, convert, plan
from services.convert.spec import ConversionSpec
from services.convert.verify import INT8_ONLINE_REL_BOUND

# max |Δ log-prob| of the int8 head against the 16-bit one on the tiny model: 0.008 / 0.009 measured
# (untied / tied, Xeon AVX-512, 2026-12-04)
HEAD_LOGPROB_ATOL = 0.03


def test_channelwise_int8_codes_times_the_stored_scales_are_within_half_a_step() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 64)[:, None]
    w[5] = 0.0  # an all-zero row
    q = quantize_channelwise_int8(w, torch.bfloat16)
    assert q.codes.dtype == torch.uint8 and q.scales.shape == (1, 64) and q.scales.dtype == torch.bfloat16
    steps = q.codes.to(torch.int16) - CODE_BIAS
    assert int(steps.abs().max()) <= 127 and bool((steps[5] == 0).all())
    s = q.scales.float()[0][:, None]
    assert bool(((steps.float() * s - w).abs() <= s * 0.5 + w.abs().amax(1, keepdim=True) * 2**-8).all())


@pytest.mark.parametrize("tied", [False, True])
def test_an_int8_head_is_planned_converted_verified_and_served(tmp_path: Path, tied: bool) -> None:
    src = write_checkpoint(tmp_path / "src", "dense", dims=replace(TINY, tie_word_embeddings=tied))
    p = plan(str(src), "cpu", quantize_head="int8")
    (head,) = [r for r in p.rows if r.layer == "lm_head"]
    assert head.kernel == "cpu_int8" and head.scheme == "int8 channel sym (online)"
    assert head.shards == ["model.embed_tokens" if tied else "lm_head"]
    assert "model.embed_tokens.weight" in p.other_tensors  # the lookup keeps its 16-bit table
    assert any(n.startswith("--quantize-head int8: lm_head quantized online") for n in p.notes)
    assert p.options == {"quantize_head": "int8"}

    [r] = convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out"), quantize_head="int8"))
    check = r.manifest.layers["lm_head"].verification
    assert check is not None and check.metric == "max_rel_err" and 0 < check.value <= INT8_ONLINE_REL_BOUND
    [plain] = convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out")))
    assert plain.artifact_id != r.artifact_id

    ids = torch.tensor([[1, 5, 9, 2, 7, 11, 3]])
    got = runtime_logits_fn(load_model(r.uri, with_tokenizer=False))(ids)[0].float().log_softmax(-1)
    want = runtime_logits_fn(load_model(plain.uri, with_tokenizer=False))(ids)[0].float().log_softmax(-1)
    assert float((got - want).abs().max()) <= HEAD_LOGPROB_ATOL


def test_requests_without_the_option_keep_their_json() -> None:
    spec = ConversionSpec(source="/ckpt", targets=["cpu"])  # type: ignore[list-item]
    assert "quantize_head" not in spec.row()["options"]  # type: ignore[operator]
    with_head = ConversionSpec(source="/ckpt", targets=["cpu"], options={"quantize_head": "int8"})  # type: ignore[list-item,arg-type]
    assert with_head.row()["options"]["quantize_head"] == "int8"  # type: ignore[index]


def test_every_head_quantization_the_request_accepts_has_a_layer_layout() -> None:
    from services.convert.choices import HEAD_QUANTS, NO_HEAD_QUANT
    from services.convert.units.base import HEAD_QUANT_LAYERS

    assert set(HEAD_QUANT_LAYERS) == set(HEAD_QUANTS) - {NO_HEAD_QUANT}
