"""`kiln`: one command line for the runtime (pull / generate / serve) and the services
(plan / convert / api / worker / db / admin). Each package registers its own commands."""

from __future__ import annotations

import logging
import sys

from runtime.startup import import_torch

# Every command's modules import torch: import it first and freeze what it leaves alive, so that
# the imports after it (and a runtime command's load) run no collection over torch's objects.
import_torch()

import typer  # noqa: E402

from kernels.errors import KilnError  # noqa: E402
from runtime.cli import register as register_runtime  # noqa: E402
from services.convert.cli import register as register_convert  # noqa: E402
from services.ops_cli import register as register_ops  # noqa: E402

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
