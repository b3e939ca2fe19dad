"""Greedy generation on one process and on several gloo ranks (tensor / expert parallel on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from runtime.distributed import init_tensor_parallel, shutdown_tensor_parallel
from runtime.engine import Engine
from runtime.loader import load_model
from runtime.sampling import SamplingParams

MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 128


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    """All prompts at once (batched decode), greedy, past end-of-sequence: request index -> tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def single_process_tokens(artifact: Path, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    engine = Engine(load_model(artifact), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    return greedy_tokens(engine, prompts, max_tokens)


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    artifact: str,
    out: str,
    prompts: list[list[int]],
    max_tokens: int,
) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, rendezvous=Path(rendezvous))
    try:
        loaded = load_model(Path(artifact), rank=rank, world_size=world_size)
        engine = Engine(loaded, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
        Path(out, f"rank{rank}.json").write_text(json.dumps(greedy_tokens(engine, prompts, max_tokens)))
    finally:
        shutdown_tensor_parallel()


def ranks_tokens(
    artifact: Path, world_size: int, out: Path, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, list[int]]]:
    """Every rank's greedy tokens, the ranks run as `world_size` gloo processes."""
    rendezvous = out / "rendezvous"
    rendezvous.mkdir(mode=0o700)
    args = (world_size, str(rendezvous), str(artifact), str(out), prompts, max_tokens)
    mp.spawn(_rank_main, args=args, nprocs=world_size, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]
