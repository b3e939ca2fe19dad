"""Kiln against llama.cpp on one GGUF file: perplexity over the same token windows, and the greedy chat
answer, token for token.

Kiln converts the file for cpu and serves it; llama.cpp (llama-cpp-python, built in its own venv by
`make llamacpp-venv`) runs the file itself. The text is tokenized once, by Kiln's tokenizer (rebuilt from
the GGUF metadata, the same ids as llama.cpp's), and both sides score the same windows of the same ids
with the protocol of devtools/eval.py; llama.cpp's perplexity is computed here from its own logits.

This file is also the llama.cpp child's script (`<venv>/bin/python -I devtools/llamacpp.py`, a job as
JSON on stdin, the result as one JSON line on stdout), so it imports only the standard library at module
level: the child's venv has no torch and no Kiln, and Kiln's side imports them where it needs them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devtools.eval import PerplexityResult
    from runtime.loader import LoadedModel

LLAMA_VENV = Path("/tmp/llamacpp-venv")
LLAMA_VENV_STAMP = ".kiln-installed"  # written by `make llamacpp-venv` once llama-cpp-python is built
THREADS = 2
QUESTION = "What is the capital of France? Answer in one sentence."
GREEDY_MAX_TOKENS = 64
CHILD_TIMEOUT_S = 900.0
PPL_REL_TOL = 0.005  # issue 27: Kiln's perplexity within 0.5 % of llama.cpp's on the same file


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python is not built in the venv the comparison runs it from."""


def llama_cpp_problem(venv: Path = LLAMA_VENV) -> str | None:
    """Why llama.cpp cannot run from `venv` (a sentence saying how to build it), or None."""
    if not (venv / "bin" / "python").exists() or not (venv / LLAMA_VENV_STAMP).is_file():
        make = "make llamacpp-venv" if venv == LLAMA_VENV else f"make llamacpp-venv LLAMA_VENV={venv}"
        return f"llama-cpp-python is not built in {venv}: run `{make}`"
    return None


def llama_python(venv: Path = LLAMA_VENV) -> Path:
    problem = llama_cpp_problem(venv)
    if problem is not None:
        raise LlamaCppUnavailable(problem)
    return venv / "bin" / "python"


# --- the llama.cpp child (runs in the llama-cpp-python venv) ---------------------------------------


def _child_window_nlls(llm: Any, windows: list[list[int]]) -> list[float]:
    """Mean NLL (nats) of each window's tokens but the first, from llama.cpp's logits, each window run
    from an empty context."""
    import numpy as np

    nlls = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        top = logits.max(axis=1)
        logsumexp = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        targets = logits[np.arange(len(window) - 1), window[1:]]
        nlls.append(float((logsumexp - targets).mean()))
    return nlls


def _child_greedy(llm: Any, prompt: list[int], stop_ids: set[int], max_tokens: int) -> list[int]:
    """Greedy continuation of `prompt`: the argmax of llama.cpp's logits, token by token, up to and
    including the first of `stop_ids`."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        if token in stop_ids:
            break
        llm.eval([token])
    return tokens


def child_main() -> None:
    from llama_cpp import Llama

    job = json.load(sys.stdin)
    windows: list[list[int]] = job["windows"]
    prompt: list[int] = job["prompt"]
    n_ctx = max(*(len(w) for w in windows), len(prompt) + job["max_tokens"])
    threads = job["threads"]
    llm = Llama(
        model_path=job["gguf"],
        n_ctx=n_ctx,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    started = time.perf_counter()
    nlls = _child_window_nlls(llm, windows)
    scored = time.perf_counter()
    greedy = _child_greedy(llm, prompt, set(job["stop_ids"]), job["max_tokens"])
    result = {
        "window_nlls": nlls,
        "greedy": greedy,
        "perplexity_s": scored - started,
        "greedy_s": time.perf_counter() - scored,
    }
    print(json.dumps(result))


# --- Kiln's side ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppRun:
    window_nlls: list[float]
    greedy: list[int]
    perplexity_s: float
    greedy_s: float


def run_llama_cpp(
    gguf: Path,
    windows: list[list[int]],
    prompt: list[int],
    stop_ids: Sequence[int],
    *,
    max_tokens: int = GREEDY_MAX_TOKENS,
    venv: Path = LLAMA_VENV,
    threads: int = THREADS,
    timeout: float = CHILD_TIMEOUT_S,
) -> LlamaCppRun:
    """llama.cpp on `gguf` in its venv: the mean NLL of each window and the greedy answer to `prompt`."""
    job = {
        "gguf": str(gguf),
        "windows": windows,
        "prompt": prompt,
        "stop_ids": list(stop_ids),
        "max_tokens": max_tokens,
        "threads": threads,
    }
    done = subprocess.run(
        [str(llama_python(venv)), "-I", str(Path(__file__).resolve())],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the llama.cpp child failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return LlamaCppRun(**json.loads(lines[-1]))


def windows_perplexity(windows: list[list[int]], window_nlls: list[float]) -> PerplexityResult:
    """devtools.eval's result from per-window mean NLLs (each window scores all its tokens but the first)."""
    from devtools.eval import PerplexityResult

    counts = [len(w) - 1 for w in windows]
    total = sum(n * c for n, c in zip(window_nlls, counts, strict=True))
    mean = total / sum(counts)
    return PerplexityResult(
        perplexity=math.exp(mean),
        nll=mean,
        tokens_scored=sum(counts),
        windows=len(windows),
        window_perplexities=tuple(math.exp(n) for n in window_nlls),
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where the two token sequences differ (a shorter one ends), None if equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def describe_divergence(tokenizer: Any, kiln: list[int], llama_cpp: list[int]) -> str:
    """Where the two answers part (empty when identical): the position and each side's token there."""
    d = first_divergence(kiln, llama_cpp)
    if d is None:
        return ""

    def at(ids: list[int]) -> str:
        return f"{ids[d]} {tokenizer.decode(ids[d : d + 1])!r}" if d < len(ids) else "(ended)"

    return (
        f"first divergence at answer token {d} after {tokenizer.decode(kiln[:d])!r}: "
        f"Kiln {at(kiln)}, llama.cpp {at(llama_cpp)}"
    )


@dataclass(frozen=True)
class Comparison:
    gguf: str
    artifact_id: str
    kernels: list[str]
    kiln: PerplexityResult
    llama_cpp: PerplexityResult
    question: str
    prompt_ids: list[int]
    kiln_answer: list[int]
    llama_cpp_answer: list[int]
    kiln_text: str
    llama_cpp_text: str
    divergence_note: str  # empty when the answers are identical
    seconds: dict[str, float]

    @property
    def ratio(self) -> float:
        """Kiln's perplexity / llama.cpp's."""
        return self.kiln.perplexity / self.llama_cpp.perplexity

    @property
    def divergence(self) -> int | None:
        return first_divergence(self.kiln_answer, self.llama_cpp_answer)

    def to_json(self) -> dict[str, Any]:
        return {
            "gguf": self.gguf,
            "artifact_id": self.artifact_id,
            "kernels": self.kernels,
            "perplexity": {
                "kiln": self.kiln.to_json(),
                "llama.cpp": self.llama_cpp.to_json(),
                "ratio_kiln_over_llama_cpp": self.ratio,
                "within_tolerance": abs(self.ratio - 1) <= PPL_REL_TOL,
                "tolerance": PPL_REL_TOL,
            },
            "greedy": {
                "question": self.question,
                "prompt_ids": self.prompt_ids,
                "kiln": {"ids": self.kiln_answer, "text": self.kiln_text},
                "llama.cpp": {"ids": self.llama_cpp_answer, "text": self.llama_cpp_text},
                "identical": self.divergence is None,
                "first_divergence": self.divergence,
                "divergence_note": self.divergence_note,
            },
            "seconds": self.seconds,
        }


def convert_and_load(gguf: Path, out: Path) -> LoadedModel:
    """The GGUF converted for cpu into `out` (Q4_1 layers as they are), loaded by the runtime."""
    from runtime.loader import load_model
    from services.convert.library import ConversionRequest, convert

    [result] = convert(ConversionRequest(str(gguf), ["cpu"], out=str(out)))
    if not result.manifest.verification.ok:
        raise RuntimeError(f"{gguf} converted, but its artifact failed verification")
    return load_model(result.uri)


def compare(
    gguf: Path,
    work_dir: Path,
    *,
    venv: Path = LLAMA_VENV,
    threads: int = THREADS,
    question: str = QUESTION,
    max_tokens: int = GREEDY_MAX_TOKENS,
) -> Comparison:
    """Convert `gguf` into `work_dir`, then score the fixed English text and answer `question` with
    Kiln and with llama.cpp (after Kiln, one at a time)."""
    from devtools.builders.smollm2 import PERPLEXITY_TEXT
    from devtools.eval import generate_greedy, perplexity, perplexity_windows, runtime_logits_fn
    from runtime.chat import apply_chat_template

    llama_python(venv)  # fail before the work
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    loaded = convert_and_load(gguf, work_dir)
    tok = loaded.tokenizer
    if tok is None:
        raise RuntimeError(f"the artifact of {gguf} carries no tokenizer")
    seconds["kiln_convert_load"] = time.perf_counter() - t
    ids = tok(PERPLEXITY_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    windows = perplexity_windows(ids)
    t = time.perf_counter()
    kiln_ppl = perplexity(runtime_logits_fn(loaded), ids)
    seconds["kiln_perplexity"] = time.perf_counter() - t
    prompt = apply_chat_template(tok, [{"role": "user", "content": question}])
    t = time.perf_counter()
    kiln_answer = generate_greedy(loaded, prompt, max_tokens).token_ids
    seconds["kiln_greedy"] = time.perf_counter() - t
    t = time.perf_counter()
    run = run_llama_cpp(
        gguf, windows, prompt, loaded.eos_token_ids, max_tokens=max_tokens, venv=venv, threads=threads
    )
    seconds["llama_cpp_child"] = time.perf_counter() - t
    seconds["llama_cpp_perplexity"] = run.perplexity_s
    seconds["llama_cpp_greedy"] = run.greedy_s
    return Comparison(
        gguf=str(gguf),
        artifact_id=loaded.manifest.artifact_id,
        kernels=sorted({e.kernel for e in loaded.manifest.layers.values()}),
        kiln=kiln_ppl,
        llama_cpp=windows_perplexity(windows, run.window_nlls),
        question=question,
        prompt_ids=prompt,
        kiln_answer=kiln_answer,
        llama_cpp_answer=run.greedy,
        kiln_text=tok.decode(kiln_answer),
        llama_cpp_text=tok.decode(run.greedy),
        divergence_note=describe_divergence(tok, kiln_answer, run.greedy),
        seconds=seconds,
    )


def report_lines(c: Comparison) -> list[str]:
    k, q = c.kiln, c.llama_cpp
    lines = [
        f"GGUF {c.gguf}",
        f"Kiln artifact {c.artifact_id} (kernels: {', '.join(c.kernels)})",
        f"perplexity, {k.windows} windows, {k.tokens_scored} tokens scored (the same ids on both sides):",
        f"  Kiln       {k.perplexity:.4f}  windows {', '.join(f'{p:.3f}' for p in k.window_perplexities)}",
        f"  llama.cpp  {q.perplexity:.4f}  windows {', '.join(f'{p:.3f}' for p in q.window_perplexities)}",
        f"  Kiln / llama.cpp = {c.ratio:.5f} ({(c.ratio - 1) * 100:+.3f} %; goal within ±{PPL_REL_TOL:.1%}: "
        f"{'met' if abs(c.ratio - 1) <= PPL_REL_TOL else 'NOT met'})",
        f"greedy chat answer to {c.question!r} ({len(c.prompt_ids)} prompt tokens):",
        f"  Kiln       {c.kiln_text!r}  {c.kiln_answer}",
        f"  llama.cpp  {c.llama_cpp_text!r}  {c.llama_cpp_answer}",
    ]
    if c.divergence is None:
        lines.append(f"  identical: yes ({len(c.kiln_answer)} tokens)")
    else:
        lines.append(f"  identical: NO, {c.divergence_note}")
    lines.append("seconds: " + ", ".join(f"{name} {s:.1f}" for name, s in c.seconds.items()))
    return lines


if __name__ == "__main__":
    child_main()
