"""The transfer step of a refit off the happy path (issue 29, holes 3, 6 and 7), driven through the real
controller and lifecycle with fakes in virtual time (no Ray, no vLLM).

- a sender that fails before any byte reaches an engine changes nothing: the refit rolls back, the fleet
  keeps serving the committed version, the trainer gets ``RefitSourceFailed`` naming its sender; a dead
  sender is refused before the gate closes;
- the one retry re-sends only to the engines that failed: what completed the first attempt stays complete,
  even when the retry is cut off or skipped;
- one deadline bounds the whole transfer phase, classification and re-pause included, and the summary
  says how many attempts ran and why a retry was skipped."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.errors import RefitNotDelivered, RefitSourceFailed
from rlfleet.health import RefitResult
from tests.unit.fleet_fakes import FakeSender, client
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import Gate, Phase, RefitRetrySkipped, RefitRolledBack

REFIT_CALLS = ("pause", "transfer", "set_weight_version", "resume")


def _phase_s(ctl, name):
    """Seconds the last refit's ``name`` phase took."""
    return [e for e in Phase.among(ctl.events()) if e.phase == name and e.edge == "end"][-1].seconds


def _serving(ctl, version, slots=(0, 1, 2)):
    assert ctl.gate.is_open and ctl.gate.version == version and ctl.stopped is None
    assert not ctl.lifecycle.running and sorted(ctl.ledger.serving_slots()) == sorted(slots)


def _slow(transfer, seconds, then=None):
    """Every transfer attempt takes ``seconds[attempt]`` of virtual time (after its bytes moved) before it
    answers; ``then(attempt)`` runs after each attempt answered (to script what happens next)."""
    transfer.after_s, transfer.then = seconds, then  # inside the attempt: the port's deadline cuts it off


# --- hole 3: a sender that fails before any byte moved ---------------------------------------------

@pytest.mark.parametrize("what", ["die", "die_midway", "hang", "error"])
def test_a_sender_that_fails_before_the_update_is_applied_rolls_back_and_names_the_sender(model_dir, what):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(1, FakeSender("trainer-a"))
        sender = FakeSender("trainer-b")
        transfer.fail[2] = transfer.fail[3] = {"sender": what}  # this refit's first attempt and its retry
        with pytest.raises(RefitSourceFailed, match=r"weight sender FakeSender\(name='trainer-b'") as err:
            await ctl.sync_weights(2, sender)
        assert "before the update reached any engine" in str(err.value) and "send version 2 again" in str(err.value)
        assert isinstance(err.value, RefitNotDelivered)  # the caller's one rule: nothing changed, send again
        _serving(ctl, 1)  # rolled back: the gate reopened on the committed version, nothing stopped
        assert not any(s.paused for s in door.shards.values())
        assert all(ctl.ledger.raw(s).weight_version == 1 for s in range(3))
        assert RefitRolledBack.among(ctl.events())[-1].resumed == [0, 1, 2]
        assert _phase_s(ctl, "transfer") <= ctl.cfg.lifecycle_deadline_s + 1e-6
        res = await client(ctl).generate([1, 2])
        assert res.ok and res.result.weight_version == 1
        transfer.fail.clear()
        assert (await ctl.sync_weights(2, FakeSender("trainer-c")))["complete"] == [0, 1, 2]  # sent again: it lands
        await ctl.shutdown()

    run(go())


def test_a_dead_sender_is_not_retried_and_a_transient_sender_error_is(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        transfer.fail[1] = {"sender": "error"}  # once: the retry succeeds
        summary = await ctl.sync_weights(1, FakeSender())
        assert summary["attempts"] == 2 and summary["complete"] == [0, 1, 2]
        transfer.fail[3] = {"sender": "die"}
        with pytest.raises(RefitSourceFailed, match="is dead"):
            await ctl.sync_weights(2, FakeSender("trainer-b"))
        assert len(transfer.attempts) == 3  # a retry from a dead sender cannot help: none was spent
        assert RefitRetrySkipped.among(ctl.events())[-1].reason.startswith("the weight sender")
        _serving(ctl, 1)
        await ctl.shutdown()

    run(go())


def test_a_dead_sender_is_refused_before_the_gate_closes(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        door.calls.clear()
        gates = len(Gate.among(ctl.events()))
        with pytest.raises(RefitSourceFailed, match=r"weight sender FakeSender\(name='gone', dead=True\) is dead"):
            await ctl.sync_weights(1, FakeSender("gone", dead=True))
        assert [c for c in door.calls if c[0] in REFIT_CALLS] == [] and transfer.attempts == []
        assert len(Gate.among(ctl.events())) == gates
        _serving(ctl, 0)
        await ctl.shutdown()

    run(go())


# --- hole 6: the retry re-sends only to the engines that failed -------------------------------------

def test_a_retry_cut_off_by_the_deadline_keeps_the_engines_that_completed(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)  # the transfer phase's bound: 0.4 s
        await ctl.start()
        transfer.fail[1] = {1: "error"}  # slot 1's apply fails; 0 and 2 complete
        _slow(transfer, {2: 10.0})  # the retry never answers: the phase's deadline cuts it off
        summary = await ctl.sync_weights(1)
        assert [a[2] for a in transfer.attempts] == [(0, 1, 2), (1,)]  # the retry: only the engine that failed
        assert summary["attempts"] == 2 and summary["complete"] == [0, 2]
        _serving(ctl, 1, slots=(0, 2))  # quorum had the new weights: committed, the gate reopened
        assert door.shards[(0, 1)].version == door.shards[(2, 1)].version == 1
        assert ctl.ledger.raw(1).weight_version is None  # cut off mid-retry: unknown weights, never served
        assert _phase_s(ctl, "transfer") <= ctl.cfg.lifecycle_deadline_s + 1e-6
        await ctl.shutdown()

    run(go())


def test_a_retry_goes_to_the_failed_engines_only_and_completes_the_fleet(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        transfer.fail[1] = {1: "partial", 2: "error"}
        summary = await ctl.sync_weights(1)
        assert transfer.attempts[1][2] == (1, 2)  # slot 0 is not sent the bytes twice
        assert summary["attempts"] == 2 and summary["complete"] == [0, 1, 2]
        _serving(ctl, 1)
        assert all(door.shards[(s, 1)].version == 1 for s in range(3))
        await ctl.shutdown()

    run(go())


# --- hole 7: one deadline for the whole phase -------------------------------------------------------

def test_a_first_attempt_that_ran_into_a_frozen_engine_still_leaves_the_retry_its_time(model_dir):
    """Seen on real engines (freeze-during-transfer): the first attempt waits out the receivers' bound on the
    frozen engine (here 0.2 s of 0.4 s), and classifying it costs a probe (0.1 s): less is left than the first
    attempt took, yet a retry without the frozen engine needs far less (a quarter of refit_timeout_s)."""
    async def go():
        ctl, door, transfer = make(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        transfer.fail[1] = {0: "hang"}  # frozen: the collective fails for everyone, its ping never answers
        _slow(transfer, {1: 0.2})
        summary = await ctl.sync_weights(1)
        assert summary["attempts"] == 2 and summary["retry_skipped"] is None and summary["complete"] == [1, 2]
        assert transfer.attempts[1][2] == (1, 2)
        _serving(ctl, 1, slots=(1, 2))
        assert _phase_s(ctl, "transfer") <= ctl.cfg.lifecycle_deadline_s + 1e-6
        await ctl.shutdown()

    run(go())


def test_the_re_pause_does_not_wait_on_the_frozen_engine_it_left_behind(model_dir):
    """Seen on real engines (freeze-during-transfer, after the refit's calls were fused): the re-pause fenced
    every engine outside the retry's plan, the frozen one included, and waited out its probe bound inside the
    transfer phase; the retry then ran out of the phase and the fleet stopped below quorum. The refit's first
    pause fences the others; a later pause does not wait on them again."""
    async def go():
        ctl, door, transfer = make(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        transfer.fail[1] = {0: "hang"}  # frozen: the collective fails for everyone, its ping never answers
        door.shards[(0, 1)].sticky["fence"] = "hang"  # nor does a fence
        door.calls.clear()
        summary = await ctl.sync_weights(1)
        after = door.calls[door.calls.index(("transfer", -1, 1)):]
        assert ("fence", 0, 1) not in after, "the re-pause waited on the frozen engine"
        assert summary["attempts"] == 2 and summary["retry_skipped"] is None and summary["complete"] == [1, 2]
        await ctl.shutdown()

    run(go())


def test_the_retry_is_skipped_when_less_is_left_than_an_attempt_is_sized_for(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        transfer.fail[1] = {1: "error"}
        _slow(transfer, {1: 0.35})  # 0.35 s of the 0.4 s bound: less than refit_timeout_s / 4 (0.075 s) is left
        door.calls.clear()
        summary = await ctl.sync_weights(1)
        assert len(transfer.attempts) == 1 and summary["attempts"] == 1
        assert "left of the transfer phase" in summary["retry_skipped"] and "0.075 s" in summary["retry_skipped"]
        assert ("pause", 0, 1) not in door.calls[door.calls.index(("transfer", -1, 1)):]  # no re-pause either
        assert summary["complete"] == [0, 2]
        _serving(ctl, 1, slots=(0, 2))
        assert _phase_s(ctl, "transfer") <= ctl.cfg.lifecycle_deadline_s + 1e-6
        await ctl.shutdown()

    run(go())


def test_a_hung_re_pause_is_cut_at_the_phase_deadline_and_the_summary_says_the_retry_did_not_run(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        transfer.fail[1] = {1: "error"}

        def hang_the_re_pause(attempt):
            if attempt == 1:
                door.shards[(1, 1)].script["pause"] = "hang"

        _slow(transfer, {1: 0.1}, then=hang_the_re_pause)
        summary = await ctl.sync_weights(1)
        assert _phase_s(ctl, "transfer") <= ctl.cfg.lifecycle_deadline_s + 1e-6  # was 0.1 + 0.4 of re-pause
        assert len(transfer.attempts) == 1 and summary["attempts"] == 1
        assert "deadline" in summary["retry_skipped"]
        assert door.shards[(1, 1)].dead  # the pause that did not answer within the phase: hung, evicted
        assert summary["complete"] == [0, 2]
        _serving(ctl, 1, slots=(0, 2))
        await ctl.shutdown()

    run(go())


def test_nothing_delivered_by_the_engines_rolls_back_without_stopping(model_dir):
    """Not the sender's fault either: every engine failed both attempts before any byte moved (a join
    that failed everywhere). Nothing changed, so nothing stops: rolled back, a typed error to send again."""
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        transfer.fail[1] = transfer.fail[2] = {s: "error" for s in range(3)}
        with pytest.raises(RefitNotDelivered, match="no engine received any byte") as err:
            await ctl.sync_weights(1, FakeSender())
        assert not isinstance(err.value, RefitSourceFailed)
        _serving(ctl, 0)
        assert len(transfer.attempts) == 2
        await ctl.shutdown()

    run(go())


# --- the fault matrix's proof of "sender-killed-mid-transfer" (faults.evidence) ----------------------

def _killed_sender_firing(**over):
    call = {"version": 5, "outcome": "rolled_back", "began": 10.0, "ended": 12.0,
            "error": "RefitSourceFailed: refit of version 5: the weight sender Actor(WeightSource, ab12) is dead: it failed"}
    serving = {"gate_open": True, "version": 4, "states": {0: "healthy", 1: "healthy", 2: "healthy"}, "in_flight": 0}
    return {"step": 1, "where": "update", "what": "kill_sender", "slot": None, "delay_s": 0.0, "t": 1.0,
            "calls": [call], "before": serving, "after": serving, "sender": "Actor(WeightSource, ab12)",
            "sender_state": "DEAD", **over}


KILLED_SENDER_LOG = [
    Phase(phase="transfer", edge="begin", version=5, t=11.0).as_dict(),
    RefitRolledBack(version=5, reason="RefitSourceFailed: ...", t=11.5, resumed=[], gate_closed=True).as_dict(),
    Gate(open=True, version=4, t=11.6, reason="").as_dict(),
    Gate(open=True, version=6, t=20.0, reason="").as_dict(),
]


def test_the_proof_of_a_killed_sender_needs_its_death_the_roll_back_and_a_later_commit():
    from rlfleet.faults.evidence import prove

    rows, problems = prove([_killed_sender_firing()], KILLED_SENDER_LOG, [])
    assert problems == [] and rows[0]["action"] == "kill_sender" and rows[0]["left_for"] == "rolled_back"
    alive = _killed_sender_firing(sender_state="ALIVE", calls=[{**_killed_sender_firing()["calls"][0], "outcome": "committed"}])
    rows, problems = prove([alive], KILLED_SENDER_LOG[:1] + KILLED_SENDER_LOG[2:3], [])
    said = " ".join(problems)
    assert "the sender was not killed" in said and "did not roll back with RefitSourceFailed" in said
    assert "no refit_rolled_back record of version 5" in said and "no later refit" in said
