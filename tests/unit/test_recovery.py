"""A restarted controller re-adopts its shards (``fleet.control.recovery``), driven by fakes.

The "crash" freezes the world where the controller's process would have died: the
stored intent is what was written up to that point, the shards keep whatever state
they had (paused, dirty weights, stamped versions), and the dead controller's own
tasks stop. A second controller, built with the same config on the same door as Ray
would rebuild it, then re-adopts. Each test checks what the successor found and that
the trainer's next ``sync_weights`` succeeds.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.control.intent import CLOSING, COMMITTED, Intent
from rlfleet.fleet.cluster.naming import intent_key, shard_name
from rlfleet.fleet.control.recovery import EPOCHS_PER_GENERATION
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual
from rlfleet.fleet.records import Adopted, ControllerRestarted, Error, Request, all_of


class Crash(BaseException):
    """The controller's process died here (not an Exception: nothing in the lifecycle handles it)."""


def config(model_dir, **over):
    cfg = dict(engine={"model": model_dir}, num_engines=3, min_healthy_engines=2, name="testfleet",
               refit_timeout_s=0.3, lifecycle_grace_s=0.1, probe_timeout_s=0.1, suspect_timeout_s=0.3,
               unhealthy_threshold=2, restart_backoff_s=0.0, restart_backoff_cap_s=0.0, metrics=False)
    cfg.update(over)
    return cfg


async def started(model_dir, **over):
    door = FakeDoor()
    ctl = SingleController(config(model_dir, **over), door=door, transfer=FakeTransfer(door), clock=LoopClock())
    await ctl.start()
    return ctl, door


def arm(ctl, door, point):
    """Make ``ctl`` die at ``point``: what the store holds then is all a successor will read."""
    frozen = {}

    def crash_point(where):
        if where == point:
            frozen.update(door.kv)
            raise Crash(point)

    ctl.crash_point = crash_point
    return frozen


def bury(ctl, door, frozen):
    """The process is gone: its tasks stop, and writes made while unwinding never happened."""
    for task in list(ctl._tasks):
        task.cancel()
    door.kv.clear()
    door.kv.update(frozen)


def successor(ctl, door):
    door.was_restarted = True
    return SingleController(ctl.cfg.model_dump(), door=door, transfer=FakeTransfer(door), clock=LoopClock())


async def crash_in_refit(model_dir, point):
    ctl, door = await started(model_dir)
    await ctl.sync_weights(1)
    frozen = arm(ctl, door, point)
    with pytest.raises(Crash):
        await ctl.sync_weights(2)
    bury(ctl, door, frozen)
    new = successor(ctl, door)
    await new.ping()  # the first call re-adopts
    return new, door


def stored(door) -> Intent:
    return Intent.from_json(door.kv[intent_key("testfleet")])


def test_intent_is_stored_before_the_refit_acts(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        seen = []
        real = door.kv_put

        def spy(key, value):
            seen.append(Intent.from_json(value))
            real(key, value)

        door.kv_put = spy
        await ctl.sync_weights(1)
        phases = [(i.refit.version, i.refit.phase) if i.refit else None for i in seen]
        assert phases == [(1, "closing"), (1, "committed")]  # two writes per committed refit
        assert seen[1].committed == 1 and seen[1].refit.complete == ((0, 1), (1, 1), (2, 1))
        assert stored(door).committed == 1 and stored(door).membership_epoch == ctl.plan.epoch
        await ctl.shutdown()
        assert intent_key("testfleet") not in door.kv  # a finished shutdown leaves nothing to re-adopt

    run_virtual(go())


def test_killed_between_refits_the_successor_serves_on_and_refits(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.sync_weights(1)
        old_epoch = ctl.publisher.current.epoch
        bury(ctl, door, dict(door.kv))
        new = successor(ctl, door)
        st = await new.watch_routing(-1, 0.1)  # a client's long poll is what wakes it
        assert new.generation == 1 and new.recovered["serving"] == [0, 1, 2]
        assert st.gate_open and st.version == 1 and st.epoch > old_epoch and st.epoch > EPOCHS_PER_GENERATION
        assert sorted(m.slot for m in st.members) == [0, 1, 2]
        # every shard was taken out of routing and back in at the new generation's epoch
        assert all(s.gate.member and s.gate.floor > EPOCHS_PER_GENERATION for s in door.shards.values())
        res = await client(new).generate([1, 2, 3])
        assert res.ok and res.result.weight_version == 1
        summary = await new.sync_weights(2)
        assert summary["complete"] == [0, 1, 2] and new.gate.is_open and new.gate.version == 2
        assert stored(door).generation == 1
        kinds = [type(r) for r in all_of(new.events())]
        assert kinds.index(ControllerRestarted) < kinds.index(Adopted)
        await new.shutdown()

    run_virtual(go())


def test_killed_before_the_transfer_moved_anything_resumes_on_the_committed_version(model_dir):
    async def go():
        new, door = await crash_in_refit(model_dir, "transfer")
        assert new.recovered["refit"] == [2, CLOSING] and new.recovered["serving"] == [0, 1, 2]
        assert not any(s.paused for s in door.shards.values())
        assert new.gate.is_open and new.gate.version == 1
        assert (await new.sync_weights(2))["complete"] == [0, 1, 2]

    run_virtual(go())


def test_killed_after_the_transfer_before_the_commit_keeps_the_gate_closed_until_the_next_refit(model_dir):
    async def go():
        new, door = await crash_in_refit(model_dir, "commit")  # weights moved (dirty), commit not stored
        assert new.recovered["serving"] == [] and new.recovered["stale"] == [0, 1, 2]
        assert not new.gate.is_open and new.stopped is None
        assert all(not s.paused for s in door.shards.values())  # resumed, but not members: nothing served
        assert not any(s.gate.member for s in door.shards.values())
        summary = await new.sync_weights(2)  # the trainer re-sends: every engine gets version 2
        assert summary["complete"] == [0, 1, 2] and new.gate.is_open and new.gate.version == 2

    run_virtual(go())


def test_killed_after_the_commit_finishes_it_and_the_resent_refit_returns_its_summary(model_dir):
    async def go():
        new, door = await crash_in_refit(model_dir, "resume")
        assert new.recovered["refit"] == [2, COMMITTED] and new.recovered["serving"] == [0, 1, 2]
        assert new.gate.is_open and new.gate.version == 2
        again = await new.sync_weights(2)  # Fleet.sync_weights re-sends the call the dead controller held
        assert again["recovered"] and again["version"] == 2
        assert (await new.sync_weights(3))["complete"] == [0, 1, 2]

    run_virtual(go())


def test_a_committed_refit_is_stamped_by_the_successor_on_the_engines_it_listed(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        frozen = arm(ctl, door, "resume")  # the commit is stored, then the process dies before stamping any engine
        with pytest.raises(Crash):
            await ctl.sync_weights(1)
        bury(ctl, door, frozen)
        assert all(s.dirty and s.version == 0 for s in door.shards.values())
        new = successor(ctl, door)
        await new.ping()
        assert new.recovered["stamped"] == [0, 1, 2] and new.recovered["serving"] == [0, 1, 2]
        assert all(s.version == 1 and not s.dirty for s in door.shards.values())
        assert new.gate.is_open and new.gate.version == 1

    run_virtual(go())


def test_a_missing_shard_is_restarted_and_a_stray_incarnation_is_fenced(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        bury(ctl, door, dict(door.kv))
        door.shards[(1, 1)].dead = True  # died with the controller
        stray = door.spawn_shard(None, 2, 2, name=shard_name("testfleet", 2, 2))  # spawned, never recorded
        new = successor(ctl, door)
        await new.ping()
        assert stray.dead and new.recovered["fenced"] == [[2, 2]]
        assert new.recovered["missing"] == [1] and new.recovered["serving"] == [0, 2]
        assert new.gate.is_open  # quorum 2 of 3
        for _ in range(50):
            await asyncio.sleep(0.05)
            if 1 in new.ledger.live_slots():
                break
        assert new.handles[1][0] == 2 and stored(door).slots[1] == (2, 1)  # restart recorded before the spawn
        assert (await new.sync_weights(1))["complete"] == [0, 1, 2]

    run_virtual(go())


def test_killed_halfway_through_shutdown_the_successor_finishes_it(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        frozen = arm(ctl, door, "shutdown")
        with pytest.raises(Crash):
            await ctl.shutdown()
        bury(ctl, door, frozen)
        assert stored(door).shutdown
        assert [s.dead for s in (door.shards[(i, 1)] for i in range(3))] == [True, True, False]
        new = successor(ctl, door)
        await new.ping()
        assert new.recovered["shutdown_finished"] and new.stopped
        assert all(s.dead for s in door.shards.values())  # nothing orphaned
        assert intent_key("testfleet") not in door.kv

    run_virtual(go())


def test_without_a_stored_intent_the_successor_stops_loudly(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        bury(ctl, door, {})
        new = successor(ctl, door)
        await new.ping()
        assert new.stopped and "no stored intent" in new.stopped

    run_virtual(go())


def test_a_bad_fleet_name_is_refused_naming_the_field(model_dir):
    from rlfleet.fleet.errors import ConfigError
    from rlfleet.fleet.config.fleet import load_fleet_config

    with pytest.raises(ConfigError, match="name"):
        load_fleet_config(config(model_dir, name="has space"))
    with pytest.raises(ConfigError, match="controller_max_restarts"):
        load_fleet_config(config(model_dir, controller_max_restarts=-1))


def test_the_successor_keeps_the_event_history_without_the_clients_records(model_dir, tmp_path):
    async def go():
        path = str(tmp_path / "events.jsonl")
        ctl, door = await started(model_dir, event_log_path=path)
        res = await client(ctl).generate([1, 2, 3])
        assert res.ok
        client(ctl).log.close()
        with open(path, "a") as f:  # a client in another process appends its request ends to the same file
            f.write(json.dumps(Request(t=1.0, seq=0, event="completed", request_id="r0").as_dict()) + "\n")
        own = [type(r) for r in all_of(ctl.events()) if not isinstance(r, Request)]  # (this test client logs into ctl's log)
        bury(ctl, door, dict(door.kv))
        ctl.log.close()
        new = successor(ctl, door)
        await new.ping()
        history = new.events()
        assert [type(r) for r in all_of(history[:len(own)])] == own and ControllerRestarted.matches(history[len(own)])
        assert not any(Request.matches(e) for e in history)
        assert [e["seq"] for e in history] == list(range(len(history)))  # seq goes on from the predecessor's
        await new.shutdown()

    run_virtual(go())


def test_a_shard_still_starting_is_waited_for_not_restarted(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        bury(ctl, door, dict(door.kv))
        door.shards[(2, 1)].state = "starting"  # the predecessor was restarting it when it died
        new = successor(ctl, door)
        await new.ping()
        assert new.recovered["starting"] == [2] and new.recovered["missing"] == [] and new.gate.is_open
        await asyncio.sleep(2.0)
        assert 2 not in new.ledger.live_slots() and not door.shards[(2, 1)].dead  # still waiting, not killed
        door.shards[(2, 1)].state = "ready"
        await asyncio.sleep(1.0)
        assert 2 in new.ledger.live_slots() and new.handles[2][0] == 1  # the same incarnation, no restart spent
        # its start settles as every launch does (``launch.settled``): at the committed checkpoint it serves at once
        assert 2 in new.serving_slots(), new.ledger.raw(2)
        assert (await new.sync_weights(1))["complete"] == [0, 1, 2]

    run_virtual(go())


def test_a_shard_whose_start_failed_is_dead_and_restarted(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        bury(ctl, door, dict(door.kv))
        door.shards[(2, 1)].state = "starting"
        new = successor(ctl, door)
        await new.ping()
        door.shards[(2, 1)].state = "failed"
        for _ in range(40):
            await asyncio.sleep(0.5)
            if new.handles[2][0] == 2 and 2 in new.ledger.live_slots():
                break
        assert door.shards[(2, 1)].dead and new.handles[2][0] == 2  # killed, restarted as incarnation 2

    run_virtual(go())


def test_a_shard_whose_start_call_died_with_the_predecessor_is_started_by_the_successor(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        bury(ctl, door, dict(door.kv))
        door.shards[(1, 1)].state = "new"  # spawned, but its start call was queued in the dead process
        new = successor(ctl, door)
        await new.ping()
        assert new.recovered["starting"] == [1]
        for _ in range(20):
            await asyncio.sleep(0.5)
            if 1 in new.ledger.live_slots():
                break
        assert 1 in new.ledger.live_slots() and new.handles[1][0] == 1 and not door.shards[(1, 1)].dead
        assert [m for m, s, _ in door.calls if s == 1].count("start") == 2  # the predecessor's, then the successor's
        assert (await new.sync_weights(1))["complete"] == [0, 1, 2]

    run_virtual(go())


def test_a_re_adoption_that_fails_stops_the_fleet_loudly(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        bury(ctl, door, dict(door.kv))
        new = successor(ctl, door)

        def broken(name):
            raise ConnectionError("GCS unreachable")

        door.find = broken
        await new.ping()
        assert new.stopped and "could not re-adopt" in new.stopped and "GCS unreachable" in new.stopped
        assert new.publisher.current.stopped and not new.gate.is_open
        assert any(Error.matches(e) and e["where"] == "re-adoption" for e in new.events())

    run_virtual(go())


def test_the_intent_document_round_trips_every_field():
    from rlfleet.fleet.control.intent import COMMITTED, Intent, RefitIntent

    full = Intent("f", {"engine": {"model": "/m"}, "num_engines": 3}, committed=7, membership_epoch=4,
                  slots={0: (2, 1), 5: (1, 0)}, refit=RefitIntent(7, COMMITTED, ((0, 2), (5, 1))), generation=2,
                  shutdown=True, stopped="why", removed={3: 2}, serving_roles=(0, 5), refit_id="r7")
    for intent in (full, Intent("g", {})):
        assert Intent.from_json(intent.to_json()) == intent


def test_the_intent_document_is_what_json_writes_and_follows_every_update():
    """The document is built from fields encoded once per object: it must read exactly as ``json.dumps``
    of the whole document (keys sorted) would write it, before and after updates that replace a field."""
    import json

    from rlfleet.fleet.control.intent import CLOSING, Intent, RefitIntent

    def plain(i: Intent) -> str:
        r = i.refit
        return json.dumps({
            "fleet": i.fleet, "config": i.config, "committed": i.committed, "membership_epoch": i.membership_epoch,
            "slots": {str(s): [a, b] for s, (a, b) in i.slots.items()},
            "refit": None if r is None else {"version": r.version, "phase": r.phase, "complete": [list(c) for c in r.complete]},
            "generation": i.generation, "shutdown": i.shutdown, "stopped": i.stopped,
            "removed": {str(s): v for s, v in i.removed.items()},
            "serving_roles": None if i.serving_roles is None else list(i.serving_roles),
            "refit_id": i.refit_id, "paused": i.paused}, sort_keys=True)

    a = Intent("f", {"z": 1, "engine": {"model": "/m", "b": [1, 2]}}, slots={10: (1, 0), 2: (3, 1)})
    b = a.replace(refit=RefitIntent(4, CLOSING), committed=3)
    c = b.replace(slots={**b.slots, 2: (4, 2)}, config={"other": True}, serving_roles=(2,), stopped='say "no"',
                  refit_id="a1", paused="keep")
    for intent in (a, b, c, b, a):  # back to objects encoded before: the cache follows the object, not the order
        assert intent.to_json() == plain(intent)
        assert json.loads(intent.to_json()) == json.loads(plain(intent))
