"""Shared fixtures: a tiny model built once per session, repo paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised ~0.2M-param byte-level LLaMA saved to disk (fast for integration tests)."""
    from steadyrl.tasks import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128
    )
