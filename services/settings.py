"""Service settings: the converter, API and worker fields, on top of the runtime's.

`ServiceSettings(RuntimeSettings)` reads the same `KILN_*` variables (and `.env`). Embedded defaults
need no external service: SQLite under `data_dir`, a local artifact directory, and jobs run
in-process. Outside development, default secrets are refused (the database password here, the S3
secret in `RuntimeSettings`).

`get_settings()` is the one way services read them: the process's one settings object (shared with
the runtime code in the same process, see runtime/settings.py). Library code takes the object as a
parameter; entry points (CLI commands, the API factory, the worker) call `get_settings()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from runtime.settings import DEFAULT_SECRETS, RuntimeSettings, process_settings


class ServiceSettings(RuntimeSettings):
    # --- storage and metadata -------------------------------------------------------------
    data_dir: Path = Path("./var")
    database_url: str = ""  # empty: sqlite:///{data_dir}/kiln.db
    store_url: str = ""  # empty: local directory {data_dir}/artifacts; or s3://bucket/prefix

    # --- S3 store (the client's endpoint, credentials and retries are in RuntimeSettings) ------
    s3_multipart_chunk_mb: int = 16
    s3_max_concurrency: int = 4
    # Artifact download URLs (GET /v1/artifacts/{id}) are bearer capabilities: they keep working
    # after the token that fetched them is revoked, until they expire.
    presigned_url_ttl_s: int = Field(default=300, gt=0)
    # Buckets a request may name as s3:// sources besides the store's ("*": any; services/sources.py).
    source_buckets: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # --- broker / worker ----------------------------------------------------------------------
    broker_url: str = ""  # empty: jobs run in a worker thread inside `kiln api` (embedded mode)
    max_job_attempts: int = 3
    # Every worker: Celery's soft time limit; the embedded worker's threads check it between layers.
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
    token_cache_s: float = 2.0  # a valid token is looked up once per this long; revocation lag
    api_threads: int = Field(default=4, ge=1)  # threadpool of sync routes, per API process

    # --- converter ------------------------------------------------------------------------------
    disabled_kernels: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("disabled_kernels", "cors_origins", "source_buckets", mode="before")
    @classmethod
    def _split_csv(cls, v: object) -> object:
        if isinstance(v, str):
            return [item.strip() for item in v.split(",") if item.strip()]
        return v

    def default_secret_offenders(self) -> list[str]:
        password = urlsplit(self.database_url).password if self.database_url else None
        own = ["the password in KILN_DATABASE_URL"] if password in DEFAULT_SECRETS else []
        return own + super().default_secret_offenders()

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'kiln.db').resolve()}"

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or str((self.data_dir / "artifacts").resolve())


def get_settings() -> ServiceSettings:
    """The process's one settings object (built from the environment on first use)."""
    return process_settings(ServiceSettings)
