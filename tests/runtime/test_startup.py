"""The runtime commands' start-up: torch's import-time objects are frozen out of the collector."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

# `import torch` leaves a few hundred thousand tracked objects alive (≈290k with torch 2.13)
MIN_FROZEN_AFTER_TORCH = 100_000


def test_import_torch_freezes_what_torch_left_alive() -> None:
    code = (
        "import gc\n"
        "from runtime.startup import import_torch\n"
        "assert gc.get_freeze_count() == 0\n"
        "import_torch()\n"
        "print(gc.get_freeze_count(), gc.isenabled())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    frozen, enabled = out.split()
    assert int(frozen) >= MIN_FROZEN_AFTER_TORCH
    assert enabled == "True"  # frozen, not disabled: later garbage is still collected
