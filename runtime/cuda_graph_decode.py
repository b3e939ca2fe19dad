"""The decode step at fixed shapes, captured in CUDA graphs: the host work of a step (Python, argument
handling, one launch per op) is paid once at capture instead of on every token.

One graph per (batch bucket, key-length bucket): a step of `b` sequences whose longest reaches
`read_len` keys replays the graph of the smallest buckets holding them. Rows past `b` are padding:
token 0 at position 0 of the KV cache's scratch slot (one slot beyond the engine's), so they write
nowhere a sequence reads. Keys past each sequence's position are masked, so a longer key bucket
changes no logit beyond the attention's rounding. Per-step values reach the graph through static
device buffers (tokens, slots, positions); the logits come back in the graph's output buffer, valid
until the next step.

Captured once at engine start (largest buckets first, sharing one memory pool), after a warm-up on a
side stream that compiles every Triton kernel the buckets launch. A model whose step cannot be
captured (a host synchronization inside, tensor parallelism) decodes eagerly; one log line says why.
Without `capture` (CPU, tests) the same bucketed static step runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from runtime.kv_cache import KVCache
from runtime.model import LlamaForCausalLM

log = logging.getLogger(__name__)

MIN_LENGTH_BUCKET = 256  # keys of the shortest length bucket
WARMUP_RUNS = 2  # eager runs per batch bucket before capture (Triton compiles on the first)


def buckets(limit: int, start: int) -> tuple[int, ...]:
    """Powers of two from `start` below `limit`, then `limit` itself: (1, 2, 4, 6) for (6, 1)."""
    out: list[int] = []
    size = start
    while size < limit:
        out.append(size)
        size *= 2
    return (*out, limit)


class StaticDecoder:
    """`decode(tokens, slots, positions, cache)` as `LlamaForCausalLM.decode`, run at bucket shapes
    (module docstring); with `capture`, by replaying CUDA graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: KVCache,
        *,
        max_batch: int,
        max_len: int,
        scratch_slot: int,
        capture: bool,
    ) -> None:
        if not 0 <= scratch_slot < cache.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} is outside the KV cache's {cache.num_slots} slots")
        self.model = model
        self.cache = cache
        self.scratch_slot = scratch_slot
        self.batches = buckets(max_batch, 1)
        self.lengths = buckets(max_len, min(MIN_LENGTH_BUCKET, max_len))
        top = self.batches[-1]
        device = model.device
        self.tokens = torch.zeros(top, dtype=torch.long, device=device)
        self.rows = torch.zeros(2, top, dtype=torch.long, device=device)  # slots, positions
        self.rows[0].fill_(scratch_slot)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    def bucket(self, batch: int, read_len: int) -> tuple[int, int]:
        """The smallest (batch, key-length) buckets holding a step."""
        b = next((s for s in self.batches if s >= batch), None)
        keys = next((s for s in self.lengths if s >= read_len), None)
        if b is None or keys is None:
            raise ValueError(
                f"a step of {batch} sequences reading {read_len} keys exceeds the captured buckets "
                f"(batch <= {self.batches[-1]}, keys <= {self.lengths[-1]})"
            )
        return b, keys

    def decode(
        self, tokens: torch.Tensor, slots: list[int], positions: list[int], cache: KVCache
    ) -> torch.Tensor:
        """Logits (b, V) of one token per sequence (the graph's buffer when captured: read it before
        the next step)."""
        b = len(slots)
        batch, keys = self.bucket(b, max(positions) + 1)
        pad = batch - b
        rows = [[*slots, *[self.scratch_slot] * pad], [*positions, *[0] * pad]]
        self.rows[:, :batch].copy_(torch.tensor(rows, dtype=torch.long))
        self.tokens[:b].copy_(tokens)
        if pad:
            self.tokens[b:batch].zero_()
        graph = self.graphs.get((batch, keys))
        if graph is None:
            logits = self._step(batch, keys)
        else:
            graph[0].replay()
            logits = graph[1]
        return logits[:b]

    def _step(self, batch: int, keys: int) -> torch.Tensor:
        return self.model.decode_static(
            self.tokens[:batch], self.rows[0, :batch], self.rows[1, :batch], keys, self.cache
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        self.rows[0].fill_(self.scratch_slot)
        self.rows[1].zero_()
        self.tokens.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for batch in self.batches:  # every M the kernels see: Triton compiles here, not in capture
                for _ in range(WARMUP_RUNS):
                    self._step(batch, self.lengths[0])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.batches):
            for keys in reversed(self.lengths):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._step(batch, keys)
                self.graphs[(batch, keys)] = (graph, out)
        torch.cuda.synchronize()
        log.info(
            "decode: CUDA graphs, %d captured (batch %s x keys %s) in %.1f s",
            len(self.graphs), list(self.batches), list(self.lengths), time.perf_counter() - t0,
        )  # fmt: skip


def captured_decoder(
    model: LlamaForCausalLM,
    cache: KVCache,
    *,
    max_batch: int,
    max_len: int,
    scratch_slot: int,
    world_size: int,
) -> StaticDecoder | None:
    """The captured step for a CUDA model, or None (the reason logged once) to decode eagerly."""
    if model.device.type != "cuda":
        return None
    if world_size > 1:
        log.info("decode: eager step (CUDA graphs are not captured under tensor parallelism)")
        return None
    try:
        return StaticDecoder(
            model, cache, max_batch=max_batch, max_len=max_len, scratch_slot=scratch_slot, capture=True
        )
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # a host sync or op capture refuses
        torch.cuda.synchronize()
        log.info("decode: eager step (the step could not be captured in a CUDA graph: %s)", exc)
        return None
