"""Property-based API fuzzing: schemathesis (bounded, seeded) against the served OpenAPI document.

Runs the schemathesis CLI against uvicorn on loopback with a valid token and every check enabled;
the run must find no server error (5xx) and no response that contradicts the document.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from services.api.app import create_app
from tests.services.conftest import create_token, make_settings

MAX_EXAMPLES = 25
SEED = 1


def test_schemathesis_finds_no_server_errors(
    services_env: dict[str, str], serve_app: Callable[..., str], tmp_path: Path
) -> None:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(exe).exists():
        pytest.skip("schemathesis is not installed")
    settings = make_settings(services_env)
    url = serve_app(create_app(settings))
    token = create_token(settings, admin=True)
    cmd = [
        exe, "run", f"{url}/openapi.json",
        "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--checks", "all", "--workers", "1",
        "-H", f"Authorization: Bearer {token}", "--no-color",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert "Server error" not in report and " 500 " not in report, report[-6000:]
    assert out.returncode == 0, report[-6000:]
