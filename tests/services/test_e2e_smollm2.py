"""End to end with the real SmolLM2-135M-Instruct (bf16): S3 upload -> REST -> Celery worker converts
for cpu and sm80 -> rows in PostgreSQL, objects in S3 -> `kiln pull` + `kiln generate` answer."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from services.db.models import Artifact
from services.db.session import session_scope
from tests.services.conftest import REPO, wait_for_job
from tests.services.stack import Stack

PROMPT = "What is the capital of France? Answer in one sentence."
CONVERT_TIMEOUT_S = 900


@pytest.mark.slow  # ≈2–4 min on 2 shared cores; the synthetic end-to-end test runs in `make test`
def test_smollm2_rest_convert_pull_generate(
    make_stack: Callable[..., Stack], smollm2_bf16: Path, services_env: dict[str, str], tmp_path: Path
) -> None:
    # The real model takes longer than the short test time limits: give this worker room.
    stack = make_stack(
        KILN_JOB_SOFT_TIME_LIMIT_S=str(CONVERT_TIMEOUT_S),
        KILN_JOB_HARD_TIME_LIMIT_S=str(CONVERT_TIMEOUT_S + 30),
        KILN_BROKER_VISIBILITY_TIMEOUT_S=str(CONVERT_TIMEOUT_S + 60),
    )
    source = stack.upload_checkpoint(smollm2_bf16, "SmolLM2-135M-Instruct")
    r = stack.api.post("/v1/conversions", json={"source": source, "targets": ["cpu", "sm80"]})
    assert r.status_code == 202, r.text
    job = wait_for_job(stack.api, r.json()["id"], timeout=CONVERT_TIMEOUT_S)
    assert job["status"] == "succeeded", (job, stack.worker.log.read_text()[-3000:])

    with session_scope(stack.settings) as s:
        rows = {a.target: (a.id, a.uri, len(a.files)) for a in s.scalars(select(Artifact))}
    assert set(rows) == {"cpu", "sm80"} and sorted(i for i, _, _ in rows.values()) == sorted(
        job["artifact_ids"]
    )
    store = stack.store()
    assert sorted(store.list_ids()) == sorted(job["artifact_ids"]) and store.staging_keys() == []

    env = {**os.environ, **services_env}
    cache = tmp_path / "pull-cache"

    def kiln(*args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    for _, uri, n_files in rows.values():  # both pull and verify; only cpu runs on this machine
        kiln("pull", uri, "--cache-dir", str(cache))
        aid = uri.rsplit("/", 1)[-1]
        assert (cache / aid / "manifest.json").is_file()
        assert len([p for p in (cache / aid).iterdir() if p.is_file()]) >= n_files
    cpu_uri = rows["cpu"][1]
    out = kiln(
        "generate", cpu_uri, "--cache-dir", str(cache), "--prompt", PROMPT, "--chat", "--max-tokens", "24"
    )
    assert "Paris" in out.stdout, out.stdout
