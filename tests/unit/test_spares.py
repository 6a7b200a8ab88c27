"""Warm spares on the controller (``spare_engines``; ``fleet.control.slots`` rebalances over ``health.roles``), driven by fakes.

A spare starts with the fleet, takes part in every refit and serves nothing; when a
serving engine fails, a healthy spare is promoted at once (one ``promote`` record, the
routing state published with it) and the failed slot's restart becomes the new spare.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.errors import ConfigError
from rlfleet.fleet.config.fleet import load_fleet_config
from rlfleet.fleet.control.intent import Intent
from rlfleet.fleet.cluster.naming import intent_key
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual
from rlfleet.fleet.records import Gate, Promote, Restart

RESTART_S = 5.0  # how long the killed slot's replacement takes to start (virtual seconds)


def config(model_dir, **over):
    cfg = dict(engine={"model": model_dir}, num_engines=2, min_healthy_engines=2, spare_engines=1, name="sparefleet",
               refit_timeout_s=0.3, lifecycle_grace_s=0.1, probe_timeout_s=0.1, suspect_timeout_s=0.3,
               unhealthy_threshold=2, restart_backoff_s=0.0, restart_backoff_cap_s=0.0, metrics=False)
    cfg.update(over)
    return cfg


async def started(model_dir, slow_restarts=(), **over):
    """A started fleet; a replacement of a slot in ``slow_restarts`` takes ``RESTART_S`` to start."""
    door = FakeDoor()
    real_start = door._start

    async def start(shard):
        if shard.slot in slow_restarts and shard.incarnation > 1:
            await asyncio.sleep(RESTART_S)
        return await real_start(shard)

    door._start = start
    ctl = SingleController(config(model_dir, **over), door=door, transfer=FakeTransfer(door), clock=LoopClock())
    await ctl.start()
    return ctl, door


def members(ctl):
    return sorted(m.slot for m in ctl.publisher.current.members)


def roles(ctl):
    return {row["slot"]: row["role"] for row in ctl.status()["ledger"]["slots"]}


def records(ctl, kind):
    return kind.among(ctl.events())


async def served_slots(ctl, n=24):
    res = await asyncio.gather(*(client(ctl).generate([1]) for _ in range(n)))
    assert all(r.ok for r in res), [r.reason for r in res if not r.ok]
    return {r.result.slot for r in res}


def test_spares_start_with_the_fleet_take_part_in_refits_and_serve_nothing(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        assert sorted(door.shards) == [(0, 1), (1, 1), (2, 1)]  # num_engines + spare_engines engines
        assert roles(ctl) == {0: "serving", 1: "serving", 2: "spare"}
        summary = await ctl.sync_weights(1)
        assert summary["complete"] == [0, 1, 2] and door.shards[(2, 1)].version == 1  # the spare is refitted
        assert summary["serving"] == [0, 1] and ctl.status()["serving"] == [0, 1]
        assert members(ctl) == [0, 1]
        assert await served_slots(ctl) == {0, 1}
        assert not door.shards[(2, 1)].gate.member  # the spare's own gate refuses traffic
        assert records(ctl, Promote) == []
        await ctl.shutdown()

    run_virtual(go())


def test_a_serving_engine_killed_between_refits_is_replaced_by_the_spare_before_its_restart_ends(model_dir):
    async def go():
        ctl, door = await started(model_dir, slow_restarts=(0,), readmit=False)
        await ctl.sync_weights(1)
        await ctl.kill_shard(0)
        await asyncio.sleep(1.5)  # the monitor finds it dead; its restart is under way
        (promo,) = records(ctl, Promote)
        # the replaced slot as the ledger has it now: its next incarnation, restarting
        assert (promo.slot, promo.incarnation, promo.replaced, promo.replaced_incarnation) == (2, 1, 0, 2)
        assert promo.reason == "slot 0 is restarting" and promo.serving == [1, 2]
        assert members(ctl) == [1, 2] and ctl.gate.is_open  # full capacity, the gate never closed (min 2)
        assert not [g for g in records(ctl, Gate) if not g.open and g.t >= promo.t]
        assert not [r for r in records(ctl, Restart) if r.edge == "end"]  # the restart still runs
        assert await served_slots(ctl) == {1, 2}
        assert roles(ctl) == {0: "spare", 1: "serving", 2: "serving"}
        await asyncio.sleep(RESTART_S + 1)
        assert ctl.ledger.state(0).value == "stale"  # restarted: the new spare, on no weights yet
        await ctl.sync_weights(2)
        assert ctl.ledger.state(0).value == "healthy" and roles(ctl)[0] == "spare" and members(ctl) == [1, 2]
        assert len(records(ctl, Promote)) == 1  # no flapping back
        await ctl.shutdown()

    run_virtual(go())


def test_a_spare_that_dies_is_restarted_and_stays_a_spare(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.sync_weights(1)
        await ctl.kill_shard(2)
        await asyncio.sleep(1.5)
        assert ctl.handles[2][0] == 2 and roles(ctl)[2] == "spare"
        assert records(ctl, Promote) == [] and members(ctl) == [0, 1] and ctl.gate.is_open
        await ctl.sync_weights(2)
        assert ctl.ledger.state(2).value == "healthy" and members(ctl) == [0, 1]
        await ctl.shutdown()

    run_virtual(go())


def test_a_spare_not_on_the_committed_version_is_not_promoted_until_a_refit_lands_on_it(model_dir):
    async def go():
        ctl, door = await started(model_dir, slow_restarts=(0,), min_healthy_engines=1, restart_budget=5, readmit=False)
        await ctl.sync_weights(1)
        await ctl.kill_shard(2)  # the spare dies: it comes back stale
        await asyncio.sleep(1.5)
        assert ctl.ledger.state(2).value == "stale"
        await ctl.kill_shard(0)  # a serving slot dies while the only spare is stale
        await asyncio.sleep(1.5)
        assert records(ctl, Promote) == [] and members(ctl) == [1]  # never stale weights
        assert ctl.ledger.state(0).value == "restarting"
        await ctl.sync_weights(2)  # slot 0 is still restarting: the refit lands on the spare, which is promoted
        (promo,) = records(ctl, Promote)
        assert (promo.slot, promo.replaced) == (2, 0) and "restarting" in promo.reason
        assert members(ctl) == [1, 2]
        await asyncio.sleep(RESTART_S)
        assert roles(ctl)[0] == "spare"
        await ctl.shutdown()

    run_virtual(go())


def test_a_promotion_is_stored_in_the_intent_before_routing_follows_it(model_dir):
    async def go():
        ctl, door = await started(model_dir, slow_restarts=(0,))
        await ctl.sync_weights(1)
        stored = Intent.from_json(door.kv[intent_key("sparefleet")])
        assert stored.serving_roles == (0, 1) and sorted(stored.slots) == [0, 1, 2]
        await ctl.kill_shard(0)
        await asyncio.sleep(1.5)
        assert Intent.from_json(door.kv[intent_key("sparefleet")]).serving_roles == (1, 2)
        await ctl.shutdown()

    run_virtual(go())


def test_the_serving_size_is_num_engines_and_quorum_is_checked_against_it(model_dir):
    cfg = load_fleet_config({"engine": {"model": model_dir}, "num_engines": 2, "spare_engines": 1, "min_healthy_engines": 2})
    assert cfg.total_engines == 3 and cfg.health_config().num_engines == 3
    with pytest.raises(ConfigError, match="min_healthy_engines"):  # spares do not count towards the serving size
        load_fleet_config({"engine": {"model": model_dir}, "num_engines": 2, "spare_engines": 1, "min_healthy_engines": 3})
    with pytest.raises(ConfigError, match="spare_engines"):
        load_fleet_config({"engine": {"model": model_dir}, "num_engines": 2, "spare_engines": -1})


# ---------------------------------------------------------------------------------- a restarted controller
def successor(ctl, door):
    """Ray rebuilt the controller (same config, same door): its process died, its tasks with it."""
    for task in list(ctl._tasks):
        task.cancel()
    door.was_restarted = True
    return SingleController(ctl.cfg.model_dump(), door=door, transfer=FakeTransfer(door), clock=LoopClock())


def test_roles_survive_a_controller_restart(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.sync_weights(1)
        await ctl.kill_shard(0)
        await asyncio.sleep(1.5)
        await ctl.sync_weights(2)  # slot 0 restarted: a healthy spare now, like every slot
        assert roles(ctl) == {0: "spare", 1: "serving", 2: "serving"} and members(ctl) == [1, 2]
        new = successor(ctl, door)
        st = await new.watch_routing(-1, 0.1)  # the first call re-adopts
        assert new.recovered["roles"] == [1, 2] and roles(new) == {0: "spare", 1: "serving", 2: "serving"}
        assert sorted(m.slot for m in st.members) == [1, 2] and st.gate_open
        assert not door.shards[(0, 2)].gate.member  # the spare stays out of routing
        assert Promote.among(new.events()) == []  # restored, not promoted anew
        assert await served_slots(new) == {1, 2}
        assert (await new.sync_weights(3))["serving"] == [1, 2]
        await new.shutdown()

    run_virtual(go())


def test_a_successor_keeps_the_promoted_spare_serving_while_the_replaced_slot_restarts(model_dir):
    async def go():
        ctl, door = await started(model_dir, slow_restarts=(1,), readmit=False)
        await ctl.sync_weights(1)
        await ctl.kill_shard(1)
        await asyncio.sleep(1.5)  # promoted: 0 and 2 serve, 1 restarts
        assert members(ctl) == [0, 2]
        new = successor(ctl, door)  # dies with slot 1's restart under way
        st = await new.watch_routing(-1, 0.1)
        assert sorted(m.slot for m in st.members) == [0, 2] and st.gate_open and roles(new)[1] == "spare"
        assert Promote.among(new.events()) == []  # the stored roles already had the spare serving
        await asyncio.sleep(RESTART_S + 1)
        assert new.ledger.state(1).value == "stale" and roles(new)[1] == "spare"
        await new.shutdown()

    run_virtual(go())


def test_an_intent_stored_without_roles_restores_the_first_slots_as_serving(model_dir):
    stored = Intent("f", {}, slots={0: (1, 0), 1: (1, 0), 2: (1, 0)})
    again = Intent.from_json(stored.to_json())
    assert again.serving_roles is None
    assert Intent.from_json(stored.replace(serving_roles=(1, 2)).to_json()).serving_roles == (1, 2)
