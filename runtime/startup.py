"""Process start-up of the runtime commands (`kiln generate`, `kiln serve`): the garbage collector.

`import torch` leaves ≈300k container objects alive for the life of the process. Every gen-2
collection rescans them, and the imports and the load that follow allocate enough to trigger
several: measured ≈100–160 ms of the path to the first token on a 2-core machine. `gc.freeze()`
moves what is alive to a permanent generation that collections skip. Freezing again once the
model and engine are built keeps their objects out of the collections that decoding triggers.
"""

from __future__ import annotations

import gc


def import_torch() -> None:
    """Import torch and freeze what its import left alive."""
    import torch  # noqa: F401  (the import is the point)

    gc.freeze()


def freeze_long_lived() -> None:
    """Freeze what is alive now (call once the model and engine are built)."""
    gc.freeze()
