"""Issue 27's acceptance: SmolLM2-135M-Instruct's Q4_1 GGUF, converted by Kiln for cpu, scores the fixed
English text within 0.5 % of llama.cpp's perplexity on the same file, over the same token windows, and
answers the chat question greedily with the same tokens (devtools/llamacpp.py; the bench is
bench/gguf_vs_llamacpp.py). llama.cpp runs from its own venv (`make llamacpp-venv`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devtools.builders import smollm2
from devtools.eval import PPL_MAX_TOKENS, PPL_WINDOW
from devtools.llamacpp import PPL_REL_TOL, THREADS, Comparison, compare, llama_cpp_problem, report_lines

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gguf_vs_llamacpp.py"
needs_llama_cpp = pytest.mark.skipif(llama_cpp_problem() is not None, reason=str(llama_cpp_problem()))


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> Comparison:
    try:
        gguf = smollm2.gguf_file()
    except smollm2.CheckpointUnavailable as e:
        pytest.skip(str(e))
    torch.set_num_threads(THREADS)
    result = compare(gguf, tmp_path_factory.mktemp("gguf-vs-llamacpp"))
    print("\n" + "\n".join(report_lines(result)))
    return result


@needs_llama_cpp
def test_perplexity_within_half_percent_of_llama_cpp(comparison: Comparison) -> None:
    windows = PPL_MAX_TOKENS // PPL_WINDOW
    for side in (comparison.kiln, comparison.llama_cpp):
        assert side.windows == windows and side.tokens_scored == windows * (PPL_WINDOW - 1)
    assert abs(comparison.ratio - 1) <= PPL_REL_TOL, (
        f"Kiln {comparison.kiln.perplexity:.4f} / llama.cpp {comparison.llama_cpp.perplexity:.4f} "
        f"= {comparison.ratio:.5f}"
    )


@needs_llama_cpp
def test_greedy_chat_answer_identical_to_llama_cpp(comparison: Comparison) -> None:
    assert comparison.kiln_answer == comparison.llama_cpp_answer, (
        f"{comparison.divergence_note}\nKiln      {comparison.kiln_text!r}\n"
        f"llama.cpp {comparison.llama_cpp_text!r}"
    )
    assert "Paris" in comparison.kiln_text


def test_bench_refuses_without_the_llama_cpp_venv(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--llama-venv", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "make llamacpp-venv" in done.stderr, done.stderr
