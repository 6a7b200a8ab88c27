"""``SingleController.resize`` (``fleet.control.resize``) on fakes, in virtual time: grow, shrink under load with
nothing lost, the drain bound, refits and resizes never interleaving, validation before anything
changes, and a restarted controller re-adopting the resized fleet."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.errors import ConfigError, FleetStopped
from rlfleet.fleet.control.intent import Intent
from rlfleet.fleet.cluster.naming import intent_key, shard_name
from rlfleet.fleet.outcome import DIED, Outcome
from rlfleet.health import CallKind
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual
from rlfleet.fleet.records import Kill, Phase, Resize, Stopped, all_of
from rlfleet.fleet.wire import Left


def make(model_dir, door=None, **over):
    cfg = dict(engine={"model": model_dir}, num_engines=3, min_healthy_engines=2, name="rs", refit_timeout_s=0.3,
               lifecycle_grace_s=0.1, probe_timeout_s=0.1, suspect_timeout_s=0.3, unhealthy_threshold=2,
               restart_backoff_s=0.0, restart_backoff_cap_s=0.0, metrics=False, request_timeout_s=30.0)
    cfg.update(over)
    door = door or FakeDoor()
    return SingleController(cfg, door=door, transfer=FakeTransfer(door), clock=LoopClock()), door


def members(ctl):
    return sorted(m.slot for m in ctl.publisher.current.members)


def resizes(ctl, edge="end"):
    return [e for e in ctl.events() if Resize.matches(e) and e["edge"] == edge]


def stored(door, name="rs") -> Intent:
    return Intent.from_json(door.kv[intent_key(name)])


async def load(ctl, n, prompt=(1, 2)):
    return [asyncio.ensure_future(client(ctl).generate(list(prompt), {"max_tokens": 2})) for _ in range(n)]


def accounted(ctl, n):
    c = client(ctl).dispatcher.counters()
    assert c["accepted"] == n and c["completed"] == n and c["returned"] == 0 and c["in_progress"] == 0, c


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("n", [1, 0, -2, 2.5, "4", True, None])
def test_a_bad_size_is_refused_naming_n_and_min_healthy_before_anything_changes(model_dir, n):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        before = (ctl.ledger.to_dict(), dict(door.kv), len(door.shards), ctl.publisher.current.epoch)
        with pytest.raises(ConfigError) as err:
            await ctl.resize(n)
        assert err.value.field == "n" and ("min_healthy_engines=2" in str(err.value) or "integer >= 1" in str(err.value))
        assert (ctl.ledger.to_dict(), dict(door.kv), len(door.shards), ctl.publisher.current.epoch) == before
        assert ctl.gate.is_open and resizes(ctl, "begin") == []
        with pytest.raises(ConfigError, match="drain_timeout_s"):
            await ctl.resize(2, drain_timeout_s=-1)
        await ctl.shutdown()

    run_virtual(go())


def test_below_min_healthy_the_error_names_both(model_dir):
    async def go():
        ctl, _ = make(model_dir)
        await ctl.start()
        with pytest.raises(ConfigError, match=r"n=1 is below min_healthy_engines=2"):
            await ctl.resize(1)
        await ctl.shutdown()

    run_virtual(go())


def test_a_stopped_fleet_refuses_a_resize(model_dir):
    async def go():
        ctl, _ = make(model_dir)
        await ctl.start()
        ctl.halt("stopped for the test")
        with pytest.raises(FleetStopped, match="stopped for the test"):
            await ctl.resize(4)

    run_virtual(go())


def test_resizing_to_the_size_it_has_changes_nothing(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        writes, epoch = ctl.intent.writes, ctl.publisher.current.epoch
        summary = await ctl.resize(3)
        assert summary["added"] == [] and summary["removed"] == [] and summary["size_to"] == 3
        assert ctl.intent.writes == writes and ctl.publisher.current.epoch == epoch and resizes(ctl, "begin") == []
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ grow
def test_grown_at_the_checkpoint_a_new_engine_serves_once_started(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        summary = await ctl.resize(5)
        assert summary["added"] == [3, 4] and summary["size_from"] == 3 and summary["size_to"] == 5
        assert members(ctl) == [0, 1, 2, 3, 4] and ctl.status()["target_size"] == 5
        assert [s.gate.member for s in (door.shards[(3, 1)], door.shards[(4, 1)])] == [True, True]  # told first
        assert stored(door).slots[4] == (1, 0) and door.shards[(4, 1)].name == shard_name("rs", 4, 1)
        results = await asyncio.gather(*await load(ctl, 40))
        assert {r.result.slot for r in results} >= {3, 4}
        [end] = resizes(ctl)
        assert end["added"] == [3, 4] and end["removed"] == [] and end["size_from"] == 3
        await ctl.shutdown()

    run_virtual(go())


def test_grown_after_a_refit_a_new_engine_is_stale_until_the_next_refit_lands(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(1)
        await ctl.resize(4)
        assert ctl.ledger.state(3).value == "stale" and members(ctl) == [0, 1, 2]
        summary = await ctl.sync_weights(2)
        assert summary["complete"] == [0, 1, 2, 3] and members(ctl) == [0, 1, 2, 3]
        assert door.shards[(3, 1)].version == 2
        await ctl.shutdown()

    run_virtual(go())


def test_a_new_engine_that_fails_to_start_is_restarted_within_its_budget(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.on_spawn[(3, 1)] = {"start": "error"}
        await ctl.resize(4)
        for _ in range(50):
            if ctl.ledger.state(3).value == "healthy":
                break
            await asyncio.sleep(0.1)
        assert ctl.ledger.raw(3).incarnation == 2 and ctl.ledger.raw(3).restarts == 1
        assert door.shards[(3, 1)].dead
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ shrink
def test_a_shrink_under_load_drains_the_removed_engine_and_loses_nothing(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.gen_delay = 0.5
        reqs = await load(ctl, 30)
        await asyncio.sleep(0.1)  # every request is running on some shard
        busy = door.shards[(2, 1)]
        held = sum(1 for v in busy.in_flight.values() if v is not None)
        assert held > 0
        t0 = asyncio.get_running_loop().time()
        summary = await ctl.resize(2)
        reqs += await load(ctl, 10)  # sent after the shrink: none reaches slot 2
        results = await asyncio.gather(*reqs)
        accounted(ctl, 40)
        assert summary["removed"] == [2] and members(ctl) == [0, 1]
        row = summary["drained"]["2"]
        assert row["in_flight_at_removal"] == held and row["finished"] == held and row["aborted"] == 0
        assert row["drained"] and row["admitted_at_end"] == row["admitted_at_removal"]
        assert asyncio.get_running_loop().time() - t0 >= 0.3  # it waited for them
        assert sum(1 for r in results if r.result.slot == 2) == held  # what it held finished there
        assert busy.dead and 2 not in ctl.handles and ("shutdown", 2, 1) in door.calls
        rec = ctl.ledger.record(2)
        assert rec.state.value == "retired" and rec.removed and "removed by a resize" in rec.reason
        assert stored(door).removed == {2: 1} and 2 not in stored(door).slots and ctl.status()["target_size"] == 2
        assert not any(Stopped.matches(e) for e in ctl.events()) and ctl.gate.is_open
        await ctl.shutdown()

    run_virtual(go())


def test_requests_still_running_at_the_drain_bound_are_aborted_and_sent_again(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.gen_delay = 5.0
        reqs = await load(ctl, 12)
        await asyncio.sleep(0.1)
        held = sum(1 for v in door.shards[(2, 1)].in_flight.values() if v is not None)
        summary = await ctl.resize(2, drain_timeout_s=1.0)
        row = summary["drained"]["2"]
        assert held and row["aborted"] == held and row["finished"] == 0 and 1.0 <= row["drain_s"] < 2.0
        results = await asyncio.gather(*reqs)
        accounted(ctl, 12)
        assert all(r.result.slot in (0, 1) for r in results)  # the aborted ones were re-sent
        await ctl.shutdown()

    run_virtual(go())


def test_an_engine_a_cut_resize_was_still_draining_is_retired_by_the_reconcile(model_dir):
    """Issue 48: the reconcile is level-triggered. A shrink whose call was cancelled mid-drain (its caller gave up)
    leaves the removed engine running, held by nobody's drain; the next step kills it and lets it go, and what
    it held is re-sent: nothing is lost."""
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.gen_delay = 5.0
        reqs = await load(ctl, 12)
        await asyncio.sleep(0.1)
        assert any(v is not None for v in door.shards[(2, 1)].in_flight.values())
        shrink = asyncio.ensure_future(ctl.resize(2, drain_timeout_s=600.0))
        await asyncio.sleep(1.0)
        assert 2 in ctl.ledger.removed_slots() and 2 in ctl.handles  # draining: the engine is still there
        shrink.cancel()
        await asyncio.sleep(1.0)
        assert door.shards[(2, 1)].dead and 2 not in ctl.handles, ctl.handles
        [kill] = [e for e in Kill.among(ctl.events()) if e.slot == 2]
        assert "retired by the reconcile" in kill.reason
        await asyncio.gather(*reqs)
        accounted(ctl, 12)
        await ctl.shutdown()

    run_virtual(go())


def test_a_shrink_removes_a_restarting_slot_first_and_cancels_its_restart(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_backoff_s=5.0, restart_backoff_cap_s=5.0)
        await ctl.start()
        door.shards[(0, 1)].dead = True
        await asyncio.sleep(2.0)  # the monitor finds it dead; its restart is due in 5 s
        assert ctl.ledger.state(0).value == "dead"
        summary = await ctl.resize(2)
        assert summary["removed"] == [0] and summary["drained"]["0"]["drained"] is False
        await asyncio.sleep(10.0)
        assert ctl.ledger.raw(0).incarnation == 1 and (0, 2) not in door.shards  # never restarted
        assert members(ctl) == [1, 2]
        await ctl.shutdown()

    run_virtual(go())


def test_a_grow_then_a_shrink_keep_the_new_slot_numbers(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        await ctl.resize(4)
        await ctl.resize(3)
        assert members(ctl) == [0, 1, 2] and ctl.ledger.num_slots == 4 and ctl.ledger.target_size == 3
        await ctl.resize(4)  # a grow appends a new slot; a removed one never comes back
        assert members(ctl) == [0, 1, 2, 4] and ctl.ledger.record(3).removed
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ never interleaved with a refit
def test_a_resize_waits_for_a_running_refit_and_a_refit_for_a_resize(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.gen_delay = 0.4
        reqs = await load(ctl, 9)
        await asyncio.sleep(0.05)
        refit = asyncio.ensure_future(ctl.sync_weights(1))
        await asyncio.sleep(0)
        shrink = asyncio.ensure_future(ctl.resize(2))
        await asyncio.sleep(0)
        refit2 = asyncio.ensure_future(ctl.sync_weights(2))
        await asyncio.gather(refit, shrink, refit2, *reqs)
        marks = [(type(e), getattr(e, "version", None), e.edge) for e in all_of(ctl.events())
                 if isinstance(e, Resize) or (isinstance(e, Phase) and (e.phase, e.edge) in
                                              (("close", "begin"), ("reopen", "end")))]
        assert marks == [(Phase, 1, "begin"), (Phase, 1, "end"), (Resize, None, "begin"),
                         (Resize, None, "end"), (Phase, 2, "begin"), (Phase, 2, "end")]
        accounted(ctl, 9)
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ a restarted controller
def successor(ctl, door):
    for task in list(ctl._tasks):
        task.cancel()
    door.was_restarted = True
    return SingleController(ctl.cfg.model_dump() | {"num_engines": 3}, door=door, transfer=FakeTransfer(door),
                            clock=LoopClock())


def test_a_restarted_controller_re_adopts_the_resized_fleet(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        await ctl.resize(5)  # slots 3, 4 added
        await ctl.sync_weights(1)
        await ctl.resize(4)  # slot 4 removed
        new = successor(ctl, door)  # built from the config it started with (3 engines), as Ray rebuilds it
        await new.ping()
        assert new.ledger.num_slots == 5 and new.ledger.target_size == 4 and new.config()["num_engines"] == 4 == new.status()["target_size"]
        assert new.ledger.record(4).removed and new.ledger.state(4).value == "retired"
        assert new.recovered["serving"] == [0, 1, 2, 3] and members(new) == [0, 1, 2, 3]
        assert (await new.resize(4))["added"] == []  # a re-sent resize is a no-op
        summary = await new.sync_weights(2)
        assert summary["complete"] == [0, 1, 2, 3]
        await new.shutdown()

    run_virtual(go())


def test_an_engine_a_dead_controller_was_draining_is_fenced_by_its_successor(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.gen_delay = 5.0
        reqs = await load(ctl, 9)
        await asyncio.sleep(0.1)
        shrink = asyncio.ensure_future(ctl.resize(2))
        await asyncio.sleep(1.0)  # mid-drain: the controller's process dies here
        assert stored(door).removed == {2: 1} and not door.shards[(2, 1)].dead
        shrink.cancel()
        new = successor(ctl, door)
        client(ctl)._ctl = new  # the client follows the restarted controller (as a FleetClient does)
        await new.ping()
        assert door.shards[(2, 1)].dead and [2, 1] in new.recovered["fenced"]
        assert new.ledger.record(2).removed and members(new) == [0, 1]
        results = await asyncio.gather(*reqs)  # what it ran is re-sent and completes on the others
        assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
        assert {r.result.slot for r in results} == {0, 1} and max(r.attempts for r in results) == 2
        await new.shutdown()

    run_virtual(go())


def test_the_intent_keeps_the_removed_slots_and_reads_an_older_one_without_them():
    intent = Intent("f", {}, slots={0: (1, 0), 1: (2, 1), 3: (1, 0)}, removed={2: 3})
    assert Intent.from_json(intent.to_json()) == intent
    older = intent.to_json().replace('"removed": {"2": 3}, ', "")
    assert '"removed"' not in older and Intent.from_json(older).removed == {}


def test_a_shard_notes_what_it_held_as_it_left_the_serving_set_and_admits_nothing_after(model_dir):
    from rlfleet.fleet.errors import RouteRefused
    from rlfleet.fleet.data.routing_state import Ticket, VersionPolicy
    from rlfleet.fleet.shard.engine_shard import EngineShard

    async def go():
        shard = EngineShard({"model": model_dir, "backend": "null", "null_generate_s": 5.0}, 3, 1)
        await shard.start()
        shard.set_route(7, True, 0)
        ticket = Ticket(7, VersionPolicy("any"))
        running = [asyncio.ensure_future(shard.generate([1, 2], request_id=f"r{i}", ticket=ticket)) for i in range(2)]
        await asyncio.sleep(0.1)
        assert shard.counters().left is None
        shard.set_route(9, False, 0)  # removed: it holds two requests
        assert shard.counters().left == Left(in_flight=2, admitted=2, epoch=9)
        with pytest.raises(RouteRefused):
            await shard.generate([1, 2], request_id="late", ticket=Ticket(9, VersionPolicy("any")))
        shard.set_route(10, False, 0)  # told again (the publisher, then the drain): the note stays
        done = await asyncio.gather(*running)
        assert all(not r.aborted for r in done)
        c = shard.counters()
        assert c.in_flight == 0 and c.admitted == 2 and c.left is not None and c.left.epoch == 9 and c.refused["not_member"] == 1
        await shard.abort_in_flight()  # nothing left: the null backend's abort ends only what runs
        await shard.shutdown()

    run_virtual(go())


def test_with_warm_spares_a_resize_sizes_the_serving_set_and_the_spares_stay(model_dir):
    async def go():
        ctl, door = make(model_dir, num_engines=2, spare_engines=1)
        await ctl.start()
        assert members(ctl) == [0, 1] and ctl.ledger.num_slots == 3
        await ctl.sync_weights(1)
        grown = await ctl.resize(3)  # the healthy spare serves at once; the new engine is stale
        assert grown["added"] == [3] and members(ctl) == [0, 1, 2] and ctl.ledger.state(3).value == "stale"
        await ctl.sync_weights(2)  # the new engine holds the weights: the new spare
        assert members(ctl) == [0, 1, 2] and ctl.ledger.state(3).value == "healthy" and ctl.status()["target_size"] == 3
        reqs = await load(ctl, 12)
        shrunk = await ctl.resize(2)
        await asyncio.gather(*reqs)
        accounted(ctl, 12)
        assert len(shrunk["removed"]) == 1 and len(members(ctl)) == 2 and ctl.ledger.target_size == 3  # 2 + 1 spare
        spares = [s for s in range(ctl.ledger.num_slots) if not ctl.ledger.raw(s).removed and s not in members(ctl)]
        assert len(spares) == 1 and ctl.ledger.state(spares[0]).value == "healthy"
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ slots retired by failures
async def retire(ctl, door, slot):
    """Kill ``slot``'s engine in a fleet with no restart budget: the slot is retired by the failure."""
    door.kill(door.shards[(slot, ctl.handles[slot][0])])
    ctl.observe(slot, ctl.handles[slot][0], CallKind.GENERATE, Outcome(DIED, error=RuntimeError("killed")))
    assert ctl.ledger.state(slot).value == "retired" and not ctl.ledger.raw(slot).removed
    await ctl.publisher.publish()


def test_a_resize_to_the_target_size_replaces_a_slot_retired_by_a_failure(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_budget=0)
        await ctl.start()
        await retire(ctl, door, 1)
        assert members(ctl) == [0, 2] and ctl.status()["target_size"] == 3  # below its size, and it stays there
        await asyncio.sleep(30)  # the monitor does not replace it on its own (the budget's verdict holds)
        assert ctl.ledger.num_slots == 3 and members(ctl) == [0, 2]
        summary = await ctl.resize(3)
        assert summary["added"] == [3] and summary["removed"] == [1] and summary["retired"] == [1]
        assert members(ctl) == [0, 2, 3] and ctl.ledger.target_size == 3 and ctl.ledger.raw(1).removed
        assert stored(door).removed == {1: 1} and 3 in stored(door).slots and 1 not in stored(door).slots
        assert (await ctl.resize(3))["added"] == []  # now the fleet has its size: a re-sent resize is a no-op
        await ctl.shutdown()

    run_virtual(go())


def test_a_grow_counts_retired_slots_as_missing(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_budget=0)
        await ctl.start()
        await ctl.sync_weights(1)
        await retire(ctl, door, 0)
        summary = await ctl.resize(4)
        assert summary["added"] == [3, 4] and summary["retired"] == [0] and summary["size_from"] == 3
        assert ctl.ledger.target_size == 4 and [ctl.ledger.state(s).value for s in (3, 4)] == ["stale", "stale"]
        await ctl.sync_weights(2)
        assert members(ctl) == [1, 2, 3, 4] and len(ctl.serving_slots()) == 4
        await ctl.shutdown()

    run_virtual(go())


def test_a_shrink_takes_the_retired_slot_first_and_adds_nothing(model_dir):
    async def go():
        ctl, door = make(model_dir, num_engines=4, restart_budget=0)
        await ctl.start()
        await retire(ctl, door, 1)
        summary = await ctl.resize(3)  # three engines serve already: the retired slot is dropped, none added
        assert summary["added"] == [] and summary["removed"] == summary["retired"] == [1] and members(ctl) == [0, 2, 3]
        assert ctl.ledger.target_size == 3
        await ctl.shutdown()

    run_virtual(go())


def test_a_replaced_slot_stays_removed_for_a_restarted_controller(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_budget=0)
        await ctl.start()
        await retire(ctl, door, 2)
        await ctl.resize(3)
        new = successor(ctl, door)
        await new.ping()
        assert new.ledger.target_size == 3 and new.ledger.raw(2).removed and new.config()["num_engines"] == 3 == new.status()["target_size"]
        assert members(new) == [0, 1, 3] and (await new.resize(3))["added"] == []
        await new.shutdown()

    run_virtual(go())
