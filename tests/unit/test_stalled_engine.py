"""A stuck engine core under a live shard actor (issue 29, hole 0): liveness means progress.

The shard answers every ping, but its answer carries progress facts (``health.progress``). The
controller's monitor treats "work held, no token for longer than ``stall_timeout_s``" as a hung
probe: the shard is evicted after ``unhealthy_threshold`` such answers, within
``stall_detection_bound_s``, and restarted. A shard whose engine core does not answer the ping's
core check (an idle frozen core) answers ``DeadlineExceeded``: hung, evicted likewise. Fakes and
virtual time; the real engine's proof is the fault matrix's ``freeze-engine-*`` variants.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.errors import ConfigError, DeadlineExceeded
from rlfleet.fleet.config.fleet import load_fleet_config
from tests.unit.fleet_fakes import run_virtual
from tests.unit.test_controller import make
from rlfleet.fleet.records import Kill


def stalled(seconds: float, in_flight: int = 2) -> dict:
    return {"in_flight": in_flight, "stalled_s": seconds, "last_token_age_s": seconds, "held": None}


async def wait_for(cond, seconds: float, step: float = 0.1) -> float:
    t = 0.0
    while not cond() and t < seconds:
        await asyncio.sleep(step)
        t += step
    return t


def kills(ctl, slot):
    return [e for e in Kill.among(ctl.log.records()) if e.slot == slot]


def test_a_shard_whose_engine_makes_no_progress_is_evicted_within_the_bound_and_restarted(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, stall_timeout_s=5.0, monitor_interval_s=0.5, probe_interval_s=0.5)
        await ctl.start()
        t0 = asyncio.get_running_loop().time()
        door.shards[(1, 1)].progress = stalled(6.0)  # answers every ping; its engine core makes no step
        await wait_for(lambda: kills(ctl, 1), 30.0)
        found = asyncio.get_running_loop().time() - t0
        kill = kills(ctl, 1)
        assert kill and kill[0].incarnation == 1 and "evicted" in kill[0].reason
        assert "no progress" in kill[0].reason and "2 request(s) in flight" in kill[0].reason
        assert found <= ctl.cfg.hang_detection_bound_s  # the stall itself was already past stall_timeout_s
        assert door.shards[(1, 1)].dead
        await wait_for(lambda: ctl.handles[1][0] == 2, 10.0)
        assert ctl.handles[1][0] == 2  # restarted
        for s in (0, 2):
            assert not door.shards[(s, 1)].dead and ctl.ledger.state(s).value == "healthy"
        assert ctl.gate.is_open  # quorum 2 of 3 held throughout
        await ctl.shutdown()

    run_virtual(go())


def test_an_engine_stalled_below_the_bound_or_idle_or_held_is_left_alone(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, stall_timeout_s=5.0, monitor_interval_s=0.5)
        await ctl.start()
        door.shards[(0, 1)].progress = stalled(4.9)
        door.shards[(1, 1)].progress = {**stalled(600.0), "held": "worker_rpc"}  # core busy in a bounded call
        door.shards[(2, 1)].progress = stalled(600.0, in_flight=0)
        await asyncio.sleep(20.0)
        assert not any(kills(ctl, s) for s in range(3))
        assert all(ctl.ledger.state(s).value == "healthy" for s in range(3))
        await ctl.shutdown()

    run_virtual(go())


def test_a_shard_whose_idle_engine_core_does_not_answer_its_ping_is_evicted(model_dir):
    """The ping's core check missed its bound: the shard answers ``DeadlineExceeded``, a hung probe."""
    async def go():
        ctl, door, _ = make(model_dir, monitor_interval_s=0.5, probe_interval_s=0.5)
        await ctl.start()
        door.shards[(2, 1)].ping_raises = DeadlineExceeded("core check on shard slot 2 (incarnation 1) did not "
                                                           "finish within 1.0 s")
        await wait_for(lambda: kills(ctl, 2), 30.0)
        kill = kills(ctl, 2)
        assert kill and "core check" in kill[0].reason and "evicted" in kill[0].reason
        await ctl.shutdown()

    run_virtual(go())


def test_the_stall_bound_is_validated_and_its_detection_bound_reported(model_dir):
    base = {"engine": {"model": model_dir}}
    assert load_fleet_config(base).stall_timeout_s == 30.0
    cfg = load_fleet_config({**base, "stall_timeout_s": 5.0})
    assert cfg.stall_detection_bound_s == pytest.approx(5.0 + cfg.hang_detection_bound_s)
    for bad in (0, -1.0, float("inf"), float("nan"), "soon"):
        with pytest.raises(ConfigError, match="stall_timeout_s"):
            load_fleet_config({**base, "stall_timeout_s": bad})
    with pytest.raises(ConfigError, match="core_check_timeout_s"):
        load_fleet_config({**base, "engine": {"model": model_dir, "core_check_timeout_s": 0}})


def test_a_probe_answered_without_a_core_check_neither_clears_nor_condemns_and_is_asked_again(model_dir):
    """A shard whose core runs a bounded worker call (a transfer's ``rlfleet_leave`` into a frozen core) answers
    its ping without asking the core (``core_checked: False``): that says nothing of the core. Seen on a real
    engine: such an answer returned a frozen-core shard to healthy, and the next refit's pause hung on it."""
    async def go():
        ctl, door, _ = make(model_dir, monitor_interval_s=0.5, probe_interval_s=0.5, unhealthy_threshold=2)
        await ctl.start()
        shard = door.shards[(0, 1)]
        shard.ping_raises = DeadlineExceeded("core check (is_paused) on shard slot 0 (incarnation 1) did not finish "
                                             "within 1.0 s")
        await wait_for(lambda: ctl.ledger.state(0).value == "hung", 10.0)
        assert ctl.ledger.state(0).value == "hung"
        shard.ping_raises, shard.core_checked = None, False  # a worker call holds its core: the ping skips the check
        await asyncio.sleep(3.0)
        assert ctl.ledger.state(0).value == "hung" and not kills(ctl, 0)  # not cleared, not condemned on it
        shard.ping_raises = DeadlineExceeded("core check (is_paused) on shard slot 0 (incarnation 1) did not finish "
                                             "within 1.0 s")  # the worker call ended: the core is asked, and fails
        await wait_for(lambda: kills(ctl, 0), 10.0)
        assert kills(ctl, 0) and "core check" in kills(ctl, 0)[0].reason
        await ctl.shutdown()

    run_virtual(go())
