"""The decode step at bucket shapes (runtime/cuda_graph_decode.py) against the eager step it replaces.

On CPU the bucketed static step runs eagerly (what the graphs capture: padding rows into the scratch
slot, every per-step value in device buffers, keys read to the length bucket and masked); on CUDA
(`gpu` marker) the same schedule replays captured graphs, and the engine picks them by itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from runtime.cuda_graph_decode import StaticDecoder, buckets, captured_decoder
from runtime.kv_cache import KVCache
from runtime.loader import LoadedModel, load_model

# Static vs eager logits of a tiny fp32 model: the same ops on the same rows, attention over more
# (masked) keys and in batches padded with other rows: summation order only.
STATIC_LOGITS_ATOL = 1e-4
# On CUDA (bf16 model): the graphs replay the kernels of the eager step at other batch sizes (split-K
# and tile choices per M bucket), so a logit moves by bf16 roundings of the layers it goes through.
CUDA_LOGITS_ATOL = 0.15


def _cache(lm: LoadedModel, slots: int, max_len: int, device: str = "cpu") -> KVCache:
    cfg = lm.config
    return KVCache(
        num_layers=cfg.num_layers, num_slots=slots, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=lm.dtype, device=device,
    )  # fmt: skip


def test_buckets_are_powers_of_two_then_the_limit() -> None:
    assert buckets(8, 1) == (1, 2, 4, 8)
    assert buckets(6, 1) == (1, 2, 4, 6)
    assert buckets(1, 1) == (1,)
    assert buckets(1000, 256) == (256, 512, 1000)


def _schedule(
    lm: LoadedModel,
    decoders: tuple[object, object],
    caches: tuple[KVCache, KVCache],
    atol: float,
    device: str,
) -> None:
    """Prefill slots 0, 1 and 3 to different lengths, then steps of every batch shape (one sequence,
    three, a non-contiguous pair) crossing a key-length bucket; logits and the real slots' cache agree."""
    gen = torch.Generator().manual_seed(5)
    lengths = {0: 9, 1: 250, 3: 17}  # slot 1 crosses the 256-key bucket
    with torch.inference_mode():
        for slot, n in lengths.items():
            ids = torch.randint(0, 250, (n,), generator=gen).to(device)
            for cache in caches:
                lm.model.prefill(ids, slot, cache)
        for slots in [[1], [0, 1, 3], [0, 3], [3], [0, 1, 3], [1, 3]] * 2:
            tokens = torch.randint(0, 250, (len(slots),), generator=gen).to(device)
            positions = [lengths[s] for s in slots]
            want = decoders[0].decode(tokens, slots, positions, caches[0])  # type: ignore[attr-defined]
            got = decoders[1].decode(tokens, slots, positions, caches[1])  # type: ignore[attr-defined]
            assert got.shape == want.shape == (len(slots), lm.config.vocab_size)
            assert (got - want).abs().max().item() <= atol, (slots, positions)
            for s in slots:
                lengths[s] += 1
    real = [0, 1, 3]  # the scratch slot (4) holds the padding rows' keys; slot 2 was never written
    for layer in range(lm.config.num_layers):
        a, b = caches[0].k[layer][real].float(), caches[1].k[layer][real].float()
        assert (a - b).abs().max().item() <= atol * 10, layer
    assert caches[1].k[0][2].abs().max().item() == 0.0


def test_static_step_matches_eager_decode(llama_artifact: tuple[object, Path]) -> None:
    lm = load_model(llama_artifact[1])
    lm.model.setup(lm.dtype, 512, "cpu")
    eager_cache, static_cache = _cache(lm, 4, 512), _cache(lm, 5, 512)
    static = StaticDecoder(lm.model, static_cache, max_batch=4, max_len=512, scratch_slot=4, capture=False)
    assert static.batches == (1, 2, 4) and static.lengths == (256, 512)
    assert static.bucket(3, 257) == (4, 512)
    _schedule(lm, (lm.model, static), (eager_cache, static_cache), STATIC_LOGITS_ATOL, "cpu")


def test_a_step_beyond_the_buckets_is_refused(llama_artifact: tuple[object, Path]) -> None:
    lm = load_model(llama_artifact[1])
    lm.model.setup(lm.dtype, 300, "cpu")
    static = StaticDecoder(
        lm.model, _cache(lm, 3, 300), max_batch=2, max_len=300, scratch_slot=2, capture=False
    )
    with pytest.raises(ValueError, match="exceeds the captured buckets"):
        static.bucket(3, 10)
    with pytest.raises(ValueError, match="outside the KV cache"):
        StaticDecoder(lm.model, _cache(lm, 2, 300), max_batch=2, max_len=300, scratch_slot=2, capture=False)


def test_a_cpu_model_gets_no_captured_step(llama_artifact: tuple[object, Path]) -> None:
    lm = load_model(llama_artifact[1])
    lm.model.setup(lm.dtype, 64, "cpu")
    cache = _cache(lm, 2, 64)
    assert captured_decoder(lm.model, cache, max_batch=1, max_len=64, scratch_slot=1, world_size=1) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_match_eager_decode_on_cuda(
    llama_artifact: tuple[object, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from runtime.engine import Engine

    lm = load_model(llama_artifact[1], device="cuda")
    with caplog.at_level(logging.INFO, logger="runtime.cuda_graph_decode"):
        engine = Engine(lm, max_num_seqs=4, max_model_len=512)
    assert "CUDA graphs" in caplog.text
    assert engine.cache.num_slots == 5
    eager_cache = _cache(lm, 4, 512, "cuda")
    _schedule(lm, (lm.model, engine.decode.__self__), (eager_cache, engine.cache), CUDA_LOGITS_ATOL, "cuda")
