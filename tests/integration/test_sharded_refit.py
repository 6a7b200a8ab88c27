"""A sharded refit through the whole lifecycle on the session's shared fleet (two real vLLM-CPU engines): two
trainer ranks, each holding dim-0 shards of every tensor (``WeightSource`` stands in for an FSDP rank), send each
engine worker its rows point to point (``refit.sharded_sync``); no rank gathers the model. And the sender's
fault: a rank that dies mid-send is the trainer's failure, rolled back with no engine changed.
"""

from __future__ import annotations

import pytest

from rlfleet.faults.source import WeightSource
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.errors import RefitArgumentError, RefitSourceFailed
from rlfleet.fleet.records import Transfer
from rlfleet.refit.sharded_sync import ShardedSource
from tests.integration.fleet_helpers import Run, assert_invariants, logprob_gap

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(shared_fleet, tiny_model):
    r = Run(shared_fleet.fleet, shared_fleet.source)
    r.version = shared_fleet.fleet.status()["version"]  # the shared fleet's, whichever module ran before
    r.heal()
    ranks = [ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0) for _ in range(2)]
    yield r, ranks
    for h in ranks:
        ray_door.kill(h)


def perturb(ranks, seed: int) -> None:
    for h in ranks:  # every rank holds the same trained weights; each sends only its own rows
        ray_door.ask(h, "perturb", seed, 0.02, timeout=60)


def test_two_trainer_ranks_refit_the_fleet_point_to_point_through_the_lifecycle(run):
    r, ranks = run
    perturb(ranks, 501)
    v = r.fleet.status()["version"] + 1
    summary = r.fleet.sync_weights(v, ShardedSource(ranks))
    assert summary["complete"] == [0, 1] and summary["attempts"] == 1, summary
    sent = [t for t in Transfer.among(r.fleet.events()) if t.version == v]
    assert len(sent) == 1 and sent[0].bytes > 0 and sent[0].sharded and sent[0].sharded_refused is None
    assert not sent[0].sharded_group_reused  # the fleet's first sharded refit from these ranks builds the group
    perturb(ranks, 503)
    v += 1
    assert r.fleet.sync_weights(v, ShardedSource(ranks))["complete"] == [0, 1]
    again = [t for t in Transfer.among(r.fleet.events()) if t.version == v]
    assert len(again) == 1 and again[0].sharded and again[0].sharded_group_reused  # the next one reuses it
    results = [x for g in r.fleet.generate([[1, 9, 8, 7]] * 4, n=2, sampling={"max_tokens": 12, "seed": 5}) for x in g]
    assert all(x.ok and x.result.weight_version == v for x in results)
    gap = logprob_gap(ranks[0], results)  # the engines hold the ranks' weights (the second update), rows from both
    assert gap < 1e-4, gap
    with pytest.raises(RefitArgumentError, match=r"ShardedSource needs .* rank\(s\) \[1\] are not"):
        r.fleet.sync_weights(v + 1, ShardedSource((ranks[0], "not an actor")))
    assert r.fleet.status()["version"] == v
    assert_invariants(r.fleet)


def test_a_trainer_rank_that_dies_mid_send_is_the_senders_failure_and_no_engine_changes(run, tiny_model):
    r, ranks = run
    before = r.fleet.status()["version"]
    perturb(ranks, 502)
    ray_door.ask(ranks[1], "die_at_next_send", timeout=30)
    with pytest.raises(RefitSourceFailed, match=r"weight sender ShardedSource.* is dead: it failed before the update "
                                                r"reached any engine's weights"):
        r.fleet.sync_weights(before + 1, ShardedSource(ranks))
    status = r.fleet.status()
    assert status["gate_open"] and status["version"] == before and sorted(status["serving"]) == [0, 1]
    results = [x for g in r.fleet.generate([[1, 9, 8, 7]] * 2, n=1, sampling={"max_tokens": 4}) for x in g]
    assert all(x.ok and x.result.weight_version == before for x in results)
    ranks[1] = ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0)  # the rank restarted: the update lands
    perturb(ranks, 502)
    assert r.fleet.sync_weights(before + 1, ShardedSource(ranks))["complete"] == [0, 1]
    assert_invariants(r.fleet)
