"""The operator's pause (vLLM's ``/pause``/``/resume`` on a fleet: ``fleet.control.operator_pause``), through the
real controller in virtual time: what each mode does to the engines' work, that nothing is lost, and that the
pause holds through a refit, quorum coming back and a controller restart."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.errors import BadRequestError
from tests.unit.fleet_fakes import client, run_virtual
from tests.unit.test_recovery import bury, started, stored, successor


def test_a_pause_holds_new_requests_and_resume_runs_them_none_lost(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        out = await ctl.pause("wait", 5.0)
        assert out["paused"] and out["drained"] and not ctl.gate.is_open and await ctl.is_paused()
        assert "paused by the operator" in ctl.gate.reason and stored(door).paused == "wait"
        held = asyncio.ensure_future(client(ctl).generate([1, 2]))
        await asyncio.sleep(5.0)
        assert not held.done()  # held by its client at the closed gate, not refused
        resumed = await ctl.resume()
        assert resumed["resumed"] and resumed["gate_open"] and stored(door).paused is None
        res = await asyncio.wait_for(held, 30)
        assert res.ok and res.result.weight_version == 0

    run_virtual(go())


def test_keep_pauses_every_engine_and_resume_resumes_them(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        out = await ctl.pause("keep", 5.0)
        assert out["kept_on"] == [0, 1, 2] and all(s.paused for s in door.shards.values())
        await ctl.resume()
        assert not any(s.paused for s in door.shards.values()) and ctl.gate.is_open

    run_virtual(go())


def test_abort_aborts_what_engines_run_and_a_bad_mode_is_refused(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        door.shards[(0, 1)].in_flight.update({"a": (0, None), "b": (0, None)})
        out = await ctl.pause("abort", 5.0)
        assert out["aborted"] == 2 and all(v is None for v in door.shards[(0, 1)].in_flight.values())
        with pytest.raises(BadRequestError, match="'sideways'"):
            await ctl.pause("sideways", 1.0)
        assert await ctl.is_paused()  # the refused call changed nothing

    run_virtual(go())


def test_a_refit_during_a_pause_commits_and_leaves_the_gate_closed(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("wait", 5.0)
        summary = await ctl.sync_weights(1)
        assert summary["version"] == 1 and ctl.ledger.current_version == 1
        assert not ctl.gate.is_open and "paused by the operator" in ctl.gate.reason
        assert not ctl.routing_state().gate_open
        await ctl.resume()
        assert ctl.gate.is_open and ctl.gate.version == 1

    run_virtual(go())


def test_a_restarted_controller_keeps_the_pause(model_dir):
    async def go():
        ctl, door = await started(model_dir)
        await ctl.pause("wait", 5.0)
        frozen = dict(door.kv)
        bury(ctl, door, frozen)
        new = successor(ctl, door)
        await new.ping()  # re-adopts
        assert await new.is_paused() and not new.gate.is_open and not new.routing_state().gate_open
        await new.resume()
        assert new.gate.is_open and stored(door).paused is None

    run_virtual(go())


def test_resume_below_quorum_leaves_the_gate_to_the_health_core(model_dir):
    async def go():
        ctl, door = await started(model_dir, min_healthy_engines=3, restart_backoff_s=600.0,
                                      restart_backoff_cap_s=600.0)
        await ctl.pause("wait", 5.0)
        door.kill(door.shards[(2, 1)])
        for _ in range(100):  # probes find it dead (virtual time)
            await asyncio.sleep(0.2)
            if ctl.ledger.serving_count() < 3:
                break
        assert ctl.ledger.serving_count() < 3  # the fault fired: quorum is lost
        out = await ctl.resume()
        assert not out["gate_open"] and not ctl.gate.is_open and "below quorum" in out["gate_reason"]

    run_virtual(go())
