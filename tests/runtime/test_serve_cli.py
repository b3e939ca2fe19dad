"""`kiln serve` as a GPU node runs it: the API key, /health once the engine has died, and clean
errors (no traceback, exit 1, what to do) for what users pass it: a checkpoint, an artifact store,
bad option values. Also `kiln admin create-token` on a fresh embedded data directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import PreTrainedModel

from kernels.errors import KilnError
from tests.runtime.serving import MODEL_NAME, serve_artifact

KILN = [sys.executable, "-m", "services.cli"]
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _kiln(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*KILN, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def test_api_key_guards_v1_and_leaves_health_open(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    with serve_artifact(llama_artifact[1], api_key="s3cret") as server:
        url = server.base_url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.post(
            f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"}, timeout=60
        )
        assert ok.status_code == 200, ok.text
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(f"{url}{path}").status_code == 200, path


def test_health_is_503_once_the_engine_died(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    with serve_artifact(llama_artifact[1]) as server:
        url = server.base_url
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200

        def broken(*_: Any) -> bool:
            raise RuntimeError("simulated failure outside a step")

        server.engine.has_unfinished = broken  # type: ignore[method-assign]
        server.async_engine._wake.set()  # the loop checks it at once and dies
        server.async_engine._thread.join(timeout=10)  # type: ignore[union-attr]
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and "simulated failure" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_serve_refuses_bad_options_without_a_traceback(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    art = str(llama_artifact[1])
    for args in (["--device", "tpu"], ["--max-num-seqs", "0"], ["--max-model-len", "-5"]):
        r = _kiln("serve", art, *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert args[0] in r.stderr, (args, r.stderr)


def test_generate_names_a_checkpoint_and_an_artifact_store(
    llama_artifact: tuple[PreTrainedModel, Path], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    r = _kiln("generate", str(checkpoint), "--prompt", "hi", "--max-tokens", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "Hugging Face checkpoint, not a Kiln artifact" in r.stderr and "kiln convert" in r.stderr

    store = tmp_path / "store"
    first = store / llama_artifact[1].name
    shutil.copytree(llama_artifact[1], first)
    r = _kiln("generate", str(store), "--prompt", "hi", "--max-tokens", "1")
    assert r.returncode == 0, r.stderr
    assert f"artifact store holding one artifact: using {first}" in r.stderr

    shutil.copytree(llama_artifact[1], store / "ka-00000000000000000000000000000000")
    r = _kiln("generate", str(store), "--prompt", "hi", "--max-tokens", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "artifact store holding ka-0000" in r.stderr and first.name in r.stderr


def test_wrong_tp_names_a_command_that_exists(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    import json

    art = tmp_path / "tp2"
    shutil.copytree(llama_artifact[1], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["tp"] = 2
    (art / "manifest.json").write_text(json.dumps(manifest))
    r = _kiln("generate", str(art), "--prompt", "hi", "--max-tokens", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "kiln serve ARTIFACT --tp 2" in r.stderr and "--tensor-parallel-size 2" in r.stderr
    assert "convert with --tp 1" in r.stderr
    served = _kiln("serve", str(art), "--tp", "4")
    assert served.returncode == 1 and "Traceback" not in served.stderr
    assert "sharded for tp=2; --tp 4 cannot serve it" in served.stderr


@pytest.mark.parametrize("command", [["create-token", "--name", "first"], ["list-tokens"]])
def test_admin_commands_on_a_fresh_embedded_data_dir(tmp_path: Path, command: list[str]) -> None:
    env = {"KILN_DATA_DIR": str(tmp_path / "var"), "KILN_DATABASE_URL": "", "KILN_ENVIRONMENT": "development"}
    r = _kiln("admin", *command, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    if command[0] == "create-token":
        assert r.stdout.strip().splitlines()[-1].startswith("kiln_")


def test_an_error_message_with_brackets_is_printed_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli_output import print_error

    print_error(KilnError("targets [sm80] and [/x] rejected; see [bold]"))
    assert capsys.readouterr().err.strip() == "error: targets [sm80] and [/x] rejected; see [bold]"
