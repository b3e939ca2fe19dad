"""What every `kiln` command writes on stderr: the console, and the one-line error."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)


def print_error(e: BaseException) -> None:
    """One `error: …` line on stderr, never wrapped (logs and grep see the whole message), the
    message printed as it is (not read as markup)."""
    err.print(f"[bold red]error:[/] {escape(' '.join(str(e).split()))}", highlight=False, soft_wrap=True)
