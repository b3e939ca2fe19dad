"""Runtime settings: what `kiln pull`, `kiln serve` and the engine read from `KILN_*` variables.

`RuntimeSettings` holds only the fields runtime code reads (the artifact cache, the S3 client used
by `pull`, threads, the serve body limit). The converter, API and worker extend it in
`services/settings.py` (`ServiceSettings(RuntimeSettings)`): same `KILN_*` variables, same `.env`.

A process has one settings object. `get_settings()` returns it: built on first use, or the one a
services entry point already built (`process_settings(ServiceSettings)`; a `ServiceSettings` is a
`RuntimeSettings`, so runtime code in a services process reads that same object).
Outside development, default secrets are refused.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.body_limit import BODY_IDLE_TIMEOUT_S, BODY_TIMEOUT_S

CpuActDtype = Literal["auto", "float32", "bfloat16"]

# Development credentials shipped in docker-compose.yml / MinIO defaults: refused outside development.
DEFAULT_SECRETS = frozenset({"change-me", "changethis", "kiln", "kiln-secret", "minioadmin", "postgres"})


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"

    cache_dir: Path = Path("~/.cache/kiln").expanduser()  # pulled artifacts on serving nodes

    # --- S3 client (artifact pulls; the services' stores use the same credentials) ---------------
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_max_attempts: int = 5

    # --- serving ---------------------------------------------------------------------------------
    num_threads: int = 0  # 0: torch default
    # CPU activation dtype: "auto" is bf16 where the CPU multiplies bf16 natively and every layer's
    # kernel prefers it, else fp32 (runtime/loader.py compute_dtype); the others force one (bf16 on
    # a CPU without native bf16 is emulated: slower, but the same numbers as a bf16 machine's)
    cpu_act_dtype: CpuActDtype = "auto"
    # the decode step: "native" (the device's fast step: on CPU runtime/native_decode.py, on CUDA the
    # step captured in CUDA graphs, runtime/cuda_graph_decode.py; models neither covers decode eagerly)
    # or "eager" (torch ops from Python: the reference)
    decode_step: Literal["native", "eager"] = "native"
    # native step: how long its threads spin for the next step before they sleep
    decode_spin_us: int = Field(default=2000, ge=0, le=1_000_000)
    serve_max_request_bytes: int = Field(default=8 << 20, gt=0)  # `kiln serve` bodies over this: 413
    # Both servers (`kiln serve`, `kiln api`): a request body must arrive whole within this many
    # seconds, with no pause over the idle timeout; else 408 and the connection is closed.
    request_body_timeout_s: float = Field(default=BODY_TIMEOUT_S, gt=0)
    request_body_idle_timeout_s: float = Field(default=BODY_IDLE_TIMEOUT_S, gt=0)
    # `kiln serve --api-key`: clients send `Authorization: Bearer <key>` (all but health/metrics/version)
    api_key: SecretStr | None = None

    def default_secret_offenders(self) -> list[str]:
        """The variables holding a default development secret (subclasses add their own)."""
        return ["KILN_S3_SECRET_ACCESS_KEY"] if self.s3_secret_access_key in DEFAULT_SECRETS else []

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> RuntimeSettings:
        """Outside development, the development credentials of docker-compose.yml are refused."""
        if self.environment == "development":
            return self
        offenders = self.default_secret_offenders()
        if offenders:
            raise ValueError(
                f"{' and '.join(offenders)} is a default development secret; set a real one "
                f"(KILN_ENVIRONMENT={self.environment} refuses default secrets)"
            )
        return self


SettingsT = TypeVar("SettingsT", bound=RuntimeSettings)

_lock = threading.Lock()
_current: RuntimeSettings | None = None


def process_settings(cls: type[SettingsT]) -> SettingsT:
    """The process's one settings object, as an instance of `cls` (built from the environment on
    first use). A services process asks for `ServiceSettings` first; should runtime code have built
    a plain `RuntimeSettings` before, it is replaced by the richer object (same environment)."""
    global _current
    with _lock:
        if not isinstance(_current, cls):
            _current = cls()
        return _current


def get_settings() -> RuntimeSettings:
    """The settings runtime code reads (the process's one object; see the module docstring)."""
    return process_settings(RuntimeSettings)
