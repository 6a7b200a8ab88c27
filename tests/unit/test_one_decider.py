"""Issue 46, in virtual time over the real controller: the health core alone decides the gate and holds the
operator's pause, a refit owns the engines it paused, the intent is stored before a change takes effect, the
gate's reason survives a controller restart, and no background loop dies at an exception.

Each test names the hole it closes; each failed on the main before the change."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.control.lifecycle import RefitLifecycle
from rlfleet.fleet.errors import RefitOwnsEngine
from rlfleet.fleet.records import Gate, LoopError
from rlfleet.health import Halted, OperatorPaused, OperatorResumed
from tests.unit.fleet_fakes import client, run_virtual
from tests.unit.test_recovery import Crash, arm, bury, started, stored, successor


class StoreDown(ConnectionError):
    """The intent store (Ray's GCS key-value store) refused a write."""


def failing_store(door, when=lambda key, value: True):
    real = door.kv_put

    def put(key, value):
        if when(key, value):
            raise StoreDown("GCS refused the write")
        real(key, value)

    door.kv_put = put
    return lambda: setattr(door, "kv_put", real)


def held_transfer(ctl):
    """Make the next transfer wait until the returned event is set; a second event says it is waiting."""
    transfer = ctl.lifecycle.transfer_port()
    real = transfer.transfer
    go, waiting = asyncio.Event(), asyncio.Event()

    async def slow(*args, **kw):
        waiting.set()
        await go.wait()
        return await real(*args, **kw)

    transfer.transfer = slow
    return go, waiting


# ------------------------------------------------------------------ one decider of the gate
def test_the_controller_and_its_parts_never_open_or_close_the_gate_themselves():
    """Hole: the gate was decided in four places and closed from six. Now nothing outside the health core
    can: the gate has no open/close, and the lifecycle reads the decision, not the operator's pause."""
    import inspect

    from rlfleet.fleet.control import controller, lifecycle, operator_pause, recovery

    for module in (controller, lifecycle, operator_pause, recovery):
        src = inspect.getsource(module)
        assert "gate.open(" not in src and "gate.close(" not in src, module.__name__
        assert "act.operator_pause" not in src, module.__name__
    assert "operator_pause" not in inspect.getsource(RefitLifecycle)


def test_the_pause_is_the_ledgers_and_a_refit_during_it_leaves_the_gate_closed_with_the_operators_reason(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("wait", 5.0)
        assert ctl.ledger.operator_pause == "wait" and not ctl.ledger.gate_open
        summary = await ctl.sync_weights(1)
        assert not summary["gate_open"] and "paused by the operator" in summary["gate_reason"]
        assert ctl.ledger.gate_reason == summary["gate_reason"]
        out = await ctl.resume()
        assert out["gate_open"] and ctl.ledger.gate_open and ctl.ledger.operator_pause is None
        opened = [g for g in Gate.among(ctl.events()) if g.open]
        assert opened[-1].version == 1

    run_virtual(go())


def test_a_stopped_fleet_never_opens_however_it_is_resumed(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        ctl.halt("stopped by the test")
        assert not ctl.gate.is_open and ctl.stopped == "stopped by the test" == ctl.ledger.stopped
        out = await ctl.resume()
        assert not out["gate_open"] and "stopped by the test" in ctl.gate.reason

    run_virtual(go())


# ------------------------------------------------------------------ a refit owns the engines it paused
def test_an_operator_resume_during_a_refit_transfer_leaves_its_engines_paused_until_the_refit_ends(model_dir):
    """Hole: ``resume`` after a ``keep`` pause sent a plain resume to every engine, a refit's mid-transfer
    too: they generated on half-written weights. Now each refuses it; the refit resumes them at its end."""
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("keep", 5.0)
        go_on, waiting = held_transfer(ctl)
        refit = asyncio.ensure_future(ctl.sync_weights(1))
        await asyncio.wait_for(waiting.wait(), 30)
        out = await ctl.resume()
        assert out["at_refit_end"] == [0, 1, 2] and out["resumed_on"] == []  # the fault fired: each refused it
        assert all(s.paused for s in door.shards.values()), "no engine runs while its weights are written"
        assert not ctl.gate.is_open and ctl.ledger.operator_pause is None
        go_on.set()
        summary = await refit
        assert summary["gate_open"] and not any(s.paused for s in door.shards.values())
        assert all(s.version == 1 for s in door.shards.values())

    run_virtual(go())


def test_a_keep_pause_holds_the_engines_past_a_refit_until_the_operator_resumes(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("keep", 5.0)
        summary = await ctl.sync_weights(1)
        assert summary["complete"] == [0, 1, 2] and not summary["gate_open"]
        assert all(s.paused and s.version == 1 for s in door.shards.values()), "stamped, still the operator's"
        await ctl.resume()
        assert not any(s.paused for s in door.shards.values()) and ctl.gate.is_open

    run_virtual(go())


def test_an_engine_refuses_a_plain_resume_between_begin_refit_and_end_refit(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        shard = door.shards[(0, 1)]
        handle = ctl.slots.handles[0][1]
        await door.call(handle, "begin_refit", 5, 1, timeout=1.0, pause={"mode": "keep", "clear_cache": False})
        out = await door.call(handle, "resume", timeout=1.0)
        assert isinstance(out.error, RefitOwnsEngine) and shard.paused and "refit of version 1" in str(out.error)
        ended = await door.call(handle, "end_refit", timeout=1.0)
        assert ended.ok and ended.value.resumed is True and not shard.paused

    run_virtual(go())


# ------------------------------------------------------------------ stored first, then in effect
def test_a_pause_whose_intent_write_fails_does_not_hold(model_dir):
    """Hole: the pause set its mode before the store; a failed store left ``is_paused()`` True and the next
    refit's gate closed "paused by the operator"."""
    async def go():
        ctl, door = await started(model_dir)
        restore = failing_store(door)
        with pytest.raises(StoreDown):
            await ctl.pause("keep", 5.0)
        restore()
        assert not await ctl.is_paused() and ctl.gate.is_open and ctl.ledger.operator_pause is None
        assert not any(s.paused for s in door.shards.values())
        summary = await ctl.sync_weights(1)
        assert summary["gate_open"], summary["gate_reason"]

    run_virtual(go())


def test_a_resume_whose_intent_write_fails_keeps_the_pause(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("wait", 5.0)
        restore = failing_store(door)
        with pytest.raises(StoreDown):
            await ctl.resume()
        restore()
        assert await ctl.is_paused() and not ctl.gate.is_open and stored(door).paused == "wait"

    run_virtual(go())


def test_an_intent_store_failure_at_the_close_raises_the_stores_error_and_changes_nothing(model_dir):
    """Hole: the store's error was replaced by the health core's ``ValueError`` (a rollback of a refit the
    ledger never began); it survived only as ``__context__``."""
    async def go():
        ctl, door = await started(model_dir)
        restore = failing_store(door)
        with pytest.raises(StoreDown):
            await ctl.sync_weights(1)
        restore()
        assert ctl.gate.is_open and ctl.ledger.current_version == 0 and ctl.ledger.refit_version is None
        assert (await ctl.sync_weights(1))["gate_open"]

    run_virtual(go())


# ------------------------------------------------------------------ across a controller restart
def test_a_keep_pause_holds_the_engines_across_a_controller_restart(model_dir):
    """Hole: re-adoption resumed every paused engine, then restored the stored pause: the gate held, the
    engines ran."""
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("keep", 5.0)
        frozen = dict(door.kv)
        bury(ctl, door, frozen)
        new = successor(ctl, door)
        await new.ping()  # re-adopts
        assert await new.is_paused() and not new.gate.is_open
        assert all(s.paused for s in door.shards.values()), "the engines stay paused until resume"
        await new.resume()
        assert not any(s.paused for s in door.shards.values()) and new.gate.is_open

    run_virtual(go())


def test_a_controller_killed_mid_refit_under_a_keep_pause_leaves_the_engines_paused(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("keep", 5.0)
        frozen = arm(ctl, door, "resume")  # dies after the commit, before the refit's end released them
        with pytest.raises(Crash):
            await ctl.sync_weights(1)
        bury(ctl, door, frozen)
        assert all(s.holds.refit == 1 for s in door.shards.values())  # the fault fired: the refit owned them
        new = successor(ctl, door)
        await new.ping()
        assert all(s.holds.refit is None and s.paused for s in door.shards.values())
        await new.resume()
        assert new.gate.is_open and not any(s.paused for s in door.shards.values())

    run_virtual(go())


def test_a_resent_refit_below_quorum_answers_the_reason_the_health_core_decided(model_dir):
    """Hole: a re-sent refit answered ``gate_reason: "not yet opened"`` when re-adoption left the gate
    closed below quorum."""
    async def go():
        ctl, door = await started(model_dir, min_healthy_engines=3, restart_backoff_s=600.0, restart_backoff_cap_s=600.0)
        frozen = arm(ctl, door, "resume")
        with pytest.raises(Crash):
            await ctl.sync_weights(1, refit_id="r1")
        bury(ctl, door, frozen)
        door.kill(door.shards[(2, 1)])
        new = successor(ctl, door)
        again = await new.sync_weights(1, refit_id="r1")
        assert again["recovered"] and not again["gate_open"]
        assert again["gate_reason"] != "not yet opened" and "too few engines serve version 1" in again["gate_reason"]

    run_virtual(go())


# ------------------------------------------------------------------ the health core's events
def test_operator_events_decide_the_gate_in_the_ledger(model_dir):
    async def go():
        ctl, _ = await started(model_dir)
        d = ctl.decide(OperatorPaused("keep"))
        assert not ctl.ledger.gate_open and "paused by the operator" in d.reason
        with pytest.raises(ValueError, match="'sideways'"):
            ctl.decide(OperatorPaused("sideways"))
        ctl.decide(OperatorResumed())
        assert ctl.ledger.gate_open
        ctl.decide(Halted("done"))
        ctl.decide(OperatorResumed())
        assert not ctl.ledger.gate_open and ctl.ledger.gate_reason == "done"

    run_virtual(go())


# ------------------------------------------------------------------ no loop dies
def _raise_once(real, calls):
    def wrapped(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected into one tick")
        return real(*args, **kw)

    return wrapped


@pytest.mark.parametrize("loop", ["health timers", "liveness monitor", "admission"])
def test_a_loop_tick_that_raises_is_logged_and_the_loop_goes_on(model_dir, loop):
    """Hole: a background loop died at its first exception: the fleet silently stopped restarting engines,
    evicting hangs or following KV load."""
    async def go():
        ctl, door = await started(model_dir, monitor_interval_s=0.5)
        calls: list = []
        if loop == "health timers":
            ctl.slots.ledger.next_wake_at = _raise_once(ctl.slots.ledger.next_wake_at, calls)
        elif loop == "liveness monitor":
            ctl.monitor._node_verdicts = _raise_once(ctl.monitor._node_verdicts, calls)
        else:
            ctl.admission.observe = _raise_once(ctl.admission.observe, calls)
        await asyncio.sleep(3 * max(ctl.cfg.admission.poll_interval_s, 0.5) + 1.0)
        errors = [e for e in LoopError.among(ctl.events()) if e.loop == loop]
        assert errors and errors[0].failed_ticks == 1 and "injected into one tick" in errors[0].error
        assert len(calls) >= 2, f"the {loop} loop ran no tick after the one that raised"
        if loop == "liveness monitor":  # and it still finds a death on its own
            door.kill(door.shards[(1, 1)])
            await asyncio.sleep(5.0)
            assert ctl.ledger.raw(1).incarnation > 1 or ctl.ledger.state(1).value != "healthy"
        res = await client(ctl).generate([1, 2])
        assert res.ok

    run_virtual(go())


def test_a_shrink_under_a_keep_pause_aborts_what_the_paused_engine_holds_instead_of_waiting_the_drain_bound(model_dir):
    """Hole: a shrink under a ``keep`` pause drained engines whose requests could not finish, holding the
    lifecycle's lock for the whole drain bound. Their requests are aborted at once and run after the resume."""
    async def go():
        loop = asyncio.get_running_loop()
        ctl, door = await started(model_dir, request_timeout_s=600.0)
        door.gen_delay = 1.0
        reqs = [asyncio.ensure_future(client(ctl).generate([i, i + 1])) for i in range(30)]
        await asyncio.sleep(0.3)
        assert all(s.in_flight for s in door.shards.values())  # every engine holds requests
        await ctl.pause("keep", 5.0)
        t0 = loop.time()
        out = await ctl.resize(2)
        assert loop.time() - t0 < 30.0, "the shrink waited for requests a paused engine cannot finish"
        [removed] = out["removed"]
        row = out["drained"][str(removed)]
        assert row["paused"] and row["aborted"] >= 1, row  # the fault fired: the removed engine held requests
        await ctl.resume()
        results = await asyncio.wait_for(asyncio.gather(*reqs), 120)
        assert all(r.ok for r in results) and len(results) == 30

    run_virtual(go())
