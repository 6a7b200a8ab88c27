"""Shared fixtures: the tiny model (built once per machine) and one local Ray per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

MODEL_CACHE = Path(os.environ.get("RLFLEET_MODEL_CACHE", Path.home() / ".cache" / "rlfleet" / "models"))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from fleet.tinymodel import build_model

    return str(build_model(MODEL_CACHE / "tiny", preset="tiny", seed=0))


@pytest.fixture(scope="session")
def ray_local():
    """One Ray for the whole session (starting Ray costs seconds; engines are per module)."""
    from fleet import ray_io

    ray_io.init_local(num_cpus=8, log_to_driver=False)
    yield
    ray_io.shutdown()
