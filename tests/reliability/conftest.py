"""The real-stack fixtures of tests/services (PostgreSQL, Redis, S3, Celery, uvicorn) for the
fault tests here (tests/reliability/test_faults_*.py)."""

from tests.runtime.conftest import llama_artifact  # noqa: F401
from tests.services.conftest import (  # noqa: F401  (pytest fixtures, used by name)
    celery_worker,
    clean_db,
    make_stack,
    pg_url,
    redis_url,
    serve_app,
    services_env,
    tiny_checkpoint,
)
