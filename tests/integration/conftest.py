"""Fleets shared across integration modules: an engine cold start costs 15-25 s on two cores, so a module
whose tests need an ordinary fleet uses this session's one instead of starting its own.

``shared_fleet``: two real vLLM engines (quorum one, restarts on), a weight source, started on first use and
shut down at the end of the session: test_controller, test_serve and test_stage_ahead (which stages its refits
with ``sync_weights(..., stage_ahead=True)``). A module that uses it starts from whatever version the fleet
serves and leaves it serving or restarting (``Run.heal`` waits for every slot to serve again). Its event
log is on disk, so a controller Ray restarts keeps its predecessor's records (the invariants read them);
updates move in 0.1 MB buckets (the tiny model in ~18: a fault at bucket 2 lands mid-stream).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def shared_fleet(ray_local, tiny_model, tmp_path_factory):
    from faults.source import WeightSource
    from fleet import ray_io
    from fleet.api import Fleet

    fleet = Fleet.start({"engine": {"model": tiny_model, "kv_cache_memory_bytes": 32 << 20},
                         "num_engines": 2, "min_healthy_engines": 1, "name": "shared",
                         "event_log_path": str(tmp_path_factory.mktemp("shared-fleet") / "events.jsonl"),
                         "request_timeout_s": 120, "refit_timeout_s": 60,  # requests held across a refit fit it
                         "lifecycle_grace_s": 5, "bucket_mb": 0.1, "restart_backoff_s": 0.5, "restart_budget": 5})
    source = ray_io.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    try:
        yield SimpleNamespace(fleet=fleet, source=source)
    finally:
        fleet.shutdown()
        ray_io.kill(source)
