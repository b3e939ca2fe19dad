"""The one Settings object: env parsing and refusal of default secrets outside development."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.settings import ServiceSettings as Settings


def test_development_accepts_compose_defaults() -> None:
    s = Settings(environment="development", database_url="postgresql+psycopg://kiln:kiln@db/kiln")
    assert s.resolved_database_url.endswith("@db/kiln")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("database_url", "postgresql+psycopg://kiln:kiln@db/kiln", "KILN_DATABASE_URL"),
        ("s3_secret_access_key", "minioadmin", "KILN_S3_SECRET_ACCESS_KEY"),
    ],
)
def test_production_refuses_default_secrets(field: str, value: str, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        Settings(environment="production", **{field: value})


def test_production_accepts_real_secrets() -> None:
    s = Settings(
        environment="production",
        database_url="postgresql+psycopg://kiln:Zq8-real@db/kiln",
        s3_secret_access_key="a-real-secret",
    )
    assert s.environment == "production"


def test_csv_lists_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DISABLED_KERNELS", "marlin_wna16, cpu_int4")
    monkeypatch.setenv("KILN_CORS_ORIGINS", "http://127.0.0.1:3000")
    s = Settings()
    assert s.disabled_kernels == ["marlin_wna16", "cpu_int4"]
    assert s.cors_origins == ["http://127.0.0.1:3000"]


def test_embedded_defaults_need_no_services(tmp_path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.resolved_database_url.startswith("sqlite:///")
    assert s.resolved_store_url == str((tmp_path / "artifacts").resolve())
    assert s.broker_url == ""
