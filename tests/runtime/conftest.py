"""Tiny random artifacts (written once per session by devtools/builders/tiny_artifacts.py), shared by
the runtime tests (model, engine, loader, pull, server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact


def _build(tmp_path_factory: pytest.TempPathFactory, arch: str, **kw: object) -> tuple[PreTrainedModel, Path]:
    model = tiny_hf_model(arch)
    return model, write_artifact(model, tmp_path_factory.mktemp(f"artifact-{arch}"), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def llama_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """(HF reference model, artifact dir): Llama with llama3 rope scaling, GQA 4/2 heads."""
    return _build(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen2_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """Qwen2 (qkv bias)."""
    return _build(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """SmolLM2-like Llama with tied embeddings and no lm_head tensor."""
    return _build(tmp_path_factory, "smollm2")


@pytest.fixture(scope="session")
def mistral_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """Mistral (sliding_window 256, wider than the tests' contexts)."""
    return _build(tmp_path_factory, "mistral")
