"""Command registration (filled in by the owning package)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's commands to the `kiln` app."""
