"""The slot transition table as a spec: every starting state x call x observed
class -> the state that must follow. A change to any rule changes a cell here.

unhealthy_threshold is 2, so one failed probe quarantines but does not kill; the
restart backoff is non-zero, so a death shows as ``dead`` (the restart comes on a
later tick). The table is ``on_hang="evict"`` (the default): a pause or resume that
misses its deadline, or a resume answered 'unavailable', kills that engine.
``ON_HANG_STOP`` lists the cells that differ under ``on_hang="stop"``.
"""

from __future__ import annotations

import pytest

from rlfleet.health import (
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    Ledger,
    Observed,
    RefitReport,
    RefitResult,
    Tick,
    step,
)
from rlfleet.health.testing import ready_fleet

FAILURES = ("ok", "dead", "suspect", "hung", "lied", "error")
# state before  call       after: ok        dead  suspect   hung      lied      error
TABLE = """
healthy     generate  healthy    dead  suspect   hung      healthy   healthy
healthy     pause     healthy    dead  suspect   dead      stale     stale
healthy     refit     healthy    dead  suspect   hung      stale     stale
healthy     stamp     healthy    dead  suspect   hung      stale     stale
healthy     resume    healthy    dead  dead      dead      stale     stale
healthy     probe     healthy    dead  suspect   hung      suspect   suspect
healthy     start     healthy    dead  healthy   healthy   healthy   healthy
stale       generate  stale      dead  suspect   hung      stale     stale
stale       pause     stale      dead  suspect   dead      stale     stale
stale       probe     stale      dead  suspect   hung      suspect   suspect
suspect     generate  suspect    dead  suspect   suspect   suspect   suspect
suspect     pause     suspect    dead  suspect   dead      suspect   suspect
suspect     probe     healthy    dead  suspect   suspect   suspect   suspect
suspect     start     suspect    dead  suspect   suspect   suspect   suspect
hung        generate  hung       dead  hung      hung      hung      hung
hung        resume    hung       dead  dead      dead      hung      hung
hung        probe     healthy    dead  hung      hung      hung      hung
starting    generate  starting   dead  starting  starting  starting  starting
starting    pause     starting   dead  starting  starting  starting  starting
starting    probe     starting   dead  starting  starting  starting  starting
starting    start     stale      dead  starting  dead      dead      dead
restarting  start     stale      dead  restarting dead     dead      dead
restarting  probe     restarting dead  restarting restarting restarting restarting
dead        generate  dead       dead  dead      dead      dead      dead
dead        start     dead       dead  dead      dead      dead      dead
dead        probe     dead       dead  dead      dead      dead      dead
retired     start     retired    retired retired retired   retired   retired
retired     probe     retired    retired retired retired   retired   retired
"""

# (state before, call, failure) -> state after, under on_hang="stop": the engine stays quarantined (the
# refit itself stops, see test_health_design_table)
ON_HANG_STOP = {
    ("healthy", "pause", "hung"): "hung",
    ("healthy", "resume", "suspect"): "suspect",
    ("healthy", "resume", "hung"): "hung",
    ("stale", "pause", "hung"): "hung",
    ("suspect", "pause", "hung"): "suspect",
    ("hung", "resume", "suspect"): "hung",
    ("hung", "resume", "hung"): "hung",
}

CASES = [
    (row[0], row[1], failure, after)
    for row in (line.split() for line in TABLE.strip().splitlines())
    for failure, after in zip(FAILURES, row[2:], strict=True)
]


def _config(**overrides) -> HealthConfig:
    values = dict(num_engines=2, min_healthy_engines=1, unhealthy_threshold=2,
                  suspect_timeout_s=30.0, restart_budget=2, backoff_base_s=1.0, backoff_cap_s=1.0)
    values.update(overrides)
    return HealthConfig(**values)


def _in_state(state: str, on_hang: str = "evict") -> Ledger:
    """A ledger whose slot 0 is in ``state`` (reached through events only)."""
    if state == "starting":
        return Ledger(_config(on_hang=on_hang))
    ledger = ready_fleet(_config(restart_budget=0 if state == "retired" else 2, on_hang=on_hang))
    if state == "stale":
        step(ledger, RefitReport(0, 1, 0, RefitResult.PARTIAL), 0.0)
    elif state in ("suspect", "hung"):
        step(ledger, Observed(0, 1, CallKind.GENERATE, FailureClass(state)), 0.0)
    elif state in ("dead", "retired", "restarting"):
        step(ledger, Observed(0, 1, CallKind.GENERATE, FailureClass.DEAD), 0.0)
        if state == "restarting":
            step(ledger, Tick(), 1.0)
    assert ledger.state(0).value == state
    return ledger


@pytest.mark.parametrize(("before", "call", "failure", "after"), CASES,
                         ids=[f"{b}-{c}-{f}" for b, c, f, _ in CASES])
def test_transition_table(before, call, failure, after):
    ledger = _in_state(before)
    incarnation = ledger.record(0).incarnation
    decision = step(ledger, Observed(0, incarnation, CallKind(call), FailureClass(failure)), 2.0)
    assert ledger.state(0).value == after, decision.reason
    assert ledger.state(1).value in ("healthy", "starting")  # nothing else moved


@pytest.mark.parametrize(("before", "call", "failure"), sorted(ON_HANG_STOP), ids=["-".join(k) for k in sorted(ON_HANG_STOP)])
def test_under_on_hang_stop_a_missed_pause_or_resume_deadline_quarantines_instead(before, call, failure):
    ledger = _in_state(before, on_hang="stop")
    decision = step(ledger, Observed(0, ledger.record(0).incarnation, CallKind(call), FailureClass(failure)), 2.0)
    assert ledger.state(0).value == ON_HANG_STOP[(before, call, failure)], decision.reason
    evict = dict(((b, c, f), a) for b, c, f, a in CASES)
    assert evict[(before, call, failure)] == "dead"  # the table (evict) differs in exactly these cells


def test_table_covers_every_state_and_call():
    assert {c[0] for c in CASES} == {
        "healthy", "stale", "suspect", "hung", "starting", "restarting", "dead", "retired"}
    assert {c[1] for c in CASES} == {c.value for c in CallKind}


@pytest.mark.parametrize("failure", ["suspect", "hung"])
def test_an_unacknowledged_stamp_leaves_the_version_unknown_and_a_probe_brings_it_back_stale(failure):
    ledger = _in_state("healthy")
    step(ledger, Observed(0, 1, CallKind.STAMP, FailureClass(failure), "set_weight_version unavailable"), 2.0)
    assert ledger.record(0).weight_version is None and "version unknown" in ledger.record(0).reason
    step(ledger, Observed(0, 1, CallKind.PROBE, FailureClass.OK), 3.0)
    assert ledger.state(0).value == "stale"  # alive, but its tag is unknown: not healthy, not routed


def test_ready_is_the_start_ok_column():
    for before, expected in (("starting", "stale"), ("restarting", "stale"), ("healthy", "healthy")):
        ledger = _in_state(before)
        step(ledger, EngineReady(0, ledger.record(0).incarnation), 2.0)
        assert ledger.state(0).value == expected
