"""Tensor parallel on CPU: two gloo processes produce the same greedy tokens as one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import PreTrainedModel

from runtime.distributed import free_port, init_tensor_parallel, shutdown_tensor_parallel
from runtime.engine import Engine
from runtime.loader import load_model
from runtime.sampling import SamplingParams
from tests.runtime.artifact_factory import write_artifact

PROMPTS = [[5, 6, 7, 8], [100, 90, 80], list(range(30, 70))]
MAX_TOKENS = 16


def _generate(engine: Engine) -> dict[str, list[int]]:
    """All prompts at once (batched decode), greedy."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _rank_main(rank: int, world_size: int, port: int, artifact: str, out: str) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, master_port=port)
    try:
        engine = Engine(
            load_model(Path(artifact), rank=rank, world_size=world_size), max_num_seqs=4, max_model_len=128
        )
        tokens = _generate(engine)
        Path(out, f"rank{rank}.json").write_text(json.dumps(tokens))
    finally:
        shutdown_tensor_parallel()


def test_tp2_matches_tp1(tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    hf, tp1_path = llama_artifact
    expected = _generate(Engine(load_model(tp1_path), max_num_seqs=4, max_model_len=128))
    tp2_path = write_artifact(hf, tmp_path / "tp2", tp=2)
    mp.spawn(_rank_main, args=(2, free_port(), str(tp2_path), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected
