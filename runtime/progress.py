"""Rich progress bars (on stderr) for the CLI's long artifact operations: pulling and verifying.

Imported inside commands (it pulls in torch through the manifest), so `kiln --help` stays fast."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from runtime.artifact.manifest import Manifest
from runtime.artifact.pull import PullProgress, pull, verify_local

err = Console(stderr=True)


def _bar() -> Progress:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=False,
    )


def pull_with_progress(uri: str, cache_dir: Path, rank: int | None = None) -> Path:
    """`runtime.artifact.pull.pull` with a progress bar: bytes downloaded (s3://) or hashed (local)."""
    verb = "pull" if uri.startswith("s3://") else "verify"
    with _bar() as bar:
        task = bar.add_task(f"{verb} {uri.rstrip('/').rsplit('/', 1)[-1]}", total=None)

        def on_progress(p: PullProgress) -> None:
            bar.update(task, completed=p.bytes_done, total=p.bytes_total)

        return pull(uri, cache_dir, rank, on_progress)


def verify_with_progress(
    artifact_dir: Path, rank: int | None = None, manifest_sha256: str | None = None
) -> Manifest:
    """sha256 of every file of a local artifact (this rank's, or all) against its manifest, and of
    the manifest against `manifest_sha256` when pinned."""
    with _bar() as bar:
        task = bar.add_task(f"verify {artifact_dir.name}", total=None)

        def on_progress(p: PullProgress) -> None:
            bar.update(task, completed=p.bytes_done, total=p.bytes_total)

        return verify_local(artifact_dir, rank, on_progress, manifest_sha256=manifest_sha256)
