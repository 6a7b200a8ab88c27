"""Fleets shared across integration modules: an engine cold start costs 15-25 s on two cores, so a module
whose tests need an ordinary fleet uses this session's one instead of starting its own.

``shared_fleet``: two real vLLM engines (quorum one), a weight source, started on first use and shut down
at the end of the session. A module that uses it starts from whatever version the fleet serves and leaves
it serving (a test that kills a shard waits for its restart before it ends).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def shared_fleet(ray_local, tiny_model):
    from faults.source import WeightSource
    from fleet import ray_io
    from fleet.api import Fleet

    fleet = Fleet.start({"engine": {"model": tiny_model}, "num_engines": 2, "min_healthy_engines": 1,
                         "name": "shared", "request_timeout_s": 120,
                         "refit_timeout_s": 60})  # requests held across a refit fit its budget
    source = ray_io.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    try:
        yield SimpleNamespace(fleet=fleet, source=source)
    finally:
        fleet.shutdown()
        ray_io.kill(source)
