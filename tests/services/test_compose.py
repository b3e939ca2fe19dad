"""docker-compose.yml validates with Debian's docker-compose (v1.29) and wires the stack in order."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.services.conftest import REPO

EXPECTED_SERVICES = {"minio", "minio-init", "redis", "postgres", "migrate", "api", "worker", "runtime"}


@pytest.fixture(scope="module")
def compose() -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose)")
    out = subprocess.run(
        [exe, "-f", "docker-compose.yml", "config"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_config_is_valid_and_complete(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == EXPECTED_SERVICES
    for name in ("minio", "redis", "postgres", "api", "worker", "runtime"):
        assert "healthcheck" in services[name], name


def test_compose_start_order(compose: dict) -> None:
    deps = {name: svc.get("depends_on", {}) for name, svc in compose["services"].items()}
    assert deps["minio-init"]["minio"]["condition"] == "service_healthy"
    assert deps["migrate"]["postgres"]["condition"] == "service_healthy"
    for svc in ("api", "worker"):
        assert deps[svc]["migrate"]["condition"] == "service_completed_successfully"
        assert deps[svc]["minio-init"]["condition"] == "service_completed_successfully"
        assert deps[svc]["redis"]["condition"] == "service_healthy"
    assert compose["services"]["migrate"]["command"] == ["kiln", "db", "upgrade"]
    assert "kiln serve" in " ".join(compose["services"]["runtime"]["command"])
