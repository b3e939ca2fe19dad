"""PostgreSQL connections dropped (pg_terminate_backend on every connection of the API and the
worker, between jobs and mid-conversion): both reconnect (pool_pre_ping) and nothing fails."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.reliability.faults import artifact_rows, submit
from tests.services.conftest import PG_ADMIN_URL, wait_for_job
from tests.services.stack import Stack


def terminate_connections(database_url: str) -> int:
    """pg_terminate_backend on every other connection to this database; returns how many."""
    name = database_url.rsplit("/", 1)[-1]
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            return len(
                c.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": name},
                ).all()
            )
    finally:
        admin.dispose()


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
    for _ in range(3):  # each request checks out a pooled (dead) connection: pre-ping replaces it
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
