"""Command registration (filled in by the owning package)."""

from __future__ import annotations

import typer

from runtime.serve_cli import register_serve


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `kiln` app."""
    register_serve(app)
