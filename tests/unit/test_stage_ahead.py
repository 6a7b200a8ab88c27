"""``stage_ahead``: the update moves into the engines' staging areas while the fleet serves, and the gate
closes only for the pause, the apply, the stamp and the resume. Driven through the real controller and
lifecycle with fakes in virtual time (no Ray, no vLLM); each test names the promise it checks."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.errors import ConfigError, RefitNotStaged, RefitRefused
from rlfleet.fleet.config.fleet import load_fleet_config
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import Gate, Phase, RefitFailedAttempt


def staged_fleet(model_dir, **over):
    ctl, door, transfer = make(model_dir, stage_ahead=True, **over)
    seen = []  # what the fleet looked like each time the port was asked to stage
    stage = transfer.stage

    async def watched(participants, version, epoch, source, timeout):
        seen.append({"gate_open": ctl.gate.is_open, "paused": [s for s, sh in door.shards.items() if sh.paused and not sh.dead]})
        return await stage(participants, version, epoch, source, timeout)

    transfer.stage = watched
    return ctl, door, transfer, seen


def phases_of(ctl, version):
    return [e.phase for e in Phase.among(ctl.events()) if e.edge == "begin" and e.version == version]


def gate_events_since(ctl, seq):
    return [g for g in Gate.among(ctl.events()) if g.seq > seq]


def test_the_update_is_staged_with_the_gate_open_then_applied_on_paused_engines(model_dir):
    async def go():
        ctl, door, transfer, seen = staged_fleet(model_dir)
        await ctl.start()
        door.calls.clear()
        summary = await ctl.sync_weights(1)
        assert seen == [{"gate_open": True, "paused": []}]  # staged while serving, nothing paused
        order = [c[0] for c in door.calls if c[0] in ("stage", "pause", "apply_staged", "set_weight_version", "resume")]
        assert order.index("stage") < order.index("pause") < order.index("apply_staged") < order.index("set_weight_version")
        assert "transfer" not in [c[0] for c in door.calls]  # no blocking transfer: the apply only
        assert phases_of(ctl, 1) == ["stage", "close", "reconcile", "pause", "transfer", "commit", "resume", "reopen"]
        assert summary["complete"] == [0, 1, 2] and ctl.gate.is_open and ctl.gate.version == 1
        assert all(door.shards[(s, 1)].version == 1 for s in range(3))
        res = await client(ctl).generate([1, 2])
        assert res.ok and res.result.weight_version == 1
        await ctl.shutdown()

    run(go())


def test_a_death_while_staging_retries_on_a_new_epoch_without_it_and_the_gate_stays_open(model_dir):
    async def go():
        ctl, door, transfer, seen = staged_fleet(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        transfer.stage_fail = {1: {1: "die"}}
        mark = ctl.events()[-1]["seq"]
        summary = await ctl.sync_weights(1)
        (v1, e1, p1), (v2, e2, p2) = transfer.stage_attempts
        assert p1 == (0, 1, 2) and p2 == (0, 2) and e2 > e1
        assert seen[0]["gate_open"] and seen[1]["gate_open"]  # both attempts while serving
        assert [g.open for g in gate_events_since(ctl, mark)] == [False, True]  # one close, for the apply
        assert ctl.ledger.state(1).value in ("dead", "restarting")
        assert summary["complete"] == [0, 2] and ctl.gate.version == 1
        failed = RefitFailedAttempt.among(ctl.events())
        assert failed[-1].phase == "stage" and "die" in failed[-1].failed["1"]
        await ctl.shutdown()

    run(go())


def test_an_engine_that_fails_to_stage_twice_stays_untouched_and_the_next_refit_brings_it_back(model_dir):
    async def go():
        ctl, door, transfer, _ = staged_fleet(model_dir)
        await ctl.start()
        transfer.stage_fail = {1: {2: "error"}, 2: {2: "error"}}
        summary = await ctl.sync_weights(1)
        assert summary["complete"] == [0, 1] and ctl.gate.is_open
        shard = door.shards[(2, 1)]
        assert shard.version == 0 and not shard.dirty  # its live weights never changed
        assert 2 not in ctl.ledger.serving_slots()
        summary = await ctl.sync_weights(2)
        assert summary["complete"] == [0, 1, 2] and shard.version == 2
        assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2]
        await ctl.shutdown()

    run(go())


def test_an_update_refused_while_staging_never_closes_the_gate_and_the_fixed_one_lands(model_dir):
    async def go():
        ctl, door, transfer, _ = staged_fleet(model_dir)
        await ctl.start()
        transfer.stage_fail = {1: {0: "refuse"}}
        mark = ctl.events()[-1]["seq"]
        door.calls.clear()
        with pytest.raises(RefitRefused, match="lm_head.weight: dtype float16"):
            await ctl.sync_weights(1)
        assert gate_events_since(ctl, mark) == [] and ctl.gate.is_open and ctl.gate.version == 0
        assert [c[0] for c in door.calls if c[0] in ("pause", "resume", "apply_staged")] == []
        assert not any(sh.paused or sh.dirty for sh in door.shards.values())
        assert (await client(ctl).generate([1])).result.weight_version == 0
        assert (await ctl.sync_weights(1))["complete"] == [0, 1, 2]
        await ctl.shutdown()

    run(go())


def test_fewer_than_quorum_staged_is_refused_naming_them_and_the_gate_never_closed(model_dir):
    async def go():
        ctl, door, transfer, _ = staged_fleet(model_dir)
        await ctl.start()
        transfer.stage_fail = {1: {1: "error", 2: "error"}, 2: {1: "error", 2: "error"}}
        mark = ctl.events()[-1]["seq"]
        with pytest.raises(RefitNotStaged) as err:
            await ctl.sync_weights(1)
        msg = str(err.value)
        assert "1 engine(s) staged the update after 2 attempt(s), fewer than min_healthy_engines (2)" in msg
        assert "slot 1 (incarnation 1)" in msg and "slot 2 (incarnation 1)" in msg and "serving version 0" in msg
        assert gate_events_since(ctl, mark) == [] and ctl.gate.is_open and ctl.stopped is None
        assert not any(sh.paused or sh.dirty for sh in door.shards.values())
        assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2]
        summary = await ctl.sync_weights(1)  # the same version lands once the engines can take it
        assert summary["complete"] == [0, 1, 2] and ctl.gate.version == 1
        await ctl.shutdown()

    run(go())


def test_a_failed_apply_of_a_staged_update_leaves_that_engine_stale_and_dirty(model_dir):
    async def go():
        ctl, door, transfer, _ = staged_fleet(model_dir)
        await ctl.start()
        transfer.apply_fail = {0: "partial"}
        summary = await ctl.sync_weights(1)
        assert summary["complete"] == [1, 2] and ctl.gate.is_open and ctl.gate.version == 1
        assert 0 not in ctl.ledger.serving_slots() and door.shards[(0, 1)].dirty
        res = await asyncio.gather(*(client(ctl).generate([1]) for _ in range(8)))
        assert all(r.ok and r.result.slot != 0 and r.result.weight_version == 1 for r in res)
        await ctl.shutdown()

    run(go())


def test_stage_ahead_needs_the_staged_apply_mode(model_dir):
    with pytest.raises(ConfigError, match="stage_ahead.*needs apply_mode 'staged'.*'streaming'"):
        load_fleet_config({"engine": {"model": model_dir}, "stage_ahead": True, "apply_mode": "streaming"})
    assert load_fleet_config({"engine": {"model": model_dir}, "stage_ahead": True}).stage_ahead is True


def test_each_refit_may_choose_whether_it_stages_and_a_wrong_choice_changes_nothing(model_dir):
    """``sync_weights(..., stage_ahead=...)`` overrides the fleet's setting for that refit only."""
    from rlfleet.fleet.errors import RefitArgumentError

    async def go():
        ctl, door, transfer, seen = staged_fleet(model_dir)  # the fleet stages by default
        await ctl.start()
        await ctl.sync_weights(1, stage_ahead=False)
        assert "stage" not in phases_of(ctl, 1) and seen == []  # the bytes moved with the gate closed
        assert [c for c in door.calls if c[0] == "stage"] == []
        await ctl.sync_weights(2)  # the fleet's setting again
        assert phases_of(ctl, 2)[0] == "stage" and len(seen) == 1
        for wrong in ("yes", 1, 0.0):
            with pytest.raises(RefitArgumentError, match="stage_ahead must be True, False or None"):
                await ctl.sync_weights(3, stage_ahead=wrong)
        assert ctl.gate.is_open and ctl.gate.version == 2 and not phases_of(ctl, 3)
        await ctl.shutdown()

        plain, door2, _ = make(model_dir)  # a fleet that does not stage, asked to for one refit
        await plain.start()
        await plain.sync_weights(1, stage_ahead=True)
        assert phases_of(plain, 1)[0] == "stage" and [c for c in door2.calls if c[0] == "apply_staged"]
        await plain.sync_weights(2)
        assert "stage" not in phases_of(plain, 2)
        await plain.shutdown()

    run(go())
