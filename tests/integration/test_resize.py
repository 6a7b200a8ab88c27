"""``Fleet.resize`` on real Ray actors: shards with the null backend (no vLLM: each request takes
``null_generate_s``, so requests really are in flight), client threads submitting without pause while
the fleet grows by one and shrinks by one. Nothing is lost, the new engine serves, the removed one is
drained (it finishes what it held and admits nothing more) and its actor is gone.

One fleet for the module (~10 s). The real-engine version, with a refit between the two resizes, is the
fault matrix's ``resize-under-load``.
"""

from __future__ import annotations

import time

import pytest

from rlfleet.faults.load import ClientLoad
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.errors import ConfigError
from rlfleet.fleet.cluster.naming import shard_name
from tests.integration.fleet_helpers import assert_invariants, wait_for
from rlfleet.fleet.records import Resize, Stopped

pytestmark = [pytest.mark.integration, pytest.mark.quick]  # null engines: seconds, in the quick lane

GENERATE_S = 1.0  # every request is in flight this long on its null engine
PROMPT, SAMPLING = [1, 2, 3], {"max_tokens": 1}


@pytest.fixture(scope="module")
def fleet(ray_local, tiny_model):
    f = Fleet.start({"engine": {"model": tiny_model, "backend": "null", "num_cpus": 0, "null_generate_s": GENERATE_S},
                     "num_engines": 2, "min_healthy_engines": 2, "metrics": False, "admission": {"enabled": False},
                     "probe_timeout_s": 5.0})
    yield f
    f.shutdown()


def test_a_bad_size_is_refused_and_the_fleet_keeps_serving(fleet):
    for n in (1, 0, 2.5, "3"):
        with pytest.raises(ConfigError) as err:
            fleet.resize(n)
        assert err.value.field == "n"
    assert fleet.status()["target_size"] == 2
    assert all(r.ok for g in fleet.generate([PROMPT] * 2) for r in g)


def test_grow_and_shrink_under_load_lose_nothing_and_drain_the_removed_engine(fleet):
    before = fleet.status()["requests"]
    load = ClientLoad(fleet, 6, PROMPT, SAMPLING)
    time.sleep(1.5)
    grown = fleet.resize(3)
    assert grown["added"] == [2] and grown["size_from"] == 2 and fleet.status()["target_size"] == 3
    assert grown["serving"] == [0, 1, 2]  # at the checkpoint version a new engine serves once started
    wait_for(lambda: load.completed_on(2) >= 3, 30, 0.2, "requests served by the new engine")
    # slot 2 (all serve: the highest) will be removed: shrink while it holds requests
    wait_for(lambda: fleet.shard_counters()[2]["in_flight"] >= 2, 30, 0.05, "requests in flight on slot 2")
    shrunk = fleet.resize(2)
    results = load.end(60)
    after = fleet.status()["requests"]

    assert shrunk["removed"] == [2] and shrunk["serving"] == [0, 1] and fleet.status()["target_size"] == 2
    row = shrunk["drained"]["2"]
    assert row["in_flight_at_removal"] >= 2 and row["finished"] == row["in_flight_at_removal"], row
    assert row["aborted"] == 0 and row["drained"] and row["shutdown"] == "ok", row
    assert row["admitted_at_end"] == row["admitted_at_removal"], row  # nothing admitted once removed
    assert row["drain_s"] <= GENERATE_S + 2.0, row

    accepted = after["accepted"] - before["accepted"]
    assert accepted == len(results) and all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert after["completed"] - before["completed"] == accepted and after["in_progress"] == 0  # nothing lost
    assert {r.result.slot for r in results} == {0, 1, 2}

    slot2 = next(s for s in fleet.status()["ledger"]["slots"] if s["slot"] == 2)
    assert slot2["state"] == "retired" and slot2["removed"] and "removed by a resize" in slot2["reason"]
    wait_for(lambda: ray_door.find_actor(shard_name(fleet.name, 2, 1)) is None, 30, 0.2, "slot 2's actor gone")
    ends = [e for e in fleet.events(kinds=[Resize]) if e["edge"] == "end"]
    assert [(e["size_from"], e["size_to"], e["added"], e["removed"]) for e in ends] == [(2, 3, [2], []), (3, 2, [], [2])]
    assert not fleet.events(kinds=[Stopped])
    assert_invariants(fleet)
