"""The runtime's Llama-family model against transformers with the same random weights."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from runtime.engine import Engine
from runtime.kv_cache import KVCache
from runtime.loader import LoadedModel, load_model
from runtime.model import top_k_indices
from runtime.model_layout import ModelConfig
from runtime.rope import rope_inv_freq
from runtime.sampling import SamplingParams

# fp32 on both sides; the only differences are summation orders (fused qkv / gate_up, SDPA).
LOGITS_ATOL = 2e-4
# Batched decode runs the same math with a different M in every GEMM.
BATCHED_VS_SEQUENTIAL_ATOL = 2e-4
# FP8 (e4m3, per-layer scales) KV cache: perplexity may rise by at most this fraction (measured on
# this random tiny model: +1.1%; bench/kv_cache_fp8.py measures SmolLM2).
FP8_PPL_MAX_INCREASE = 0.05

log = logging.getLogger(__name__)


def _cache(lm: LoadedModel, slots: int = 4, max_len: int = 256, kv: str = "auto") -> KVCache:
    cfg = lm.config
    lm.model.setup(lm.dtype, max_len, "cpu")
    return KVCache(
        num_layers=cfg.num_layers,
        num_slots=slots,
        max_len=max_len,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=lm.dtype,
        kv_cache_dtype=kv,
    )  # type: ignore[arg-type]


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "fixture", ["llama_artifact", "qwen2_artifact", "smollm2_artifact", "mistral_artifact"]
)
@torch.inference_mode()
def test_logits_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    hf, path = request.getfixturevalue(fixture)
    lm = load_model(path)
    cache = _cache(lm)
    ids = _prompt(90)
    extra = torch.tensor([7, 200, 31])
    ref = hf(torch.cat([ids, extra])[None]).logits[0]

    got = lm.model.prefill(ids, 0, cache, all_logits=True)
    assert (got - ref[:90]).abs().max() < LOGITS_ATOL
    for i, tok in enumerate(extra.tolist()):
        step = lm.model.decode(torch.tensor([tok]), [0], [90 + i], cache)[0]
        assert (step - ref[90 + i]).abs().max() < LOGITS_ATOL


@torch.inference_mode()
def test_explicit_lm_head_layer_matches_tied(
    tmp_path: Path, smollm2_artifact: tuple[PreTrainedModel, Path]
) -> None:
    hf, _ = smollm2_artifact
    path = write_artifact(hf, tmp_path, lm_head_layer=True)
    lm = load_model(path)
    assert lm.model.lm_head is not None and lm.model.lm_head.kernel is not None
    cache = _cache(lm)
    ids = _prompt(40)
    assert (
        lm.model.prefill(ids, 0, cache, all_logits=True) - hf(ids[None]).logits[0]
    ).abs().max() < LOGITS_ATOL


def test_llama3_rope_scaling_is_applied() -> None:
    cfg = ModelConfig.from_hf(tiny_hf_model("llama").config.to_dict(), "LlamaForCausalLM")
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    scaled, base = rope_inv_freq(cfg, 512), rope_inv_freq(plain, 512)
    assert torch.equal(scaled[:2], base[:2])  # high frequencies kept
    assert torch.allclose(scaled[-1], base[-1] / 8)  # low frequencies divided by factor
    linear = ModelConfig(**{**cfg.__dict__, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert torch.allclose(rope_inv_freq(linear, 512), base / 2)


def test_greedy_generation_matches_transformers(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    hf, path = llama_artifact
    engine = Engine(load_model(path), max_num_seqs=2, max_model_len=256)
    prompt = _prompt(12).tolist()
    engine.add_request("a", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert tokens == ref[0, len(prompt) :].tolist()


@torch.inference_mode()
def test_batched_decode_equals_sequential(qwen2_artifact: tuple[PreTrainedModel, Path]) -> None:
    _, path = qwen2_artifact
    lm = load_model(path)
    cache = _cache(lm, slots=4)
    prompts = [_prompt(n, seed=n) for n in (5, 17, 33)]
    slots = [2, 0, 3]  # not contiguous: exercises the gather path
    firsts = [int(lm.model.prefill(p, s, cache).argmax()) for p, s in zip(prompts, slots, strict=True)]
    positions = [len(p) for p in prompts]
    batched = lm.model.decode(torch.tensor(firsts), slots, positions, cache)

    seq_cache = _cache(lm, slots=1)
    for i, p in enumerate(prompts):
        lm.model.prefill(p, 0, seq_cache)
        single = lm.model.decode(torch.tensor([firsts[i]]), [0], [positions[i]], seq_cache)[0]
        assert (batched[i] - single).abs().max() < BATCHED_VS_SEQUENTIAL_ATOL


@torch.inference_mode()
def _perplexity(lm: LoadedModel, kv: str, text: list[int], prompt_len: int) -> float:
    """Perplexity of text[prompt_len:] decoded token by token through the KV cache."""
    engine = Engine(lm, max_num_seqs=1, max_model_len=256) if kv == "fp8" else None
    cache = engine.cache if engine is not None else _cache(lm, slots=1)
    logits = lm.model.prefill(torch.tensor(text[:prompt_len]), 0, cache)
    nll = 0.0
    for pos in range(prompt_len, len(text)):
        nll -= float(torch.log_softmax(logits, -1)[text[pos]])
        logits = lm.model.decode(torch.tensor([text[pos]]), [0], [pos], cache)[0]
    return math.exp(nll / (len(text) - prompt_len))


def test_fp8_kv_cache_close_to_auto(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    hf, path = llama_artifact
    prompt = _prompt(16).tolist()
    with torch.inference_mode():  # a text the model finds likely: its own sampled continuation
        torch.manual_seed(0)
        text = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=True)[
            0
        ].tolist()
    auto = _perplexity(load_model(path), "auto", text, len(prompt))
    fp8_lm = load_model(path, kv_cache_dtype="fp8")
    fp8 = _perplexity(fp8_lm, "fp8", text, len(prompt))
    log.info(
        "perplexity over %d tokens: auto %.4f, fp8 KV %.4f (%+.2f%%)",
        len(text) - len(prompt),
        auto,
        fp8,
        100 * (fp8 / auto - 1),
    )
    assert fp8 / auto - 1 < FP8_PPL_MAX_INCREASE

    cfg = fp8_lm.config
    sizes = {
        kv: KVCache(
            num_layers=cfg.num_layers,
            num_slots=2,
            max_len=64,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=torch.float32,
            kv_cache_dtype=kv,
        ).nbytes  # type: ignore[arg-type]
        for kv in ("auto", "fp8")
    }
    assert sizes["fp8"] * 4 == sizes["auto"]  # a quarter of fp32 (half of bf16)


@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (8, 32000), (3, 1000), (2, 100)])
def test_blocked_top_k_selects_the_same_values_as_topk(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    for trial in range(8):
        x = torch.randn(shape, generator=gen) * 10
        if trial % 2:
            x = x.half().float()  # many ties, as after a half-precision lm_head
        got = top_k_indices(x, 8)
        want = x.topk(8, dim=-1).indices
        assert got.shape == want.shape
        assert torch.equal(x.gather(-1, got).sort(-1).values, x.gather(-1, want).sort(-1).values)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_kv_cache_read_as_matches_read(kv: str) -> None:
    cache = KVCache(
        num_layers=2,
        num_slots=4,
        max_len=16,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv,  # type: ignore[arg-type]
    )
    gen = torch.Generator().manual_seed(0)
    for slot in range(4):
        for pos in range(10):
            k, v = torch.randn(2, 2, 8, generator=gen)  # fp32, as decode hands them
            cache.write_decode_one(1, slot, pos, k, v)
            k_got, v_got = cache.read(1, slice(slot, slot + 1), pos + 1)
            assert torch.equal(
                k_got[0, :, pos], cache._load(cache._store(k, cache.k_scale[1]), cache.k_scale[1])
            )
            assert torch.equal(
                v_got[0, :, pos], cache._load(cache._store(v, cache.v_scale[1]), cache.v_scale[1])
            )
    for slots in (slice(1, 3), torch.tensor([3, 0])):
        k_ref, v_ref = cache.read(1, slots, 7)
        k_got, v_got = cache.read_as(1, slots, 7, torch.float32)
        assert k_got.dtype == v_got.dtype == torch.float32
        assert torch.equal(k_got, k_ref.float()) and torch.equal(v_got, v_ref.float())
