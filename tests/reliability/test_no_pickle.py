"""Security: nothing Kiln loads is unpickled (safetensors and JSON only)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "runtime", "services", "bench", "tests")
UNSAFE = (
    re.compile(r"^\s*(import pickle|from pickle import|import cloudpickle|import dill)", re.M),
    re.compile(r"\bpickle\.loads?\("),
    re.compile(r"weights_only\s*=\s*False"),
    # torch.distributed's object collectives pickle and unpickle what peers send
    re.compile(r"\b(broadcast|all_gather|gather|scatter|send|recv)_object(_list)?\("),
)


def _python_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if p != Path(__file__)]


def test_no_unpickling_in_the_code() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {pattern.pattern}"
        for path in _python_files()
        for pattern in UNSAFE
        if pattern.search(path.read_text())
    ]
    assert not offenders, offenders


def test_every_torch_load_is_weights_only() -> None:
    for path in _python_files():
        for call in re.finditer(r"torch\.load\(([^)]*)\)", path.read_text()):
            assert "weights_only=True" in call.group(1), f"{path.relative_to(REPO)}: {call.group(0)}"


def test_celery_accepts_json_only() -> None:
    from services.settings import ServiceSettings as Settings
    from services.worker.celery_app import make_celery

    app = make_celery(Settings())
    assert app.conf.accept_content == ["json"] and app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"
