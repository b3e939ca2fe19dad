"""`vllm serve s3://bucket/prefix/ka-… --load-format kiln`: the artifact is pulled into Kiln's cache, as
`kiln pull` does (parallel ranged GETs, resumable, sha256-verified, cached), and vLLM serves that copy.

vLLM 0.32 cannot hand an object-storage model to a plugin's loader. `ModelConfig.__post_init__`
(`maybe_pull_model_tokenizer_for_runai`, vllm/config/model.py) fetches the model's *.json through
runai_model_streamer (not installed with vLLM's CPU build: a traceback about missing package
metadata), and `VllmConfig.__post_init__` (vllm/config/vllm.py) then refuses any load format but
runai_streamer, runai_streamer_sharded or modelexpress for it. So `register` (called by the
plugin's `vllm.general_plugins` entry point, which vLLM calls from `EngineArgs.__post_init__` among
other places) wraps `EngineArgs.create_model_config`: with `--load-format kiln` and an s3:// model,
the artifact is pulled there and `--model` becomes the local copy before vLLM reads anything;
nothing changes for any other model or load format. The process that builds the engine's config
pulls every rank's files, so the workers it starts on this machine find them; S3 settings are
Kiln's (`KILN_S3_*`, `KILN_CACHE_DIR`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kernels.errors import KilnError
from runtime.artifact.hf_config import KILN_QUANT_METHOD

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

    from runtime.artifact.pull import PullProgress

OBJECT_STORAGE_SCHEMES = ("s3://", "gs://", "az://")  # what vLLM 0.32 treats as object storage
PROGRESS_EVERY_S = 10.0

log = logging.getLogger("vllm.kiln")  # under vLLM's logger, so its handlers and levels apply

_lock = threading.Lock()
_installed = False


class RemoteArtifactError(KilnError):
    """An object-storage model that `--load-format kiln` cannot pull."""


def register() -> None:
    """Called by the plugin's `register` (safe to call more than once)."""
    global _installed
    with _lock:
        if _installed:
            return
        from vllm.config import ModelConfig
        from vllm.engine.arg_utils import EngineArgs

        create_model_config = EngineArgs.create_model_config

        @functools.wraps(create_model_config)
        def pull_then_create_model_config(self: EngineArgs, *args: Any, **kwargs: Any) -> ModelConfig:
            if self.load_format == KILN_QUANT_METHOD and is_object_storage(self.model):
                use_pulled_artifact(self)
            return create_model_config(self, *args, **kwargs)

        EngineArgs.create_model_config = pull_then_create_model_config  # type: ignore[method-assign]
        _installed = True


def is_object_storage(model: str) -> bool:
    return model.lower().startswith(OBJECT_STORAGE_SCHEMES)


def use_pulled_artifact(args: EngineArgs) -> None:
    """Pull `args.model` (s3://…/ka-…[@sha256:…]) into Kiln's cache and point `args` at the copy; the
    URL stays the served model name unless one was given."""
    from runtime.artifact.pull import pull
    from runtime.settings import get_settings

    url = args.model
    if not url.startswith("s3://"):
        raise RemoteArtifactError(
            f"{url}: Kiln artifacts are pulled from S3 (s3://bucket/prefix/ka-…) or served from a local "
            "directory; copy this one to S3 or to local disk, then serve that"
        )
    cache_dir = get_settings().cache_dir
    log.info("kiln: pulling %s into %s (as `kiln pull` does)", url, cache_dir)
    started = time.perf_counter()
    path = pull(url, cache_dir, rank=None, progress=_progress_logger(url))
    log.info("kiln: %s is at %s (%.1f s); serving that copy", url, path, time.perf_counter() - started)
    if args.tokenizer in (None, url):
        args.tokenizer = str(path)
    if args.served_model_name is None:
        args.served_model_name = url
    args.model = str(path)


def _progress_logger(url: str) -> Callable[[PullProgress], None]:
    """A pull progress callback that logs at most once every PROGRESS_EVERY_S."""
    last = time.monotonic()
    lock = threading.Lock()

    def report(event: PullProgress) -> None:
        nonlocal last
        with lock:
            now = time.monotonic()
            if now - last < PROGRESS_EVERY_S:
                return
            last = now
        log.info("kiln: %s: %.0f of %.0f MB", url, event.bytes_done / 1e6, event.bytes_total / 1e6)

    return report
