"""Shared fixtures: the tiny model (built once per machine) and one local Ray per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from recipe.tinymodel import build_model, default_model_dir

    return str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def ray_local():
    """One Ray for the whole session (starting Ray costs seconds; engines are per module)."""
    from fleet import ray_io

    ray_io.init_local(num_cpus=8, log_to_driver=False)
    yield
    ray_io.shutdown()
