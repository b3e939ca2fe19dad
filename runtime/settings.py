"""The one Settings object for every Kiln process (runtime, converter, API, worker).

Values come from `KILN_*` environment variables (or a `.env` file). Embedded defaults need no
external service: SQLite under `data_dir`, a local artifact directory, and jobs run in-process.
Outside development, default secrets are refused.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Development credentials shipped in docker-compose.yml / MinIO defaults: refused outside development.
DEFAULT_SECRETS = frozenset({"change-me", "changethis", "kiln", "kiln-secret", "minioadmin", "postgres"})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"

    # --- storage and metadata -------------------------------------------------------------
    data_dir: Path = Path("./var")
    database_url: str = ""  # empty: sqlite:///{data_dir}/kiln.db
    store_url: str = ""  # empty: local directory {data_dir}/artifacts; or s3://bucket/prefix
    cache_dir: Path = Path("~/.cache/kiln").expanduser()  # pulled artifacts on serving nodes

    # --- S3 ---------------------------------------------------------------------------------
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_multipart_chunk_mb: int = 16
    s3_max_concurrency: int = 4
    s3_max_attempts: int = 5
    presigned_url_ttl_s: int = 3600

    # --- broker / worker ----------------------------------------------------------------------
    broker_url: str = ""  # empty: jobs run in a worker thread inside `kiln api` (embedded mode)
    max_job_attempts: int = 3
    job_soft_time_limit_s: int = 3 * 3600
    job_hard_time_limit_s: int = 3 * 3600 + 600
    broker_visibility_timeout_s: int = 4 * 3600
    broker_restore_interval_s: int | None = None  # kombu's unacked_restore_interval (None: its default)
    celery_queue: str = "kiln"
    job_heartbeat_s: float = 5.0  # a running job touches its row this often
    job_stale_after_s: float = 120.0  # reconciler: running job with no heartbeat for this long is orphaned
    reconcile_interval_s: float = 60.0  # 0 disables the reconciler thread in `kiln worker`
    progress_write_interval_s: float = 1.0  # throttle for progress writes to SQL
    job_retry_backoff_s: float = 5.0  # first backoff on transient S3/DB errors (doubles per attempt)
    # Test / demo aid, a real code path: sleep this long between layers (in the cancellation check)
    # so that tests can kill or cancel a conversion mid-flight. 0 in production.
    convert_layer_delay_s: float = 0.0

    # --- API --------------------------------------------------------------------------------
    max_request_bytes: int = 1 << 20
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    api_page_size_max: int = 200
    # Conversions of server-local paths over the API: None = allowed in development/test only.
    allow_local_sources: bool | None = None
    embedded_workers: int = 1  # worker threads inside `kiln api` when broker_url is empty

    # --- kernels / runtime --------------------------------------------------------------------
    disabled_kernels: Annotated[list[str], NoDecode] = Field(default_factory=list)
    num_threads: int = 0  # 0: torch default
    serve_max_request_bytes: int = Field(default=8 << 20, gt=0)  # `kiln serve` bodies over this: 413

    @field_validator("disabled_kernels", "cors_origins", mode="before")
    @classmethod
    def _split_csv(cls, v: object) -> object:
        if isinstance(v, str):
            return [item.strip() for item in v.split(",") if item.strip()]
        return v

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> Settings:
        """Outside development, the development credentials of docker-compose.yml are refused."""
        if self.environment == "development":
            return self
        password = urlsplit(self.database_url).password if self.database_url else None
        offenders = []
        if password in DEFAULT_SECRETS:
            offenders.append("the password in KILN_DATABASE_URL")
        if self.s3_secret_access_key in DEFAULT_SECRETS:
            offenders.append("KILN_S3_SECRET_ACCESS_KEY")
        if offenders:
            raise ValueError(
                f"{' and '.join(offenders)} is a default development secret; set a real one "
                f"(KILN_ENVIRONMENT={self.environment} refuses default secrets)"
            )
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'kiln.db').resolve()}"

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or str((self.data_dir / "artifacts").resolve())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
