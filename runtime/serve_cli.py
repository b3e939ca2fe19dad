"""`kiln serve`: pull (if remote), load, start the engine and serve the OpenAI-compatible API.

Flags follow `vllm serve`. Heavy imports happen inside the command so `kiln --help` stays fast.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runtime.cli_output import print_error

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess

    import uvicorn

    from runtime.engine import AsyncEngine, Engine
    from runtime.loader import LoadedModel

log = logging.getLogger(__name__)


class KvCacheDtypeChoice(StrEnum):
    auto = "auto"
    fp8 = "fp8"


class DeviceChoice(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


VERIFY_HELP = (
    "Hash every file of the artifact (sha256, in parallel) against its manifest before loading. "
    "Without it a local or already-cached artifact is checked for file sizes, headers and tensor "
    "shapes only; files downloaded from s3:// are always hashed."
)


def resolve_artifact(artifact: str, cache_dir: Path | None, *, verify: bool = False) -> Path:
    """A local artifact directory as is (the loader checks sizes, headers and shapes), or an `s3://…`
    artifact pulled into the cache (downloads hashed; a cached copy is reused). `verify` hashes every
    file of the result against the manifest. A local directory may carry a pin (`DIR@sha256:<hex>`):
    the manifest's digest is then checked too, and `verify` is implied."""
    from runtime.artifact.manifest_pin import split_pin
    from runtime.progress import pull_with_progress, verify_with_progress

    pin = None
    if not artifact.startswith("s3://"):
        artifact, pin = split_pin(artifact)
    if artifact.startswith("s3://"):
        from runtime.settings import get_settings

        path = pull_with_progress(artifact, cache_dir or get_settings().cache_dir)
    else:
        path = Path(artifact).expanduser()
        if not path.is_dir():
            raise typer.BadParameter(
                f"{artifact}: not a directory and not an s3:// URI", param_hint="ARTIFACT"
            )
        path = artifact_in(path)
    if verify or pin is not None:
        verify_with_progress(path, manifest_sha256=pin)
    return path


def artifact_in(path: Path) -> Path:
    """`path` when it holds an artifact; the one artifact of an artifact store (`kiln convert --out`'s
    directory), said on stderr; else a LoadError saying what the directory is and what to pass."""
    from runtime.artifact.manifest import MANIFEST_NAME
    from runtime.loader import LoadError

    if (path / MANIFEST_NAME).is_file():
        return path
    held = sorted(p.name for p in path.glob("ka-*") if (p / MANIFEST_NAME).is_file())
    if len(held) == 1:
        typer.echo(f"{path} is an artifact store holding one artifact: using {path / held[0]}", err=True)
        return path / held[0]
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise LoadError(
            f"{path} is an artifact store holding {shown}; pass one of them, e.g. {path / held[0]}"
        )
    if (path / "config.json").is_file():
        raise LoadError(
            f"{path} is a Hugging Face checkpoint, not a Kiln artifact: convert it first "
            f"(kiln convert {path} --target cpu --out ./artifacts), then pass the ./artifacts/ka-… it prints"
        )
    return path  # the loader names what is missing


def serve(
    artifact: Annotated[str, typer.Argument(help="Artifact directory, or s3://bucket/prefix/<artifact_id>.")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name in the API (default: the artifact id).")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Most sequences decoded together.")] = 8,
    max_model_len: Annotated[
        int | None, typer.Option(min=1, help="Context length (prompt + output); default: the model's.")
    ] = None,
    kv_cache_dtype: Annotated[
        KvCacheDtypeChoice, typer.Option(help="KV cache storage.")
    ] = KvCacheDtypeChoice.auto,
    device: Annotated[
        DeviceChoice | None, typer.Option(help="Where to run (default: the artifact's target).")
    ] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Where s3:// artifacts are pulled to.")] = None,
    uvicorn_log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
    verify: Annotated[bool, typer.Option(help=VERIFY_HELP)] = False,
    max_request_bytes: Annotated[
        int | None,
        typer.Option(
            min=1, help="Request bodies over this many bytes get 413 (KILN_SERVE_MAX_REQUEST_BYTES)."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require `Authorization: Bearer <key>` on every path (KILN_API_KEY) but /health, "
            "/metrics and /version.",
            show_default=False,
        ),
    ] = None,
    tp: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tensor-parallel ranks, one process each, started here (gloo on CPU, NCCL on CUDA; "
            "rank 0 serves HTTP). Default: the artifact's TP size.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve an artifact with an OpenAI-compatible API (/v1/chat/completions, /v1/completions, …)."""
    from runtime.startup import freeze_long_lived, import_torch

    import_torch()
    import torch

    from kernels.errors import KilnError
    from runtime.settings import get_settings

    settings = get_settings()
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    try:
        path = resolve_artifact(artifact, cache_dir, verify=verify)
        ranks = _start_ranks(
            path, tp_size(path, tp), device.value if device else None, kv_cache_dtype.value, max_num_seqs,
            max_model_len, settings.num_threads,
        )  # fmt: skip
        freeze_long_lived()
    except KilnError as e:
        print_error(e)
        raise typer.Exit(code=1) from e
    api_key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
    max_request_bytes = max_request_bytes or settings.serve_max_request_bytes
    if not _serve_http(ranks, host, port, served_model_name, max_request_bytes, api_key, uvicorn_log_level):
        raise typer.Exit(code=1)


@dataclass
class StartedRanks:
    """The engine of rank 0 (the only one for TP 1) and, with TP, the other ranks' processes."""

    path: Path
    engine: Engine
    loaded: LoadedModel
    followers: list[SpawnProcess] = field(default_factory=list)
    rendezvous: Path = field(default_factory=Path)


def _start_ranks(
    path: Path,
    world_size: int,
    device: str | None,
    kv_cache_dtype: str,
    max_num_seqs: int,
    max_model_len: int | None,
    num_threads: int,
) -> StartedRanks:
    """Load the artifact in this process (rank 0) and, with TP, start and load the other ranks."""
    from runtime.distributed import private_rendezvous
    from runtime.engine import Engine
    from runtime.loader import LoadError, load_model
    from runtime.tp_serving import LeaderEngine, RankSpec, load_rank, start_followers, stop_followers

    if world_size == 1:
        loaded = load_model(path, device=device, kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
        started = StartedRanks(
            path, Engine(loaded, max_num_seqs=max_num_seqs, max_model_len=max_model_len), loaded
        )
    else:
        rendezvous = private_rendezvous()
        spec = RankSpec(
            artifact=str(path), world_size=world_size, rendezvous=str(rendezvous), device=device,
            kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            num_threads=num_threads,
        )  # fmt: skip
        log.info("starting %d tensor-parallel ranks for %s", world_size, path)
        followers = start_followers(spec)
        leader, errors = load_rank(spec, 0, LeaderEngine)
        if leader is None:
            stop_followers(None, followers, rendezvous)
            raise LoadError("; ".join(errors))
        started = StartedRanks(path, leader, leader.loaded, followers, rendezvous)
    if started.loaded.tokenizer is None:
        raise LoadError(f"{path}: the artifact has no tokenizer; re-convert its checkpoint")
    return started


def _serve_http(
    ranks: StartedRanks,
    host: str,
    port: int,
    served_model_name: str | None,
    max_request_bytes: int,
    api_key: str | None,
    uvicorn_log_level: str,
) -> bool:
    """The OpenAI server over rank 0's engine until it stops; False when it did not start or a rank
    died (the requests in flight then fail and the server stops)."""
    import uvicorn

    from runtime.engine import AsyncEngine
    from runtime.openai import build_app
    from runtime.tp_serving import LeaderEngine, stop_followers, watch_followers

    loaded, followers = ranks.loaded, ranks.followers
    artifact_id = loaded.manifest.artifact_id
    name = served_model_name or artifact_id
    async_engine = AsyncEngine(ranks.engine)
    app = build_app(
        async_engine, name, loaded.tokenizer, root=artifact_id, max_request_bytes=max_request_bytes,
        api_key=api_key,
    )  # fmt: skip
    log.info(
        "serving %s (%s) on http://%s:%d, loaded in %.2f s", name, ranks.path, host, port, loaded.load_seconds
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level))
    lost_rank: list[str] = []
    end_watch = _no_watch
    if followers:

        def on_rank_death(reason: str) -> None:
            log.critical("%s: failing the requests in flight and stopping", reason)
            lost_rank.append(reason)
            async_engine.fail(reason)
            server.should_exit = True

        end_watch = watch_followers(followers, on_rank_death)
    try:
        started = run_beside_engine(server, async_engine)
    finally:
        end_watch()  # from here on a follower that exits was told to
        if followers:
            assert isinstance(ranks.engine, LeaderEngine)
            stop_followers(ranks.engine if not lost_rank else None, followers, ranks.rendezvous)
    return started and not lost_rank


def _no_watch() -> None:
    return None


def tp_size(path: Path, tp: int | None) -> int:
    """The ranks to run: `--tp`, which must match the artifact's sharding, or the artifact's."""
    from runtime.artifact.manifest import Manifest
    from runtime.loader import LoadError

    sharded = Manifest.load(path).tp
    if tp is not None and tp != sharded:
        raise LoadError(
            f"{path.name} was sharded for tp={sharded}; --tp {tp} cannot serve it — pass --tp {sharded} "
            f"(or leave --tp out), or convert the checkpoint with --tp {tp}"
        )
    return sharded


def run_beside_engine(server: uvicorn.Server, async_engine: AsyncEngine) -> bool:
    """Serve HTTP from a background thread while this thread — the one that loaded the model —
    runs the engine (see AsyncEngine). SIGINT / SIGTERM stop the server gracefully (a second one
    forces it); the engine keeps stepping until the server has finished its requests. Returns
    whether the server started."""

    def serve_http() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn exits this way when it cannot bind; it has logged why
            log.debug("the HTTP server exited early", exc_info=True)

    http = threading.Thread(target=serve_http, name="kiln-http", daemon=True)

    def stop(signum: int, _frame: object) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # The server's lifespan and first requests may come before this thread reaches run_here: they
    # must not start the engine on a thread of their own.
    async_engine.claim_for_caller()
    try:
        http.start()
        async_engine.run_here(keep_running=http.is_alive)
    finally:
        server.should_exit = True
        http.join(timeout=30)
        async_engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started


def register_serve(app: typer.Typer) -> None:
    app.command("serve")(serve)
