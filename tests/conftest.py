"""Shared fixtures: the tiny model (built once per machine) and one local Ray per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Every engine a shard builds during the run appends a record here (``fleet.shard.start_records``): Ray's
# workers and the CLI processes the tests start inherit the variable. The count is printed at the end.
if not os.environ.get("RLFLEET_START_RECORDS"):
    import tempfile

    os.environ["RLFLEET_START_RECORDS"] = os.path.join(tempfile.mkdtemp(prefix="rlfleet-starts-"), "starts.jsonl")


_ORDER = ("/tests/unit/", "/tests/integration/", "/tests/faults/")  # what runs first: cheap failures first


def _rank(item) -> int:
    path = str(item.fspath).replace(os.sep, "/")
    return next((i for i, part in enumerate(_ORDER) if part in path), len(_ORDER))


def pytest_collection_modifyitems(config, items):
    """The run's order: unit tests (seconds, no Ray), then integration tests, then the fault matrix and the
    soak (pytest alone would collect ``tests/faults`` first, alphabetically). Unit tests are all in the quick
    lane (``scripts/test.sh --quick``); integration modules join it with ``pytestmark = pytest.mark.quick``
    when they cost seconds (no vLLM engine)."""
    # stable: each folder keeps pytest's own order, but the integration tests that use the session's shared
    # fleet run together, then those that use its raw pair of shards, so each is shut down after the last
    # of its users (tests/integration/conftest.py)
    def shared(item) -> int:
        names = getattr(item, "fixturenames", ())
        return 0 if "shared_fleet" in names else 1 if "raw_pair" in names else 2

    items.sort(key=lambda item: (_rank(item), shared(item)))
    quick = pytest.mark.quick
    for item in items:
        if _rank(item) == 0:
            item.add_marker(quick)


_WINDOWS: list[tuple[float, str]] = []  # (wall time a test began, its module): starts are charged to modules


def pytest_runtest_logstart(nodeid, location):
    import time

    _WINDOWS.append((time.time(), nodeid.split("::", 1)[0]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The engine starts this run cost, from the shards' own start records (``fleet.shard.start_records``), in
    all and by the test module running when each began (a module's fixtures' starts are its own)."""
    from rlfleet.fleet.shard.start_records import by_window, read_starts, summarize

    records = read_starts(os.environ["RLFLEET_START_RECORDS"])
    terminalreporter.write_sep("=", summarize(records))
    for module, line in by_window(records, _WINDOWS):
        terminalreporter.write_line(f"  {module}: {line}")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from rlfleet.recipe.tinymodel import build_model, default_model_dir

    return str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def ray_local():
    """One Ray for the whole session (starting Ray costs seconds; engines are per module)."""
    from rlfleet.fleet.cluster import ray_door

    ray_door.init_local(num_cpus=8, log_to_driver=False)
    yield
    ray_door.shutdown()


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
