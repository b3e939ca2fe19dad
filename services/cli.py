"""`kiln`: one command line for the runtime (pull / generate / serve) and the services
(plan / convert / api / worker / db / admin). Each package registers its own commands."""

from __future__ import annotations

import logging
import sys

import typer

from kernels.errors import KilnError
from runtime.cli import register as register_runtime
from services.convert.cli import register as register_convert
from services.ops_cli import register as register_ops

app = typer.Typer(
    name="kiln",
    help="Convert LLM checkpoints once into kernel-ready artifacts; serve them with zero load-time work.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
register_runtime(app)
register_convert(app)
register_ops(app)


def main() -> None:
    """The `kiln` entry point: a KilnError any command lets through is one line and exit code 1,
    never a traceback (commands that catch their own say more, e.g. which layer)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app()
    except KilnError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
