"""Slot transitions of the decision core, one test per edge of the lifecycle:
starting -> stale -> healthy, quarantine and probes, deaths, restarts with backoff,
retirement, late events, and the decide/apply contract."""

from __future__ import annotations

import math

import pytest

from rlfleet.health import (
    AbortRefit,
    CallKind,
    EngineReady,
    Evict,
    FailureClass,
    HealthConfig,
    Ledger,
    Observed,
    OpenGate,
    Probe,
    RefitReport,
    RefitResult,
    RefitFinished,
    RefitStarted,
    Restart,
    Retire,
    ShardState,
    Tick,
    decide,
    step,
)
from rlfleet.health.testing import ready_fleet, refit

PAUSE, REFIT, RESUME, GENERATE, PROBE, START = (
    CallKind.PAUSE, CallKind.REFIT, CallKind.RESUME, CallKind.GENERATE, CallKind.PROBE, CallKind.START,
)
OK, DEAD, SUSPECT, HUNG, LIED, ERROR, LATE = (
    FailureClass.OK, FailureClass.DEAD, FailureClass.SUSPECT, FailureClass.HUNG,
    FailureClass.LIED, FailureClass.ERROR, FailureClass.LATE,
)


def config(**overrides) -> HealthConfig:
    values = dict(num_engines=3, min_healthy_engines=1, unhealthy_threshold=2,
                  suspect_timeout_s=10.0, restart_budget=2, backoff_base_s=1.0, backoff_cap_s=8.0)
    values.update(overrides)
    return HealthConfig(**values)


def states(ledger: Ledger) -> list[str]:
    return [s.state.value for s in ledger.records()]


def kinds(decision) -> list[str]:
    return [type(a).__name__ for a in decision.actions]


# ------------------------------------------------------------------ starting


def test_a_new_ledger_has_every_slot_starting_and_nothing_serving():
    ledger = Ledger(config())
    assert states(ledger) == ["starting"] * 3
    assert [s.incarnation for s in ledger.records()] == [1, 1, 1]
    assert ledger.serving_count() == 0 and not ledger.gate_open and ledger.current_version is None


@pytest.mark.parametrize("event", [EngineReady(1, 1), Observed(1, 1, START, OK)])
def test_ready_engine_is_stale_until_a_refit_lands(event):
    ledger = Ledger(config())
    d = step(ledger, event, 1.0)
    assert ledger.state(1) is ShardState.STALE
    assert [(t.slot, t.before, t.after) for t in d.transitions] == [
        (1, ShardState.STARTING, ShardState.STALE)]
    assert ledger.serving_count() == 0 and d.actions == ()


def test_unavailable_while_starting_keeps_waiting():
    ledger = Ledger(config())
    d = step(ledger, Observed(0, 1, START, SUSPECT, "not scheduled yet"), 1.0)
    assert ledger.state(0) is ShardState.STARTING and d.actions == () and d.transitions == ()


@pytest.mark.parametrize("failure", [HUNG, ERROR, LIED])
def test_failed_start_is_evicted_and_rescheduled(failure):
    ledger = Ledger(config())
    d = step(ledger, Observed(0, 1, START, failure, "boom"), 1.0)
    assert kinds(d) == ["Evict"] and d.actions[0] == Evict(0, 1, d.actions[0].reason)
    assert ledger.state(0) is ShardState.DEAD
    assert ledger.record(0).restart_at == 2.0  # backoff_base_s after the death


def test_death_while_starting_needs_no_eviction():
    ledger = Ledger(config())
    d = step(ledger, Observed(0, 1, START, DEAD, "ActorDiedError: init failed"), 1.0)
    assert kinds(d) == [] and ledger.state(0) is ShardState.DEAD
    assert "init failed" in ledger.record(0).reason


def test_duplicate_ready_changes_nothing():
    ledger = ready_fleet(config())
    before = ledger.to_dict()
    d = step(ledger, EngineReady(0, 1), 1.0)
    assert d.transitions == () and ledger.to_dict() == before


# ---------------------------------------------------------------- quarantine


@pytest.mark.parametrize("call", [PAUSE, REFIT, GENERATE])
def test_unavailable_quarantines_and_probes_but_never_kills(call):
    ledger = ready_fleet(config())
    d = step(ledger, Observed(1, 1, call, SUSPECT, "ActorUnavailableError"), 1.0)
    assert ledger.state(1) is ShardState.SUSPECT and ledger.serving_slots() == (0, 2)
    assert d.actions == (Probe(1, 1, 1.0, d.actions[0].reason),)  # first probe: at once
    assert [(t.before, t.after) for t in d.transitions] == [(ShardState.HEALTHY, ShardState.SUSPECT)]
    for i in range(50):  # no amount of unavailability condemns it on its own
        step(ledger, Observed(1, 1, call, SUSPECT), 2.0 + i)
    assert ledger.state(1) is ShardState.SUSPECT


def test_an_unacknowledged_resume_stops_the_refit_and_no_probe_returns_the_shard_to_serving():
    """Seed 001: a resume that fails stops with dispatch closed unless the failure is a confirmed death.
    An unavailable shard might still be paused; answering a ping proves nothing about that.
    That is ``on_hang="stop"``; under ``evict`` (the default) the engine is killed instead."""
    ledger = ready_fleet(config(on_hang="stop"))
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, Observed(1, 1, RESUME, SUSPECT, "ActorUnavailableError"), 2.0)
    [abort] = [a for a in d.actions if isinstance(a, AbortRefit)]
    assert abort.slot == 1 and "gate stays closed" in abort.message and ledger.state(1) is ShardState.SUSPECT
    step(ledger, Observed(1, 1, PROBE, OK), 3.0)
    d = step(ledger, RefitFinished(1), 4.0)
    assert not ledger.gate_open and not any(isinstance(a, OpenGate) for a in d.actions)


def test_probe_ok_returns_a_suspect_to_healthy_on_current_weights():
    ledger = ready_fleet(config())
    step(ledger, Observed(1, 1, GENERATE, SUSPECT), 1.0)
    d = step(ledger, Observed(1, 1, PROBE, OK), 2.0)
    assert ledger.state(1) is ShardState.HEALTHY and ledger.serving_count() == 3
    assert [(t.before, t.after) for t in d.transitions] == [(ShardState.SUSPECT, ShardState.HEALTHY)]


def test_probe_ok_after_the_version_moved_on_returns_it_stale():
    ledger = ready_fleet(config())
    step(ledger, Observed(1, 1, GENERATE, SUSPECT), 1.0)
    refit(ledger, 1, 2.0)  # slot 1 is quarantined: not a participant
    step(ledger, Observed(1, 1, PROBE, OK), 3.0)
    assert ledger.state(1) is ShardState.STALE and 1 not in ledger.serving_slots()


@pytest.mark.parametrize("failure", [SUSPECT, HUNG, LIED, ERROR])
def test_failed_probes_condemn_at_unhealthy_threshold(failure):
    ledger = ready_fleet(config(unhealthy_threshold=3, probe_interval_s=0.5))
    step(ledger, Observed(2, 1, GENERATE, SUSPECT), 1.0)
    for n in (1, 2):
        d = step(ledger, Observed(2, 1, PROBE, failure), 1.0 + n)
        assert kinds(d) == ["Probe"] and ledger.record(2).failed_probes == n
        assert d.actions[0].not_before == 1.0 + n + 0.5  # spaced by probe_interval_s
        assert ledger.state(2) is ShardState.SUSPECT
    d = step(ledger, Observed(2, 1, PROBE, failure), 4.0)
    assert kinds(d) == ["Evict"] and ledger.state(2) is ShardState.DEAD
    assert "3 failed probe(s)" in ledger.record(2).reason


def test_probe_confirming_death_condemns_at_once():
    ledger = ready_fleet(config(unhealthy_threshold=5))
    step(ledger, Observed(2, 1, GENERATE, SUSPECT), 1.0)
    d = step(ledger, Observed(2, 1, PROBE, DEAD, "ActorDiedError"), 2.0)
    assert ledger.state(2) is ShardState.DEAD and kinds(d) == []


def test_failed_probe_of_a_live_shard_quarantines_it():
    ledger = ready_fleet(config(unhealthy_threshold=2))
    d = step(ledger, Observed(0, 1, PROBE, HUNG), 1.0)
    assert ledger.state(0) is ShardState.HUNG and ledger.record(0).failed_probes == 1
    assert kinds(d) == ["Probe"]


def test_hung_generate_quarantines_without_stopping_anything():
    ledger = ready_fleet(config())
    d = step(ledger, Observed(0, 1, GENERATE, HUNG, "120 s"), 1.0)
    assert ledger.state(0) is ShardState.HUNG and kinds(d) == ["Probe"]


@pytest.mark.parametrize("call", [PAUSE, RESUME])
def test_hung_pause_or_resume_aborts_the_refit_under_on_hang_stop(call):
    ledger = ready_fleet(config(on_hang="stop"))
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, Observed(0, 1, call, HUNG, "30 s"), 2.0)
    assert kinds(d) == ["Probe", "AbortRefit"] and ledger.state(0) is ShardState.HUNG
    abort = d.actions[1]
    assert isinstance(abort, AbortRefit) and (abort.slot, abort.incarnation, abort.version) == (0, 1, 1)
    assert "slot 0 (incarnation 1)" in abort.message and "gate stays closed" in abort.message


@pytest.mark.parametrize(("call", "failure"), [(PAUSE, HUNG), (RESUME, HUNG), (RESUME, SUSPECT)])
def test_under_on_hang_evict_a_missed_pause_or_resume_kills_that_engine_and_the_refit_goes_on(call, failure):
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, Observed(0, 1, call, failure, "30 s"), 2.0)
    assert kinds(d)[0] == "Evict" and "AbortRefit" not in kinds(d) and ledger.fleet.halted is None
    assert d.actions[0].slot == 0 and "on_hang=evict" in d.actions[0].reason
    assert ledger.state(0) in (ShardState.DEAD, ShardState.RESTARTING)  # restarts within its budget


def test_under_on_hang_evict_a_pause_answered_unavailable_is_only_quarantined():
    """An unavailable pause may still arrive: probes decide, as between refits."""
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, Observed(0, 1, PAUSE, SUSPECT, "x"), 2.0)
    assert kinds(d) == ["Probe"] and ledger.state(0) is ShardState.SUSPECT


def test_hung_transfer_takes_the_recovery_path_without_abort():
    ledger = ready_fleet(config())
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, Observed(0, 1, REFIT, HUNG), 2.0)
    assert kinds(d) == ["Probe"] and ledger.fleet.halted is None


@pytest.mark.parametrize("call", [PAUSE, REFIT, RESUME])
@pytest.mark.parametrize("failure", [LIED, ERROR])
def test_lie_or_error_in_a_lifecycle_call_drops_the_weights_and_aborts(call, failure):
    ledger = ready_fleet(config())
    d = step(ledger, Observed(1, 1, call, failure, "ack=None"), 1.0)
    assert ledger.state(1) is ShardState.STALE and ledger.record(1).weight_version is None
    assert kinds(d) == ["AbortRefit"] and d.failure is failure


@pytest.mark.parametrize("failure", [LIED, ERROR])
def test_a_failed_generate_is_not_a_liveness_signal(failure):
    ledger = ready_fleet(config())
    before = ledger.to_dict()
    d = step(ledger, Observed(1, 1, GENERATE, failure, "ValueError: prompt too long"), 1.0)
    assert d.actions == () and ledger.to_dict() == before


# --------------------------------------------------------------------- death


@pytest.mark.parametrize("setup", ["healthy", "stale", "suspect", "hung", "starting"])
def test_confirmed_death_is_dead_at_once_from_any_live_state(setup):
    ledger = ready_fleet(config()) if setup != "starting" else Ledger(config())
    if setup == "stale":
        step(ledger, RefitReport(0, 1, 0, RefitResult.PARTIAL), 0.5)
    elif setup in ("suspect", "hung"):
        step(ledger, Observed(0, 1, GENERATE, SUSPECT if setup == "suspect" else HUNG), 0.5)
    assert ledger.state(0).value == setup
    d = step(ledger, Observed(0, 1, REFIT, DEAD, "ActorDiedError: OOM"), 1.0)
    assert ledger.state(0) is ShardState.DEAD and d.failure is DEAD
    assert [(t.before.value, t.after) for t in d.transitions] == [(setup, ShardState.DEAD)]
    assert "ActorDiedError: OOM" in ledger.record(0).reason


def test_restart_waits_for_its_backoff_then_launches_a_new_incarnation():
    ledger = ready_fleet(config(backoff_base_s=2.0))
    step(ledger, Observed(0, 1, GENERATE, DEAD), 10.0)
    assert ledger.next_wake_at() == 12.0
    assert kinds(step(ledger, Tick(), 11.9)) == [] and ledger.state(0) is ShardState.DEAD
    d = step(ledger, Tick(), 12.0)
    assert d.actions == (Restart(0, 2, 1, 1, d.actions[0].reason),)
    assert ledger.state(0) is ShardState.RESTARTING and ledger.record(0).incarnation == 2
    step(ledger, EngineReady(0, 2), 13.0)
    assert ledger.state(0) is ShardState.STALE


def test_backoff_doubles_with_each_restart_of_a_slot():
    ledger = ready_fleet(config(restart_budget=5, backoff_base_s=1.0, backoff_cap_s=3.0))
    now, delays = 0.0, []
    for incarnation in (1, 2, 3, 4):
        step(ledger, Observed(0, incarnation, START if incarnation > 1 else GENERATE, DEAD), now)
        delays.append(ledger.record(0).restart_at - now)
        now = ledger.record(0).restart_at
        step(ledger, Tick(), now)
    assert delays == [1.0, 2.0, 3.0, 3.0]


def test_zero_backoff_restarts_in_the_same_decision():
    ledger = ready_fleet(config(backoff_base_s=0.0, backoff_cap_s=0.0))
    d = step(ledger, Observed(1, 1, GENERATE, DEAD), 1.0)
    assert kinds(d) == ["Restart"] and ledger.record(1).incarnation == 2
    assert [(t.incarnation, t.before, t.after) for t in d.transitions] == [
        (1, ShardState.HEALTHY, ShardState.DEAD), (2, ShardState.DEAD, ShardState.RESTARTING)]


def test_spent_budget_retires_the_slot_for_good():
    ledger = ready_fleet(config(restart_budget=1, backoff_base_s=0.0, backoff_cap_s=0.0))
    step(ledger, Observed(2, 1, GENERATE, DEAD), 1.0)
    d = step(ledger, Observed(2, 2, START, DEAD, "ActorDiedError: again"), 2.0)
    assert d.actions == (Retire(2, 2, d.actions[0].reason),)
    assert ledger.state(2) is ShardState.RETIRED
    assert "restart budget spent (1 of 1 used)" in ledger.record(2).reason
    assert kinds(step(ledger, Tick(), 100.0)) == [] and ledger.state(2) is ShardState.RETIRED


# ---------------------------------------------------------------------- late


def test_events_from_a_replaced_incarnation_never_condemn_the_replacement():
    ledger = ready_fleet(config(backoff_base_s=0.0, backoff_cap_s=0.0))
    step(ledger, Observed(0, 1, GENERATE, DEAD), 1.0)
    step(ledger, EngineReady(0, 2), 2.0)
    before = ledger.to_dict()
    for event in (Observed(0, 1, PAUSE, DEAD, "old actor"), Observed(0, 1, PROBE, HUNG),
                  Observed(0, 1, RESUME, LIED), EngineReady(0, 1),
                  RefitReport(0, 1, 0, RefitResult.PARTIAL)):
        d = step(ledger, event, 3.0)
        assert d.failure is LATE and d.ignored and d.actions == () and not d.changes_ledger
        assert "incarnation 1" in d.reason and "incarnation 2" in d.reason
    assert ledger.to_dict() == before and ledger.state(0) is ShardState.STALE


def test_events_about_a_dead_incarnation_are_ignored():
    ledger = ready_fleet(config())
    step(ledger, Observed(0, 1, GENERATE, DEAD), 1.0)
    before = ledger.to_dict()
    for event in (EngineReady(0, 1), Observed(0, 1, PROBE, OK), Observed(0, 1, GENERATE, DEAD)):
        d = step(ledger, event, 1.5)
        assert d.failure is LATE and "already dead" in d.reason
    assert ledger.to_dict() == before


def test_caller_classified_late_is_ignored():
    ledger = ready_fleet(config())
    before = ledger.to_dict()
    assert step(ledger, Observed(0, 1, PAUSE, LATE), 1.0).ignored
    assert ledger.to_dict() == before


# ------------------------------------------------------ decide/apply contract


def test_decide_is_pure_and_apply_refuses_stale_or_repeated_decisions():
    ledger = ready_fleet(config())
    before = ledger.to_dict()
    d1 = decide(ledger, Observed(0, 1, GENERATE, DEAD), 1.0)
    d2 = decide(ledger, Observed(1, 1, GENERATE, DEAD), 1.0)
    assert ledger.to_dict() == before  # deciding changes nothing
    ledger.apply(d1)
    with pytest.raises(ValueError, match="decide again"):
        ledger.apply(d1)
    with pytest.raises(ValueError, match="decide again"):
        ledger.apply(d2)
    assert ledger.state(1) is ShardState.HEALTHY


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (Observed(3, 1, GENERATE, DEAD), r"slot 3, but the fleet has slots 0\.\.2"),
        (Observed(-1, 1, GENERATE, DEAD), "slot -1"),
        (EngineReady(0, 2), "slot 0 incarnation 2, which the ledger never issued"),
        (Observed(0, 1, GENERATE, FailureClass.EXHAUSTED), "EXHAUSTED is a fleet verdict"),
    ],
)
def test_malformed_events_raise_naming_the_slot_and_change_nothing(event, message):
    ledger = ready_fleet(config())
    before = ledger.to_dict()
    with pytest.raises(ValueError, match=message):
        decide(ledger, event, 1.0)
    assert ledger.to_dict() == before


@pytest.mark.parametrize("now", [4.0, math.nan])
def test_time_must_not_go_backwards(now):
    ledger = ready_fleet(config(), now=5.0)
    with pytest.raises(ValueError, match="monotonic"):
        decide(ledger, Tick(), now)


def test_ledger_construction_is_checked():
    with pytest.raises(TypeError, match="needs a HealthConfig, got dict"):
        Ledger({"num_engines": 3})
    with pytest.raises(ValueError, match="first_incarnation must be an integer >= 0, got -1"):
        Ledger(config(), first_incarnation=-1)
    ledger = Ledger(config(), now=7.0, first_incarnation=10)
    assert ledger.record(2).incarnation == 10 and ledger.now == 7.0
    with pytest.raises(ValueError, match="monotonic"):
        decide(ledger, Tick(), 6.0)


def test_non_events_are_refused():
    with pytest.raises(TypeError, match="not a health event"):
        decide(Ledger(config()), "tick", 0.0)
