"""`kiln serve`: pull (if remote), load, start the engine and serve the OpenAI-compatible API.

Flags follow `vllm serve`. Heavy imports happen inside the command so `kiln --help` stays fast.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

log = logging.getLogger(__name__)


class KvCacheDtypeChoice(StrEnum):
    auto = "auto"
    fp8 = "fp8"


def resolve_artifact(artifact: str, cache_dir: Path | None) -> Path:
    """A local artifact directory as is (the loader checks file sizes against the manifest), or an
    `s3://…` artifact pulled into the cache (verified, reused when already there)."""
    if artifact.startswith("s3://"):
        from runtime.artifact.pull import pull
        from runtime.settings import get_settings

        return pull(artifact, cache_dir or get_settings().cache_dir)
    path = Path(artifact).expanduser()
    if not path.is_dir():
        raise typer.BadParameter(f"{artifact}: not a directory and not an s3:// URI", param_hint="ARTIFACT")
    return path


def serve(
    artifact: Annotated[str, typer.Argument(help="Artifact directory, or s3://bucket/prefix/<artifact_id>.")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name in the API (default: ARTIFACT as given).")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences decoded together.")] = 8,
    max_model_len: Annotated[
        int | None, typer.Option(help="Context length (prompt + output); default: the model's.")
    ] = None,
    kv_cache_dtype: Annotated[
        KvCacheDtypeChoice, typer.Option(help="KV cache storage.")
    ] = KvCacheDtypeChoice.auto,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: the artifact's target).")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Where s3:// artifacts are pulled to.")] = None,
    uvicorn_log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Serve an artifact with an OpenAI-compatible API (/v1/chat/completions, /v1/completions, …)."""
    import torch
    import uvicorn

    from runtime.engine import AsyncEngine, Engine
    from runtime.loader import load_model
    from runtime.server import build_app
    from runtime.settings import get_settings

    settings = get_settings()
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    path = resolve_artifact(artifact, cache_dir)
    loaded = load_model(path, device=device, kv_cache_dtype=kv_cache_dtype.value)
    if loaded.tokenizer is None:
        raise typer.BadParameter(f"{path}: the artifact has no tokenizer", param_hint="ARTIFACT")
    engine = Engine(loaded, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    name = served_model_name or artifact
    app = build_app(AsyncEngine(engine), name, loaded.tokenizer, root=str(path))
    log.info("serving %s (%s) on http://%s:%d, loaded in %.2f s", name, path, host, port, loaded.load_seconds)
    uvicorn.run(app, host=host, port=port, log_level=uvicorn_log_level)


def register_serve(app: typer.Typer) -> None:
    app.command("serve")(serve)
