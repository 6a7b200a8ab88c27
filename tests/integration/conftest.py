"""Fleets shared across integration modules: an engine cold start costs 15-25 s on two cores, so a module
whose tests need an ordinary fleet uses this session's one instead of starting its own.

``shared_fleet``: two real vLLM engines (quorum one, restarts on) and a weight source, started when a test
first asks for ``.fleet`` or ``.source``: test_controller, test_serve and test_stage_ahead (which stages its
refits with ``sync_weights(..., stage_ahead=True)``). The test order puts the tests that use it next to each
other (``tests/conftest.py``), and it is shut down as soon as the next test does not use it: its idle engines
and controller would otherwise cost CPU through every later module. A module that uses it starts from
whatever version the fleet serves and leaves it serving or restarting (``Run.heal`` waits for every slot to
serve again). Its event log is on disk, so a controller Ray restarts keeps its predecessor's records (the
invariants read them); updates move in 0.1 MB buckets (the tiny model in ~18: a fault at bucket 2 lands
mid-stream).
"""

from __future__ import annotations

import pytest

SHARED = "shared_fleet"


class SharedFleet:
    """The session's shared fleet, started on first use, closed by ``close`` (and started again if asked)."""

    def __init__(self, tiny_model: str, log_dir) -> None:
        self._model, self._log_dir = tiny_model, log_dir
        self._fleet = self._source = None

    def _start(self) -> None:
        from faults.source import WeightSource
        from fleet import ray_io
        from fleet.api import Fleet

        self._fleet = Fleet.start({"engine": {"model": self._model, "kv_cache_memory_bytes": 32 << 20},
                                   "num_engines": 2, "min_healthy_engines": 1, "name": "shared",
                                   "event_log_path": str(self._log_dir / "events.jsonl"),
                                   "request_timeout_s": 120, "refit_timeout_s": 60,  # held requests fit a refit
                                   "lifecycle_grace_s": 5, "bucket_mb": 0.1, "restart_backoff_s": 0.5,
                                   "restart_budget": 5})
        self._source = ray_io.spawn_actor(WeightSource, self._model, num_cpus=0)

    @property
    def fleet(self):
        if self._fleet is None:
            self._start()
        return self._fleet

    @property
    def source(self):
        if self._source is None:
            self._start()
        return self._source

    def close(self) -> None:
        from fleet import ray_io

        if self._fleet is not None:
            self._fleet.shutdown()
            ray_io.kill(self._source)
            self._fleet = self._source = None


_HOLDER: list[SharedFleet] = []


@pytest.fixture(scope="session")
def shared_fleet(ray_local, tiny_model, tmp_path_factory):
    holder = SharedFleet(tiny_model, tmp_path_factory.mktemp("shared-fleet"))
    _HOLDER.append(holder)
    try:
        yield holder
    finally:
        holder.close()
        _HOLDER.remove(holder)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last of a run of tests that use the shared fleet (their module fixtures torn down first)."""
    if _HOLDER and SHARED in item.fixturenames and (nextitem is None or SHARED not in nextitem.fixturenames):
        _HOLDER[0].close()
