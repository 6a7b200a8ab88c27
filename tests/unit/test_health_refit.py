"""Refits in the decision core: typed per-participant outcomes, version commits,
the gate verdict at the end, and eviction of shards that stay suspect or hung
longer than suspect_timeout_s while a refit is in progress."""

from __future__ import annotations

import pytest

from rlfleet.health import (
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    KeepGateClosed,
    Observed,
    OpenGate,
    RefitFinished,
    RefitReport,
    RefitResult,
    RefitStarted,
    ShardState,
    StopExhausted,
    Tick,
    VersionCommitted,
    decide,
    step,
)
from rlfleet.health.testing import feed, ready_fleet, refit

COMPLETE, PARTIAL, NOT_STARTED = RefitResult.COMPLETE, RefitResult.PARTIAL, RefitResult.NOT_STARTED
GENERATE, PAUSE, REFIT = CallKind.GENERATE, CallKind.PAUSE, CallKind.REFIT


def config(**overrides) -> HealthConfig:
    values = dict(num_engines=4, min_healthy_engines=2, unhealthy_threshold=3,
                  suspect_timeout_s=10.0, restart_budget=2, backoff_base_s=1.0, backoff_cap_s=8.0)
    values.update(overrides)
    return HealthConfig(**values)


def gate_actions(decisions) -> list:
    return [a for d in decisions for a in d.actions
            if isinstance(a, (OpenGate, KeepGateClosed, StopExhausted))]


# ------------------------------------------------------------ typed outcomes


def test_complete_refit_and_commit_make_participants_healthy_on_the_new_version():
    ledger = ready_fleet(config())
    decisions = refit(ledger, 1, 1.0)
    assert ledger.current_version == 1 and ledger.serving_slots() == (0, 1, 2, 3)
    assert gate_actions(decisions) == [OpenGate(1, 4, 2)] and ledger.gate_open
    assert all(s.weight_version == 1 for s in ledger.records())


def test_a_landed_version_does_not_serve_before_it_is_committed():
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    assert not ledger.gate_open
    step(ledger, RefitReport(0, 1, 1, COMPLETE), 1.0)
    # Holds version 1 while version 0 is current: not serving either version.
    assert ledger.state(0) is ShardState.STALE and ledger.serving_slots() == (1, 2, 3)


def test_not_started_leaves_weights_untouched_and_stale_after_the_commit():
    ledger = ready_fleet(config())
    decisions = refit(ledger, 1, 1.0, {2: NOT_STARTED})
    assert ledger.record(2).weight_version == 0 and not ledger.record(2).partial
    assert ledger.state(2) is ShardState.STALE and ledger.serving_slots() == (0, 1, 3)
    commit = next(d for d in decisions if isinstance(d.event, VersionCommitted))
    assert [(t.slot, t.before, t.after) for t in commit.transitions if t.slot == 2] == [
        (2, ShardState.HEALTHY, ShardState.STALE)]


def test_partial_marks_mixed_weights_only_when_bytes_moved():
    ledger = ready_fleet(config())
    refit(ledger, 1, 1.0, {1: PARTIAL, 2: NOT_STARTED})
    assert ledger.record(1).partial and ledger.record(1).weight_version is None
    assert not ledger.record(2).partial
    assert ledger.state(1) is ShardState.STALE
    # A complete refit of the next version heals the mixed weights.
    refit(ledger, 2, 2.0)
    assert ledger.state(1) is ShardState.HEALTHY and not ledger.record(1).partial


def test_partial_outside_any_refit_still_drops_the_stamp():
    ledger = ready_fleet(config())
    step(ledger, RefitReport(3, 1, 7, PARTIAL), 1.0)
    assert ledger.state(3) is ShardState.STALE  # never trust mixed weights


def test_complete_for_a_version_not_being_refitted_is_ignored():
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, RefitReport(0, 1, 2, COMPLETE), 1.0)
    assert d.ignored and ledger.record(0).weight_version == 0


def test_a_stale_incarnation_becomes_healthy_only_when_the_current_version_lands_on_it():
    ledger = ready_fleet(config(backoff_base_s=0.0, backoff_cap_s=0.0))
    step(ledger, Observed(0, 1, GENERATE, FailureClass.DEAD), 1.0)
    step(ledger, EngineReady(0, 2), 2.0)
    assert ledger.state(0) is ShardState.STALE
    # The old incarnation's report of the current version does not help the new one.
    step(ledger, RefitStarted(1), 3.0)
    assert step(ledger, RefitReport(0, 1, 1, COMPLETE), 3.0).ignored
    feed(ledger, [RefitReport(s, 1, 1, COMPLETE) for s in (1, 2, 3)], 3.0)
    feed(ledger, [VersionCommitted(1), RefitFinished(1)], 3.0)
    assert ledger.state(0) is ShardState.STALE and 0 not in ledger.serving_slots()
    refit(ledger, 2, 4.0)
    assert ledger.state(0) is ShardState.HEALTHY and ledger.record(0).incarnation == 2


# --------------------------------------------------------------- gate verdict


def test_gate_stays_closed_when_the_refit_was_not_committed():
    ledger = ready_fleet(config())
    decisions = refit(ledger, 1, 1.0, commit=False)
    [verdict] = gate_actions(decisions)
    assert isinstance(verdict, KeepGateClosed) and "not committed" in verdict.message
    assert not ledger.gate_open and ledger.current_version == 0


def test_gate_stays_closed_after_an_abort_and_the_abort_cannot_be_committed():
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    step(ledger, Observed(2, 1, PAUSE, FailureClass.LIED, "ack=None"), 1.0)
    # Nothing from an aborted refit counts as success.
    assert step(ledger, RefitReport(2, 1, 1, COMPLETE), 1.0).ignored
    with pytest.raises(ValueError, match="after the refit was aborted"):
        decide(ledger, VersionCommitted(1), 1.0)
    [verdict] = gate_actions([step(ledger, RefitFinished(1), 1.0)])
    assert isinstance(verdict, KeepGateClosed) and "slot 2 (incarnation 1)" in verdict.message
    assert not ledger.gate_open


def test_a_lie_on_resume_after_the_commit_keeps_the_gate_closed():
    ledger = ready_fleet(config())
    feed(ledger, [RefitStarted(1)] + [RefitReport(s, 1, 1, COMPLETE) for s in range(4)]
         + [VersionCommitted(1)], 1.0)
    step(ledger, Observed(3, 1, CallKind.RESUME, FailureClass.LIED, "ack='ok'"), 1.0)
    [verdict] = gate_actions([step(ledger, RefitFinished(1), 1.0)])
    assert isinstance(verdict, KeepGateClosed)
    assert ledger.state(3) is ShardState.STALE and 3 not in ledger.serving_slots()


def test_below_quorum_at_the_end_of_a_refit_stops_naming_every_dead_slot():
    ledger = ready_fleet(config(min_healthy_engines=3, backoff_base_s=5.0))
    step(ledger, RefitStarted(1), 1.0)
    step(ledger, Observed(1, 1, PAUSE, FailureClass.DEAD, "ActorDiedError: node lost"), 1.0)
    step(ledger, Observed(3, 1, REFIT, FailureClass.DEAD, "ActorDiedError: OOM"), 1.0)
    feed(ledger, [RefitReport(0, 1, 1, COMPLETE), RefitReport(2, 1, 1, COMPLETE),
                  VersionCommitted(1)], 1.0)
    d = step(ledger, RefitFinished(1), 1.0)
    [verdict] = gate_actions([d])
    assert isinstance(verdict, StopExhausted) and d.failure is FailureClass.EXHAUSTED
    assert verdict.dead_slots == (1, 3) and (verdict.serving, verdict.needed) == (2, 3)
    for text in ("slot 1 (incarnation 1)", "node lost", "slot 3 (incarnation 1)", "OOM"):
        assert text in verdict.message
    assert not ledger.gate_open


def test_dead_participant_does_not_stop_a_refit_that_keeps_quorum():
    ledger = ready_fleet(config(min_healthy_engines=2))
    step(ledger, RefitStarted(1), 1.0)
    step(ledger, Observed(3, 1, REFIT, FailureClass.DEAD), 1.0)
    feed(ledger, [RefitReport(s, 1, 1, COMPLETE) for s in range(3)] + [VersionCommitted(1)], 1.0)
    assert gate_actions([step(ledger, RefitFinished(1), 1.0)]) == [OpenGate(1, 3, 2)]


# ------------------------------------------------------------------- ordering


def test_refit_retry_of_the_same_version_is_a_no_op():
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, RefitStarted(1), 2.0)
    assert not d.changes_ledger and ledger.fleet.refit_started_at == 1.0


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([RefitStarted(0)], r"RefitStarted\(0\): weight versions must increase; current is 0"),
        ([RefitStarted(1), RefitStarted(2)], r"while the refit of version 1 is in progress"),
        ([VersionCommitted(1)], r"VersionCommitted\(1\) but the refit in progress is None"),
        ([RefitStarted(1), VersionCommitted(2)], "the refit in progress is 1"),
        ([RefitFinished(1)], r"RefitFinished\(1\) but the refit in progress is None"),
        ([RefitStarted(-1)], "integer >= 0, got -1"),
    ],
)
def test_refit_events_out_of_order_are_refused(events, message):
    ledger = ready_fleet(config())
    *setup, last = events
    feed(ledger, setup, 1.0)
    before = ledger.to_dict()
    with pytest.raises(ValueError, match=message):
        decide(ledger, last, 1.0)
    assert ledger.to_dict() == before


# ------------------------------------------------------------------- eviction


@pytest.mark.parametrize("failure", [FailureClass.SUSPECT, FailureClass.HUNG])
def test_a_frozen_shard_is_evicted_after_suspect_timeout_during_a_refit(failure):
    ledger = ready_fleet(config(suspect_timeout_s=10.0))
    step(ledger, RefitStarted(1), 100.0)
    step(ledger, Observed(2, 1, REFIT, failure, "frozen"), 101.0)
    assert ledger.next_wake_at() == 111.0
    assert step(ledger, Tick(), 110.9).actions == ()
    d = step(ledger, Tick(), 111.0)
    assert [type(a).__name__ for a in d.actions] == ["Evict"]
    assert (d.actions[0].slot, d.actions[0].incarnation) == (2, 1)
    assert "suspect_timeout_s=10" in d.actions[0].reason
    assert ledger.state(2) is ShardState.DEAD


def test_shards_already_overdue_are_evicted_when_a_refit_starts():
    ledger = ready_fleet(config(suspect_timeout_s=10.0))
    step(ledger, Observed(0, 1, GENERATE, FailureClass.SUSPECT), 1.0)
    step(ledger, Observed(1, 1, GENERATE, FailureClass.HUNG), 5.0)
    d = step(ledger, RefitStarted(1), 12.0)
    assert [(type(a).__name__, a.slot) for a in d.actions] == [("Evict", 0)]
    assert ledger.state(0) is ShardState.DEAD and ledger.state(1) is ShardState.HUNG


def test_no_eviction_by_timeout_outside_a_refit():
    ledger = ready_fleet(config(suspect_timeout_s=10.0))
    step(ledger, Observed(0, 1, GENERATE, FailureClass.SUSPECT), 1.0)
    for now in (11.0, 50.0, 1000.0):
        assert step(ledger, Tick(), now).actions == ()
    assert ledger.state(0) is ShardState.SUSPECT


def test_eviction_timer_of_a_finished_refit_does_not_fire_later():
    ledger = ready_fleet(config(suspect_timeout_s=10.0))
    step(ledger, RefitStarted(1), 0.0)
    step(ledger, Observed(0, 1, REFIT, FailureClass.HUNG), 1.0)
    feed(ledger, [RefitReport(s, 1, 1, COMPLETE) for s in (1, 2, 3)]
         + [VersionCommitted(1), RefitFinished(1)], 2.0)
    assert step(ledger, Tick(), 20.0).actions == () and ledger.state(0) is ShardState.HUNG


def test_a_new_quarantine_restarts_the_eviction_clock():
    ledger = ready_fleet(config(suspect_timeout_s=10.0))
    step(ledger, RefitStarted(1), 0.0)
    step(ledger, Observed(0, 1, PAUSE, FailureClass.SUSPECT), 0.0)
    step(ledger, Observed(0, 1, CallKind.PROBE, FailureClass.OK), 1.0)
    step(ledger, Observed(0, 1, PAUSE, FailureClass.SUSPECT), 6.0)
    assert step(ledger, Tick(), 10.0).actions == ()  # the first episode's timer is void
    assert ledger.state(0) is ShardState.SUSPECT
    assert [type(a).__name__ for a in step(ledger, Tick(), 16.0).actions] == ["Evict"]


def test_evicted_shard_restarts_after_backoff():
    ledger = ready_fleet(config(suspect_timeout_s=10.0, backoff_base_s=3.0))
    step(ledger, RefitStarted(1), 0.0)
    step(ledger, Observed(0, 1, REFIT, FailureClass.HUNG), 0.0)
    step(ledger, Tick(), 10.0)
    assert ledger.record(0).restart_at == 13.0
    d = step(ledger, Tick(), 13.0)
    assert [(type(a).__name__, a.incarnation) for a in d.actions] == [("Restart", 2)]


# --- a refit rolled back before any engine changed -------------------------------------------------
from rlfleet.health import RefitRolledBack  # noqa: E402


def test_a_rolled_back_refit_reopens_on_the_committed_version():
    ledger = ready_fleet(HealthConfig(num_engines=3, min_healthy_engines=2))
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, RefitRolledBack(1, "tensor x: wrong shape"), 2.0)
    assert d.actions == (OpenGate(0, 3, 2),) and "rolled back (tensor x: wrong shape)" in d.reason
    assert ledger.current_version == 0 and sorted(ledger.serving_slots()) == [0, 1, 2]
    assert step(ledger, RefitStarted(1), 3.0).reason.startswith("refit of version 1 started")  # the version is free again


def test_a_rolled_back_refit_below_quorum_stops_naming_the_dead():
    ledger = ready_fleet(HealthConfig(num_engines=3, min_healthy_engines=3, restart_budget=0))
    step(ledger, RefitStarted(1), 1.0)
    step(ledger, Observed(2, 1, CallKind.PAUSE, FailureClass.DEAD, "killed"), 1.5)
    d = step(ledger, RefitRolledBack(1, "bad update"), 2.0)
    assert [type(a) for a in d.actions] == [StopExhausted] and d.failure is FailureClass.EXHAUSTED


def test_a_commit_cannot_be_rolled_back_and_the_version_must_match():
    ledger = ready_fleet(HealthConfig(num_engines=3, min_healthy_engines=2))
    step(ledger, RefitStarted(1), 1.0)
    with pytest.raises(ValueError, match=r"RefitRolledBack\(2\) but the refit in progress is 1"):
        decide(ledger, RefitRolledBack(2, "x"), 1.5)
    for s in range(3):
        step(ledger, RefitReport(s, 1, 1, COMPLETE), 1.5)
    step(ledger, VersionCommitted(1), 1.6)
    with pytest.raises(ValueError, match="a commit cannot be rolled back"):
        decide(ledger, RefitRolledBack(1, "too late"), 2.0)


# --- quorum between refits: the gate follows it ----------------------------------------------------
from rlfleet.health import CloseGate  # noqa: E402


def test_deaths_between_refits_below_quorum_close_the_gate_and_a_refit_reopens_it():
    ledger = ready_fleet(HealthConfig(num_engines=3, min_healthy_engines=2, backoff_base_s=5.0, backoff_cap_s=5.0))
    assert ledger.gate_open
    d = step(ledger, Observed(0, 1, CallKind.GENERATE, FailureClass.DEAD, "killed"), 1.0)
    assert not any(isinstance(a, CloseGate) for a in d.actions) and ledger.gate_open  # 2 of 3 still serve
    d = step(ledger, Observed(1, 1, CallKind.PROBE, FailureClass.DEAD, "killed"), 2.0)
    [close] = [a for a in d.actions if isinstance(a, CloseGate)]
    assert (close.serving, close.needed) == (1, 2) and "requests wait" in close.message and not ledger.gate_open
    step(ledger, Tick(), 10.0)  # backoff over: both restart
    for slot in (0, 1):
        d = step(ledger, EngineReady(slot, 2), 11.0)
        assert not any(isinstance(a, OpenGate) for a in d.actions)  # a restarted engine is stale until a refit
    refit(ledger, 1, 12.0)
    assert ledger.gate_open and sorted(ledger.serving_slots()) == [0, 1, 2]


def test_quorum_back_between_refits_reopens_only_a_gate_quorum_closed():
    ledger = ready_fleet(HealthConfig(num_engines=3, min_healthy_engines=3, unhealthy_threshold=3))
    d = step(ledger, Observed(2, 1, CallKind.GENERATE, FailureClass.SUSPECT, "unreachable"), 1.0)
    assert [type(a) for a in d.actions if isinstance(a, (CloseGate, OpenGate))] == [CloseGate]
    d = step(ledger, Observed(2, 1, CallKind.PROBE, FailureClass.OK, "answers again"), 2.0)
    assert [a for a in d.actions if isinstance(a, OpenGate)] == [OpenGate(0, 3, 3)] and ledger.gate_open
