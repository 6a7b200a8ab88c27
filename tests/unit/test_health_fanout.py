"""A fan-out's results as one health decision, and what each refit pays per shard.

``Batch`` must decide exactly what feeding its events one by one decides (same
ledger, same transitions and actions in the same order), the ledger's cached views
(serving, live, state counts) must always equal a direct count, the membership
plan's shortcut must agree with the full comparison, and the event log's bulk and
fast paths must write the same records as the general one.
"""

from __future__ import annotations

import copy
import enum
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.fleet import eventlog
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.records import Gate, Health
from rlfleet.fleet.control.metrics import FleetMetrics
from rlfleet.health import (
    Batch,
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    Ledger,
    MembershipPlan,
    Observed,
    Participant,
    Probe,
    RefitReport,
    RefitResult,
    RefitStarted,
    ShardState,
    SlotPhase,
    Tick,
    Transition,
    decide,
    plan_membership,
    step,
)
from rlfleet.health.core import _batch_failure
from rlfleet.health.ledger import QUARANTINE, TIMER_ESCALATE, TIMER_RESTART
from rlfleet.health.testing import ready_fleet
from tests.unit.test_health_properties import CALLS, FAILURES, WARM_START, Model, configs, make_events, ops

SLOT_OPS = ["observe", "observe", "probe", "ready", "report", "report", "late"]
slot_ops = st.tuples(
    st.sampled_from(SLOT_OPS),
    st.integers(0, 5),
    st.sampled_from(CALLS),
    st.sampled_from(FAILURES),
    st.sampled_from(list(RefitResult)),
    st.integers(0, 2),
    st.just(0.0),
)
steps = st.lists(
    st.one_of(ops.map(lambda script: ("ops", script[:6])), st.lists(slot_ops, max_size=8).map(lambda b: ("batch", b))),
    min_size=1,
    max_size=12,
)


def _direct_views(ledger: Ledger) -> tuple:
    records = ledger.records()
    return (
        tuple(r.slot for r in records if r.state is ShardState.HEALTHY),
        tuple(r.slot for r in records if r.state in (ShardState.HEALTHY, ShardState.STALE)),
        {s: n for s, n in Counter(r.state for r in records).items()},
    )


def _live_timers(ledger: Ledger) -> list[tuple]:
    """The pending timers that would still act when due (``on_tick`` skips the others), each once
    (two with the same token fire one thing: the second finds it done)."""
    out = []
    for due, _seq, kind, slot, inc, token in ledger._timers:
        r = ledger.raw(slot)
        if r.incarnation != inc:
            continue
        if kind == TIMER_RESTART and r.phase is SlotPhase.DEAD and r.restart_at == token:
            out.append((due, kind, slot, inc, token))
        elif kind == TIMER_ESCALATE and r.phase in QUARANTINE and r.since == token:
            out.append((due, kind, slot, inc, token))
    return sorted(set(out))


def _check_views(ledger: Ledger) -> None:
    serving, live, counts = _direct_views(ledger)
    assert ledger.serving_slots() == serving
    assert ledger.live_slots() == live
    assert {s: n for s, n in ledger.state_counts().items() if n} == counts
    assert set(ledger.state_counts()) == set(ShardState)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), script=steps, warm_start=st.booleans())
def test_a_batch_decides_what_its_events_decide_one_by_one(config, script, warm_start):
    one_by_one, batched = Ledger(config), Ledger(config)
    model = Model()
    for op in WARM_START if warm_start else []:
        for event in make_events(one_by_one, model, op):
            step(one_by_one, event, model.now)
            step(batched, event, model.now)
    for kind, items in script:
        if kind == "ops":  # ordinary events (fleet events, ticks, clock moves), fed to both alike
            for op in items:
                for event in make_events(one_by_one, model, op):
                    a, b = step(one_by_one, event, model.now), step(batched, event, model.now)
                    assert (a.actions, a.transitions, a.reason) == (b.actions, b.transitions, b.reason)
            continue
        # One fan-out: events made against the state before any of them (incarnations pinned),
        # a slot may appear twice, late and never-ready incarnations included.
        events = tuple(e for op in items for e in make_events(one_by_one, model, op) if not isinstance(e, Tick))
        before = batched.to_dict()
        snapshot = copy.deepcopy(one_by_one)
        try:
            singles = [step(one_by_one, e, model.now) for e in events]
        except (ValueError, TypeError) as exc:
            with pytest.raises(type(exc)):
                decide(batched, Batch(events), model.now)
            assert batched.to_dict() == before  # all or nothing
            one_by_one = snapshot
            continue
        d = decide(batched, Batch(events), model.now)
        assert batched.to_dict() == before  # deciding alone changes nothing
        batched.apply(d)
        assert d.actions == tuple(a for s in singles for a in s.actions)
        assert d.transitions == tuple(t for s in singles for t in s.transitions)
        reasons = [s.reason for s in singles if s.reason != "nothing to do"]
        assert d.reason == ("; ".join(reasons) or "nothing to do")
        assert d.failure is _batch_failure([s.failure for s in singles])
        assert batched.to_dict() == one_by_one.to_dict()
        assert batched._timers == one_by_one._timers  # same timers, same order (ties fire alike)
        assert batched.fleet == one_by_one.fleet
        _check_views(batched)
    assert batched.to_dict() == one_by_one.to_dict()
    _check_views(one_by_one)


def _refitting(n: int = 4, on_hang: str = "evict") -> Ledger:
    ledger = ready_fleet(HealthConfig(n, min_healthy_engines=1, on_hang=on_hang), version=0)
    step(ledger, RefitStarted(1), 1.0)
    return ledger


def test_a_fan_out_of_acks_is_one_decision_that_changes_nothing():
    ledger = _refitting(32)
    before = ledger.to_dict()
    d = step(ledger, Batch(tuple(Observed(s, 1, CallKind.PAUSE, FailureClass.OK) for s in range(32))), 2.0)
    assert d.failure is FailureClass.OK and d.actions == () and d.transitions == ()
    assert d.reason.count("pause ok on slot") == 32
    assert {k: v for k, v in ledger.to_dict().items()} == before


def test_a_batch_of_reports_stamps_every_slot_and_the_commit_makes_them_serve():
    ledger = _refitting(8)
    d = step(ledger, Batch(tuple(RefitReport(s, 1, 1, RefitResult.COMPLETE) for s in range(8))), 2.0)
    assert [t.slot for t in d.transitions] == list(range(8))
    assert {(t.before, t.after) for t in d.transitions} == {(ShardState.HEALTHY, ShardState.STALE)}
    assert ledger.serving_slots() == ()
    assert all(ledger.raw(s).weight_version == 1 for s in range(8))


def _reports(version: int = 1, slots=range(6), incarnation: int = 1, result=RefitResult.COMPLETE) -> list:
    return [RefitReport(s, incarnation, version, result) for s in slots]


def _quarantine_slot_2(ledger: Ledger) -> None:
    step(ledger, Observed(2, 1, CallKind.PROBE, FailureClass.SUSPECT, "slow"), 1.5)


def _halt(ledger: Ledger) -> None:
    step(ledger, Observed(1, 1, CallKind.PAUSE, FailureClass.HUNG, "hung"), 1.5)


# (name, how the ledger is prepared after RefitStarted(1), the reports, whether the one-pass rule takes it)
REPORT_BATCHES = [
    ("every live slot complete", None, _reports(), True),
    ("some of the slots", None, _reports(slots=(5, 0, 3)), True),
    ("a slot reported twice", None, _reports(slots=(0, 1, 0)), False),
    ("a late incarnation", None, _reports()[:3] + [RefitReport(4, 0, 1, RefitResult.COMPLETE)], False),
    ("another version", None, _reports(version=2), False),
    ("one partial", None, _reports()[:5] + [RefitReport(5, 1, 1, RefitResult.PARTIAL)], False),
    ("one not started", None, [RefitReport(0, 1, 1, RefitResult.NOT_STARTED)] + _reports()[1:], False),
    ("a suspect slot", _quarantine_slot_2, _reports(), False),
    ("a halted refit", _halt, _reports(), False),
]


@pytest.mark.parametrize("name, prepare, reports, one_pass", REPORT_BATCHES, ids=[b[0] for b in REPORT_BATCHES])
def test_the_one_pass_rule_for_a_refits_reports_decides_what_they_decide_one_by_one(name, prepare, reports, one_pass,
                                                                                    monkeypatch):
    """The transfer step's batch (every participant COMPLETE) takes one pass (``slot_rules.land_all``);
    any other batch is left to the general rule. Both decide what the reports decide one by one."""
    from rlfleet.health import slot_rules

    single, batched = _refitting(6, on_hang="stop"), _refitting(6, on_hang="stop")
    if prepare is not None:
        prepare(single)
        prepare(batched)
    singles = [step(single, e, 2.0) for e in reports]
    taken = []
    land_all = slot_rules.land_all
    monkeypatch.setattr(slot_rules, "land_all", lambda d, events: taken.append(land_all(d, events)) or taken[-1])
    d = step(batched, Batch(tuple(reports)), 2.0)
    assert taken == [one_pass]
    assert d.transitions == tuple(t for s in singles for t in s.transitions)
    assert d.actions == tuple(a for s in singles for a in s.actions)
    assert d.reason == "; ".join(s.reason for s in singles if s.reason != "nothing to do")
    assert d.failure is _batch_failure([s.failure for s in singles])
    assert d.records == tuple(r for s in singles for r in s.records)
    assert batched.to_dict() == single.to_dict() and batched._timers == single._timers
    _check_views(batched)


@pytest.mark.parametrize("on_hang", ["stop", "evict"])
def test_a_hung_pause_in_a_batch_acts_like_a_single_event(on_hang):
    single, batched = _refitting(on_hang=on_hang), _refitting(on_hang=on_hang)
    events = (Observed(0, 1, CallKind.PAUSE, FailureClass.OK), Observed(1, 1, CallKind.PAUSE, FailureClass.HUNG, "x"),
              Observed(2, 1, CallKind.PAUSE, FailureClass.OK))
    singles = [step(single, e, 2.0) for e in events]
    d = step(batched, Batch(events), 2.0)
    assert list(d.actions) == [a for s in singles for a in s.actions]
    assert [type(a).__name__ for a in d.actions if not isinstance(a, Probe)][:1] == \
        (["AbortRefit"] if on_hang == "stop" else ["Evict"])
    assert d.failure is FailureClass.HUNG
    assert batched.to_dict() == single.to_dict()


def test_a_batch_is_all_or_nothing():
    ledger = _refitting()
    before, serial = ledger.to_dict(), ledger.serial
    bad = (Observed(0, 1, CallKind.PAUSE, FailureClass.DEAD, "died"), Observed(1, 7, CallKind.PAUSE, FailureClass.OK))
    with pytest.raises(ValueError, match="slot 1 incarnation 7"):
        step(ledger, Batch(bad), 2.0)
    with pytest.raises(TypeError, match="Tick"):
        step(ledger, Batch((Observed(0, 1, CallKind.PAUSE, FailureClass.OK), Tick())), 2.0)
    with pytest.raises(TypeError, match="tuple"):
        step(ledger, Batch([Observed(0, 1, CallKind.PAUSE, FailureClass.OK)]), 2.0)
    assert (ledger.to_dict(), ledger.serial) == (before, serial)


def test_an_empty_batch_and_the_failure_of_a_batch():
    ledger = _refitting()
    d = step(ledger, Batch(()), 2.0)
    assert (d.failure, d.reason, d.actions) == (FailureClass.OK, "nothing to do", ())
    ok, late, dead, hung = FailureClass.OK, FailureClass.LATE, FailureClass.DEAD, FailureClass.HUNG
    assert _batch_failure([late, late]) is late
    assert _batch_failure([ok, late]) is ok
    assert _batch_failure([ok, late, hung, dead]) is hung
    assert _batch_failure([dead, FailureClass.EXHAUSTED]) is FailureClass.EXHAUSTED


def test_cached_views_follow_every_change_and_are_reused_until_then():
    ledger = _refitting(4)
    serving, live = ledger.serving_slots(), ledger.live_slots()
    assert ledger.serving_slots() is serving and ledger.live_slots() is live  # nothing changed: no rebuild
    step(ledger, Observed(2, 1, CallKind.PAUSE, FailureClass.DEAD, "died"), 2.0)
    assert ledger.serving_slots() == (0, 1, 3) and ledger.live_slots() == (0, 1, 3)
    step(ledger, Tick(), 10.0)  # restart due: slot 2 launches its incarnation 2
    step(ledger, EngineReady(2, 2), 11.0)
    assert ledger.live_slots() == (0, 1, 2, 3) and ledger.serving_slots() == (0, 1, 3)
    _check_views(ledger)


def test_the_plan_shortcut_agrees_with_the_full_comparison():
    ledger = ready_fleet(HealthConfig(3))
    plan = plan_membership(ledger, None)
    assert plan_membership(ledger, plan) is plan
    shuffled = MembershipPlan(plan.epoch, tuple(reversed(plan.participants)))  # same members, other order
    assert plan_membership(ledger, shuffled) is shuffled
    other = MembershipPlan(plan.epoch, (Participant(0, 1, 1), Participant(1, 2, 2), Participant(2, 1, 3)))
    fresh = plan_membership(ledger, other)
    assert fresh.epoch == plan.epoch + 1 and fresh.members == plan.members


# --------------------------------------------------------------- the log and metrics of a fan-out


class Colour(enum.Enum):
    RED = "red"


class Loud(enum.Enum):
    A = "a"

    @property
    def value(self):  # not the stock ``value``: written through it, as before
        return "LOUD"


class Level(enum.IntEnum):
    HIGH = 3


def test_emit_rows_writes_what_emit_writes_one_by_one(tmp_path):
    rows = (Transition(0, 1, ShardState.HEALTHY, ShardState.STALE, "refit of version 2 landed"),
            Transition(3, 2, ShardState.STALE, ShardState.HEALTHY, "holds committed version 2"))
    bulk, single = EventLog(str(tmp_path / "bulk.jsonl"), clock=lambda: 5.0), EventLog(clock=lambda: 5.0)
    bulk.emit("gate", open=False, version=1, reason="refit of version 2")
    single.emit(Gate(open=False, version=1, reason="refit of version 2"))
    bulk.emit_rows(Health, rows)
    bulk.emit_rows("health", ())
    for t in rows:
        single.emit("health", slot=t.slot, incarnation=t.incarnation, before=t.before, after=t.after, reason=t.reason)
    assert bulk.records() == single.records()
    assert [list(r) for r in bulk.records()] == [list(r) for r in single.records()]  # same field order
    bulk.close()
    lines = [json.loads(x) for x in (tmp_path / "bulk.jsonl").read_text().splitlines()]
    assert lines == single.records() and lines[1]["before"] == "healthy"


def test_rows_kept_in_memory_read_as_the_records_emit_writes():
    rows = (Transition(0, 1, ShardState.HEALTHY, ShardState.STALE, "refit of version 2 landed"),
            Transition(3, 2, ShardState.STALE, ShardState.HEALTHY, "holds committed version 2"))
    lazy, single = EventLog(clock=lambda: 5.0), EventLog(clock=lambda: 5.0)
    for log in (lazy, single):
        log.emit("gate", open=False, version=1, reason="refit of version 2")
    lazy.emit_rows("health", rows)
    for t in rows:
        single.emit("health", slot=t.slot, incarnation=t.incarnation, before=t.before, after=t.after, reason=t.reason)
    assert len(lazy) == 3
    assert lazy.records(2) == single.records(2)  # read from past the first row: every row is made anyway
    for log in (lazy, single):
        log.emit("gate", open=True, version=2, reason="refit of version 2")
    lazy.emit_rows("health", rows[:1])
    single.emit("health", slot=0, incarnation=1, before=ShardState.HEALTHY, after=ShardState.STALE,
                reason="refit of version 2 landed")
    assert lazy.records() == single.records() and [r["seq"] for r in lazy.records()] == list(range(5))
    assert lazy.records(kinds=[Health]) == single.records(kinds=["health"])
    assert lazy.records()[1] is lazy.records()[1]  # made once


def test_the_fast_paths_write_what_the_general_rule_writes():
    for _ in range(2):  # the second time through the enum cache
        fields = dict(a=Colour.RED, b=Loud.A, c=Level.HIGH, d=[[1, Colour.RED]], e=(1, "s"), f={2: Colour.RED},
                      g=frozenset({Colour.RED}), h=None, i=True, j=1.5)
        rec = eventlog._record(1.0, 0, "x", fields.items())
        assert rec["a"] == "red" and rec["b"] == "LOUD" and rec["c"] is Level.HIGH
        assert (rec["d"], rec["e"], rec["f"], rec["g"]) == ([[1, "red"]], [1, "s"], {"2": "red"}, ["red"])
        assert (rec["h"], rec["i"], rec["j"]) == (None, True, 1.5)


class _Gauge:
    def __init__(self) -> None:
        self.sets: list[tuple[int, str]] = []

    def set(self, value, tags=None) -> None:
        self.sets.append((value, tags["state"]))


def test_metrics_count_states_from_the_ledger_and_set_only_what_changed():
    metrics = FleetMetrics(enabled=False)
    gauge = _Gauge()
    metrics._m = {"shards": gauge}
    ledger = _refitting(4)
    metrics.health(ledger)
    assert sorted(gauge.sets) == sorted((n, s.value) for s, n in ledger.state_counts().items())
    assert dict((s, n) for n, s in gauge.sets)["healthy"] == 4
    gauge.sets.clear()
    metrics.health(ledger)
    assert gauge.sets == []  # nothing changed, nothing set
    step(ledger, Observed(1, 1, CallKind.PAUSE, FailureClass.SUSPECT, "x"), 2.0)
    metrics.health(ledger)
    assert sorted(gauge.sets) == [(1, "suspect"), (3, "healthy")]


def test_a_slot_quarantined_again_in_one_batch_keeps_its_eviction_clock():
    ledger = _refitting(3, on_hang="stop")  # suspect_timeout_s = 30; a hung resume stays quarantined
    step(ledger, Observed(1, 1, CallKind.PAUSE, FailureClass.SUSPECT, "x"), 2.0)
    again = (Observed(1, 1, CallKind.PROBE, FailureClass.OK), Observed(1, 1, CallKind.RESUME, FailureClass.HUNG, "y"))
    step(ledger, Batch(again), 3.0)
    assert ledger.raw(1).since == 3.0
    assert (33.0, TIMER_ESCALATE, 1, 1, 3.0) in _live_timers(ledger)
    d = step(ledger, Tick(), 33.0)
    assert [t.after for t in d.transitions if t.slot == 1][0] in (ShardState.DEAD, ShardState.RESTARTING)
