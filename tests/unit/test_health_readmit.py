"""Re-admission in the decision core (``health.readmit``): which stale engines a tick asks to bring to the
committed version, what a landed or failed re-admission changes, and that a refit or a stop wins. No Ray."""

from __future__ import annotations

from rlfleet.health import (
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    Observed,
    Readmit,
    ReadmitFailed,
    Readmitted,
    RefitStarted,
    ShardState,
    Tick,
    step,
)
from rlfleet.health.readmit import READMIT_BACKOFF_CAP_S, READMIT_BACKOFF_S, READMIT_FAILURES_TO_EVICT
from rlfleet.health.testing import ready_fleet, refit

H, S = ShardState.HEALTHY, ShardState.STALE


def cfg(n=3, min_healthy=2):
    return HealthConfig(num_engines=n, min_healthy_engines=min_healthy, restart_budget=3, backoff_base_s=0.0,
                        backoff_cap_s=0.0)


def restarted(slot=1, n=3, min_healthy=2, version=2):
    """A fleet at ``version`` whose ``slot`` died and came back (stale, on the checkpoint)."""
    ledger = ready_fleet(cfg(n, min_healthy))
    for v in range(1, version + 1):
        refit(ledger, v, 1.0)
    step(ledger, Observed(slot, 1, CallKind.GENERATE, FailureClass.DEAD, "killed"), 2.0)
    step(ledger, Tick(), 2.0)  # the restart (no backoff)
    step(ledger, EngineReady(slot, 2), 3.0)
    assert ledger.state(slot) is S
    return ledger


def readmits(decision):
    return [a for a in decision.actions if isinstance(a, Readmit)]


def test_a_tick_asks_to_bring_a_stale_engine_to_the_committed_version_and_a_landed_one_serves():
    ledger = restarted()
    d = step(ledger, Tick(), 4.0)
    assert [(a.slot, a.incarnation, a.version) for a in readmits(d)] == [(1, 2, 2)]
    assert ledger.current_version == 2
    d = step(ledger, Readmitted(1, 2, 2, "slot 0"), 5.0)
    assert ledger.state(1) is H and ledger.current_version == 2  # no new version number
    assert "re-admitted from slot 0" in ledger.raw(1).reason
    assert not readmits(step(ledger, Tick(), 6.0))  # nothing stale: nothing asked


def test_a_readmission_brings_quorum_back_and_reopens_the_gate():
    ledger = restarted(slot=1, n=2, min_healthy=2)
    assert not ledger.gate_open  # one of two serves: below quorum
    step(ledger, Readmitted(1, 2, 2, "slot 0"), 5.0)
    assert ledger.gate_open and ledger.serving_count() == 2


def test_nothing_is_asked_during_a_refit_without_a_donor_or_at_the_checkpoint():
    ledger = restarted()
    step(ledger, RefitStarted(3), 4.0)
    assert not readmits(step(ledger, Tick(), 4.5))  # the refit brings it along (or not) by its state
    # a re-admission that lands while a refit runs changes nothing
    step(ledger, Readmitted(1, 2, 2, "slot 0"), 5.0)
    assert ledger.state(1) is S
    at_zero = ready_fleet(cfg())
    step(at_zero, Observed(1, 1, CallKind.GENERATE, FailureClass.DEAD, "killed"), 2.0)
    step(at_zero, Tick(), 2.0)
    step(at_zero, EngineReady(1, 2), 3.0)
    assert not readmits(step(at_zero, Tick(), 4.0))  # version 0 is the checkpoint: CheckpointLoaded's


def test_a_readmission_of_an_old_version_or_an_old_incarnation_changes_nothing():
    ledger = restarted()
    step(ledger, Readmitted(1, 2, 1, "slot 0"), 5.0)  # version 2 is committed
    assert ledger.state(1) is S
    d = step(ledger, Readmitted(1, 1, 2, "slot 0"), 5.0)  # the dead incarnation
    assert ledger.state(1) is S and d.failure is FailureClass.LATE


def test_failures_back_off_and_the_engines_own_evict_it_while_a_donors_never_count():
    ledger = restarted()
    step(ledger, ReadmitFailed(1, 2, "donor died mid-copy", its_fault=False), 4.0)
    assert ledger.raw(1).readmit_failures == 0
    assert not readmits(step(ledger, Tick(), 4.0 + READMIT_BACKOFF_S / 2))  # backing off: never every tick
    assert readmits(step(ledger, Tick(), 4.0 + READMIT_BACKOFF_S * 2))
    now = 20.0
    for n in range(1, READMIT_FAILURES_TO_EVICT):
        step(ledger, ReadmitFailed(1, 2, "digests differ", its_fault=True), now)
        assert ledger.raw(1).readmit_failures == n and ledger.raw(1).incarnation == 2
        assert not readmits(step(ledger, Tick(), now + 0.1))
        now += 100.0
    d = step(ledger, ReadmitFailed(1, 2, "digests differ", its_fault=True), now)
    assert ledger.raw(1).incarnation == 3 or ledger.state(1) in (ShardState.DEAD, ShardState.RESTARTING)
    assert any(type(a).__name__ == "Evict" for a in d.actions)


def test_donors_that_keep_failing_back_off_doubling_to_the_cap_and_never_evict_the_engine():
    """With every donor failing (none can give the weights), the engine is tried again after 2, 4, 8 ... s, at
    most READMIT_BACKOFF_CAP_S apart: never every 2 s for ever, and never evicted for the donors' fault."""
    ledger = restarted()
    now, gaps = 4.0, []
    for _ in range(8):
        step(ledger, ReadmitFailed(1, 2, "no donor could give the weights", its_fault=False), now)
        rec = ledger.raw(1)
        gaps.append(rec.readmit_after - now)
        assert not readmits(step(ledger, Tick(), rec.readmit_after - 0.01))  # not before its back-off ran out
        now = rec.readmit_after
        assert readmits(step(ledger, Tick(), now))
    assert gaps == [min(READMIT_BACKOFF_S * 2 ** k, READMIT_BACKOFF_CAP_S) for k in range(8)], gaps
    assert gaps[-1] == READMIT_BACKOFF_CAP_S and ledger.raw(1).readmit_failures == 0 and ledger.raw(1).incarnation == 2
    step(ledger, Readmitted(1, 2, 2, "slot 2"), now + 1.0)
    assert ledger.raw(1).readmit_tries == 0 and ledger.state(1) is H


def test_a_landed_readmission_clears_its_failures():
    ledger = restarted()
    step(ledger, ReadmitFailed(1, 2, "load failed", its_fault=True), 4.0)
    step(ledger, Readmitted(1, 2, 2, "slot 2"), 50.0)
    assert ledger.raw(1).readmit_failures == 0 and ledger.raw(1).readmit_after == 0.0 and ledger.state(1) is H
