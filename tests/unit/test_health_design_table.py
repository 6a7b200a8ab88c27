"""DESIGN.md's failure-class table, row by row, end to end: a raw call outcome (one of
Ray's own exceptions, or an ack value) goes through the one classification path (the
door's ``outcome_of``, then ``fleet.outcome.observed``) and ``step``, and the test
checks the effect the table promises."""

from __future__ import annotations

from rlfleet.health import (
    AbortRefit,
    CallKind,
    Evict,
    FailureClass,
    HealthConfig,
    KeepGateClosed,
    OpenGate,
    Probe,
    RefitFinished,
    RefitReport,
    RefitResult,
    RefitStarted,
    ShardState,
    StopExhausted,
    Tick,
    VersionCommitted,
    step,
)
from rlfleet.health.testing import feed, ready_fleet
from ray import exceptions as rex

from rlfleet.fleet.outcome import observed
from rlfleet.fleet.cluster.ray_door import outcome_of


class ActorDiedError(rex.ActorDiedError):
    """Ray's own death, with the cause the test names in its message."""

    def __init__(self, message: str = "") -> None:
        super().__init__()
        self.message = message

    def __str__(self) -> str:
        return self.message


def ActorUnavailableError(message: str) -> BaseException:  # noqa: N802
    return rex.ActorUnavailableError(message, None)


def observe(slot: int, incarnation: int, call: CallKind, raw: object):
    """What the controller does with one settled call: exception or ack -> outcome -> observation."""
    out = outcome_of(exc=raw) if isinstance(raw, BaseException) else outcome_of(raw, expect_ack=True)
    return observed(slot, incarnation, call, out)


def fleet(**overrides):
    values = dict(num_engines=4, min_healthy_engines=2, unhealthy_threshold=2,
                  suspect_timeout_s=30.0, restart_budget=1, backoff_base_s=5.0, backoff_cap_s=5.0)
    values.update(overrides)
    return ready_fleet(HealthConfig(**values))


def finish_refit(ledger, version, participants, now):
    reports = [RefitReport(s, ledger.record(s).incarnation, version, RefitResult.COMPLETE)
               for s in participants]
    return feed(ledger, reports + [VersionCommitted(version), RefitFinished(version)], now)[-1]


def test_row_dead_removes_that_incarnation_and_continues_while_quorum_holds():
    ledger = fleet()
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, observe(3, 1, CallKind.PAUSE, ActorDiedError("worker killed")), 1.0)
    assert d.failure is FailureClass.DEAD and ledger.state(3) is ShardState.DEAD
    assert finish_refit(ledger, 1, (0, 1, 2), 1.0).actions == (OpenGate(1, 3, 2),)


def test_row_unavailable_is_quarantined_and_probed_never_death_on_its_own():
    ledger = fleet()
    d = step(ledger, observe(1, 1, CallKind.GENERATE, ActorUnavailableError("node busy")), 1.0)
    assert d.failure is FailureClass.SUSPECT and isinstance(d.actions[0], Probe)
    assert ledger.state(1) is ShardState.SUSPECT and 1 not in ledger.serving_slots()
    step(ledger, observe(1, 1, CallKind.PROBE, True), 2.0)
    assert ledger.state(1) is ShardState.HEALTHY


def test_row_hung_pause_or_resume_under_on_hang_evict_kills_it_and_the_refit_goes_on():
    ledger = fleet()  # on_hang defaults to evict
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, observe(2, 1, CallKind.RESUME, TimeoutError("resume: 30 s")), 31.0)
    assert d.failure is FailureClass.HUNG and not any(isinstance(a, AbortRefit) for a in d.actions)
    assert Evict(2, 1, d.actions[0].reason) == d.actions[0] and "on_hang=evict" in d.actions[0].reason
    assert ledger.state(2) in (ShardState.DEAD, ShardState.RESTARTING) and ledger.fleet.halted is None
    d = step(ledger, observe(1, 1, CallKind.PAUSE, TimeoutError("pause: 30 s")), 31.0)
    assert isinstance(d.actions[0], Evict) and ledger.fleet.halted is None
    # slots 0 and 3 hold the version: quorum (2) holds and the gate reopens
    assert finish_refit(ledger, 1, (0, 3), 31.0).actions == (OpenGate(1, 2, 2),)


def test_row_hung_pause_or_resume_under_on_hang_stop_stops_with_the_gate_closed():
    ledger = fleet(on_hang="stop")
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, observe(2, 1, CallKind.RESUME, TimeoutError("resume: 30 s")), 31.0)
    assert d.failure is FailureClass.HUNG and any(isinstance(a, AbortRefit) for a in d.actions)
    [verdict] = step(ledger, RefitFinished(1), 31.0).actions
    assert isinstance(verdict, KeepGateClosed) and not ledger.gate_open


def test_row_hung_refit_takes_the_recovery_path_and_a_frozen_engine_is_evicted():
    ledger = fleet(suspect_timeout_s=30.0)
    step(ledger, RefitStarted(1), 0.0)
    d = step(ledger, observe(0, 1, CallKind.REFIT, TimeoutError("transfer: 60 s")), 60.0)
    assert not any(isinstance(a, AbortRefit) for a in d.actions)
    d = step(ledger, Tick(), 90.0)
    assert d.actions == (Evict(0, 1, d.actions[0].reason),)
    assert finish_refit(ledger, 1, (1, 2, 3), 90.0).actions == (OpenGate(1, 3, 2),)


def test_row_lied_is_never_counted_as_success_and_stops_with_the_gate_closed():
    ledger = fleet()
    step(ledger, RefitStarted(1), 1.0)
    d = step(ledger, observe(1, 1, CallKind.REFIT, None), 1.0)  # ack None, not True
    assert d.failure is FailureClass.LIED and any(isinstance(a, AbortRefit) for a in d.actions)
    assert step(ledger, RefitReport(1, 1, 1, RefitResult.COMPLETE), 1.0).ignored
    assert ledger.record(1).weight_version is None
    [verdict] = step(ledger, RefitFinished(1), 1.0).actions
    assert isinstance(verdict, KeepGateClosed)


def test_row_late_error_from_a_replaced_incarnation_is_ignored():
    ledger = fleet(backoff_base_s=0.0, backoff_cap_s=0.0)
    step(ledger, observe(2, 1, CallKind.GENERATE, ActorDiedError()), 1.0)  # now incarnation 2
    before = ledger.to_dict()
    d = step(ledger, observe(2, 1, CallKind.PAUSE, ActorDiedError("old actor finally died")), 2.0)
    assert d.failure is FailureClass.LATE and ledger.to_dict() == before
    assert ledger.record(2).incarnation == 2 and ledger.state(2) is ShardState.RESTARTING


def test_row_exhausted_stops_loudly_naming_the_dead_shards():
    ledger = fleet(min_healthy_engines=3, restart_budget=0)
    step(ledger, RefitStarted(1), 1.0)
    step(ledger, observe(0, 1, CallKind.PAUSE, ActorDiedError("node 3 lost")), 1.0)
    d = step(ledger, observe(2, 1, CallKind.REFIT, ActorDiedError("OOM")), 1.0)
    [stop] = [a for a in d.actions if isinstance(a, StopExhausted)]
    assert d.failure is FailureClass.EXHAUSTED and stop.dead_slots == (0, 2)
    assert "node 3 lost" in stop.message and "OOM" in stop.message
