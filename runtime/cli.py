"""Runtime commands of the `kiln` CLI: `pull` and `generate` (here) and `serve` (runtime/serve_cli.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kernels.errors import KilnError
from runtime.cli_output import err, print_error
from runtime.serve_cli import VERIFY_HELP, register_serve

__all__ = ["err", "print_error", "register"]


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `kiln` app."""
    app.command("pull")(pull_command)
    app.command("generate")(generate_command)
    # ---- `kiln serve` lives in runtime/serve_cli.py (server owner) --------------------------------
    register_serve(app)


def _fail(e: KilnError) -> typer.Exit:
    print_error(e)
    return typer.Exit(code=1)


def pull_command(
    uri: Annotated[
        str, typer.Argument(help="s3://bucket/prefix/<artifact_id> or a local artifact directory")
    ],
    rank: Annotated[int | None, typer.Option(help="TP rank: pull only its files (default: all)")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="default: KILN_CACHE_DIR")] = None,
) -> None:
    """Download an artifact (parallel ranged GETs, resumable, sha256-verified) into the local cache.
    A URI ending in `@sha256:<hex>` pins the manifest's digest (printed on stderr after a pull)."""
    from runtime.artifact.manifest import read_manifest_bytes
    from runtime.artifact.manifest_pin import PIN_MARK, manifest_sha256, split_pin
    from runtime.progress import pull_with_progress
    from runtime.settings import get_settings

    try:
        path = pull_with_progress(uri, cache_dir or get_settings().cache_dir, rank)
        digest = manifest_sha256(read_manifest_bytes(path))
    except KilnError as e:
        raise _fail(e) from e
    err.print(
        f"manifest sha256 {digest} (pin it: {split_pin(uri)[0]}{PIN_MARK}{digest})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    typer.echo(str(path))


def generate_command(
    artifact: Annotated[str, typer.Argument(help="artifact directory or s3://bucket/prefix/<artifact_id>")],
    prompt: Annotated[str, typer.Option(help="the prompt (or the user message with --chat)")],
    chat: Annotated[bool, typer.Option(help="format the prompt with the tokenizer's chat template")] = False,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option()] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    kv_cache_dtype: Annotated[
        str, typer.Option(help="auto (compute dtype) or fp8 (e4m3, per-layer scales)")
    ] = "auto",
    max_model_len: Annotated[
        int | None, typer.Option(help="context length (default: min(model, 2048))")
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="where s3:// artifacts are pulled (KILN_CACHE_DIR)")
    ] = None,
    verify: Annotated[bool, typer.Option(help=VERIFY_HELP)] = False,
) -> None:
    """One-shot generation: prints the completion, then load time and tokens/s on stderr."""
    from runtime.startup import freeze_long_lived, import_torch

    import_torch()
    from runtime.chat import apply_chat_template
    from runtime.engine import Engine
    from runtime.loader import load_model
    from runtime.sampling import SamplingParams
    from runtime.serve_cli import resolve_artifact

    started = time.perf_counter()
    try:
        path = resolve_artifact(artifact, cache_dir, verify=verify)
        loaded = load_model(path, kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
        engine = Engine(loaded, max_num_seqs=1, max_model_len=max_model_len)
        freeze_long_lived()
        tokenizer = loaded.tokenizer
        assert tokenizer is not None
        if chat:
            ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = list(tokenizer(prompt)["input_ids"])
        load_s = time.perf_counter() - started
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        engine.add_request("cli", ids, params)
        last = None
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
                last = out
    except KilnError as e:
        raise _fail(e) from e
    sys.stdout.write("\n")
    assert last is not None
    m = last.metrics
    assert m.first_token_time is not None and m.last_token_time is not None
    ttft = m.first_token_time - m.arrival_time
    decode_s = m.last_token_time - m.first_token_time
    rate = (last.num_generated - 1) / decode_s if decode_s > 0 else float("nan")
    err.print(
        f"[dim]load {load_s:.2f}s (mapping {loaded.load_seconds:.2f}s) · prompt {len(ids)} tokens, "
        f"first token {ttft * 1000:.0f} ms · {last.num_generated} tokens at {rate:.1f} tok/s "
        f"· finish: {last.finish_reason}[/dim]"
    )
