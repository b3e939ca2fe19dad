"""PostgreSQL connections dropped (pg_terminate_backend on every connection of the API and the
worker, between jobs and mid-conversion): both reconnect and nothing fails."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.reliability.faults import artifact_rows, submit
from tests.reliability.pg_kill import terminate_connections
from tests.services.conftest import wait_for_job
from tests.services.stack import Stack

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py


def test_api_and_worker_reconnect_after_connections_are_dropped(
    make_stack: Callable[..., Stack], tiny_checkpoint: Path
) -> None:
    stack = make_stack(KILN_CONVERT_LAYER_DELAY_S="0.3")
    db = stack.settings.resolved_database_url
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-pg")
    first = wait_for_job(stack.api, submit(stack, source, ["cpu"])["id"], timeout=90)
    assert first["status"] == "succeeded", first

    # Between jobs: every pooled connection of the API and of the worker's pool process is dead.
    assert terminate_connections(db) >= 2
    for _ in range(3):  # each request checks out a pooled (dead) connection: it is replaced
        r = stack.api.get(f"/v1/conversions/{first['id']}")
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    assert stack.api.get("/health").json()["checks"]["db"] == "ok"

    # Mid-conversion: the worker's heartbeat / progress / cancellation reads lose their connections.
    second = submit(stack, source, ["sm80"])
    wait_for_job(
        stack.api, second["id"], timeout=60,
        until=lambda j: j["status"] == "running" and j["stage"] == "converting",
    )  # fmt: skip
    assert terminate_connections(db) >= 1
    done = wait_for_job(stack.api, second["id"], timeout=90)
    assert done["status"] == "succeeded" and done["attempts"] == 1, (
        done,
        stack.worker.log.read_text(errors="replace")[-3000:],
    )
    assert artifact_rows(stack) == 2 and stack.store().staging_keys() == []
