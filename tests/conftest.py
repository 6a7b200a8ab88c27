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


_EXIT = {"status": None}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


def pytest_unconfigure(config):
    """Leave without running interpreter teardown once the report is written.

    The transport tests abandon torch.distributed (gloo) groups on purpose (a frozen or
    killed receiver mid-transfer). At interpreter exit Python joins their worker
    threads and destroys the groups, and gloo can throw from a C++ destructor
    ("terminate called after throwing gloo::IoException"), turning a green run into
    exit code 134 after the last test passed. Every fixture has finished (Ray is shut
    down) before this hook, so nothing is lost by exiting here with pytest's own status.
    """
    import sys

    if _EXIT["status"] is not None and os.environ.get("RLFLEET_PYTEST_HARD_EXIT", "1") == "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])
