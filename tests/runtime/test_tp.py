"""Tensor parallel on CPU: two gloo processes produce the same greedy tokens as one."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import write_artifact
from tests.runtime.tp_ranks import ranks_tokens, single_process_tokens

PROMPTS = [[5, 6, 7, 8], [100, 90, 80], list(range(30, 70))]
MAX_TOKENS = 16


def test_tp2_matches_tp1(tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    hf, tp1_path = llama_artifact
    expected = single_process_tokens(tp1_path, PROMPTS, MAX_TOKENS)
    tp2_path = write_artifact(hf, tmp_path / "tp2", tp=2)
    assert ranks_tokens(tp2_path, 2, tmp_path, PROMPTS, MAX_TOKENS) == [expected, expected]
