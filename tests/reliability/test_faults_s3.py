"""The S3 server stopped mid-upload: the worker retries with backoff, the job then fails cleanly,
the API stays up and reports the store down (/health 503 naming it), and once the store is back
the reconciler removes what the interrupted upload had staged.

The store here is a second moto server in this process on its own port, which the test closes and
reopens. moto keeps its buckets in process memory, so the session's S3 server (`s3_server`) still
sees the same objects while this one is down: the test looks through it at what was staged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.storage.s3 import S3Store
from tests.fixtures.s3 import s3_test_env
from tests.reliability.faults import submit
from tests.services.conftest import free_port, make_settings, wait_for_job
from tests.services.stack import Stack

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py

S3_MAX_ATTEMPTS = "2"  # boto3 retries per request (standard mode, backoff between them)
WORKER_ENV = {
    "KILN_CONVERT_LAYER_DELAY_S": "0.3",  # slow enough to stop the store while files are staged
    "KILN_RECONCILE_INTERVAL_S": "1",
    "KILN_JOB_SOFT_TIME_LIMIT_S": "10",
    "KILN_JOB_HARD_TIME_LIMIT_S": "12",  # the sweeper removes staging older than this
}


class ClosableS3:
    """A moto server on a fixed loopback port whose listening socket is really closed by stop()."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: object | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self.server = server

    def stop(self) -> None:
        server = self.server
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
            server._server.server_close()  # type: ignore[attr-defined]  # refuse, not hang
        self.server = None


@pytest.fixture
def own_s3(services_env: dict[str, str], s3_bucket: str) -> Iterator[ClosableS3]:
    server = ClosableS3(free_port())
    server.start()
    services_env.update(s3_test_env(server.url))
    services_env["KILN_S3_MAX_ATTEMPTS"] = S3_MAX_ATTEMPTS
    try:
        yield server
    finally:
        server.stop()


def test_s3_stopped_mid_upload_fails_cleanly_and_cleans_up(
    own_s3: ClosableS3,
    make_stack: Callable[..., Stack],
    tiny_checkpoint: Path,
    services_env: dict[str, str],
    s3_server: str,
) -> None:
    stack = make_stack(**WORKER_ENV)
    source = stack.upload_checkpoint(tiny_checkpoint, "tiny-s3-outage")
    # The same bucket seen through the session's server, which stays up.
    observer_settings = make_settings({**services_env, **s3_test_env(s3_server)})
    observer = S3Store(stack.settings.resolved_store_url, observer_settings)
    job = submit(stack, source, ["cpu"])
    deadline = time.monotonic() + 60
    while not observer.staging_keys():
        assert time.monotonic() < deadline, "the conversion never staged files"
        time.sleep(0.05)
    own_s3.stop()

    done = wait_for_job(stack.api, job["id"], timeout=120)  # the API answers from SQL meanwhile
    log = stack.worker.log.read_text(errors="replace")
    assert done["status"] == "failed", (done, log[-3000:])
    assert done["attempts"] == stack.settings.max_job_attempts
    assert "transient error" in done["error"] and "Connect" in done["error"], done["error"]
    assert log.count("transient error, retrying in") >= 2  # backoff between the attempts
    assert done["artifact_ids"] == []
    health = stack.api.get("/health")
    assert health.status_code == 503, health.text
    checks = health.json()["checks"]
    assert checks["store"].startswith("down") and checks["db"] == "ok", checks
    assert observer.staging_keys(), "the interrupted upload left nothing staged: the fault came too late"

    own_s3.start()  # the store is back on the same port
    assert stack.api.get("/health").status_code == 200
    deadline = time.monotonic() + 60
    while observer.staging_keys():
        assert time.monotonic() < deadline, f"staged objects never removed: {observer.staging_keys()}"
        time.sleep(0.5)
    assert observer.list_ids() == []
    assert "staged object(s) older than" in stack.worker.log.read_text(errors="replace")
