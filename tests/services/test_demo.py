"""`make demo`'s path, as a user runs it (its fp8 half; the GPTQ half adds ≈100 s of llm-compressor):
kiln api on embedded defaults, a token, the conversion over REST, kiln pull, kiln serve and the
official openai client — the answer and the figures on screen, the producers' and services' output
in the named log file, and nothing left running."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from tests.services.conftest import REPO


def test_demo_answers_through_the_service_and_stops_what_it_started(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_CHECKPOINT_CACHE"}
    out = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--no-int4", "--log", str(log)],
        cwd=REPO, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    screen = out.stdout + out.stderr
    assert out.returncode == 0, screen + log.read_text()[-3000:]
    assert str(log) in screen
    for step in ("kiln api on http://127.0.0.1:", "POST /v1/conversions", "GET /v1/artifacts", "kiln pull"):
        assert step in screen, step
    assert re.search(r"job-[0-9a-f]+ +succeeded +100%", screen)
    assert "Paris" in screen and "time to first token" in screen and "decode tok/s" in screen
    assert "HTTP Request" not in screen and "INFO" not in screen and "Traceback" not in screen

    text = log.read_text()
    assert "HTTP Request: POST" in text  # the client's logs went to the file
    ports = [int(p) for p in re.findall(r"^\$ kiln (?:api|serve) .*--port (\d+)$", text, re.MULTILINE)]
    assert len(ports) == 2, text[-3000:]
    for port in ports:  # kiln api and kiln serve were stopped
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, port
