"""Shared fixtures. Other test files may add fixtures here."""
from __future__ import annotations

from pathlib import Path

import pytest

from ringserve.tools.tiny_llama import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA 4/2, vocab 384) in an HF-layout folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the cache folder
    (`make test` fetches it before pytest runs)."""
    from ringserve.gpu.model_store import resolve_model
    return resolve_model(None)
