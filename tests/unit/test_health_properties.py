"""Property tests: random event sequences (deaths, unavailability, hangs, lies,
probe results, restarts, refit outcomes and cycles, late events from replaced
incarnations, clock advances) against random configurations. After every event the
invariants of DESIGN.md are checked against direct counts over the snapshot and
against a record of what the test itself fed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.health import (
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    Ledger,
    MembershipPlan,
    Observed,
    OpenGate,
    RefitFinished,
    RefitReport,
    RefitResult,
    RefitStarted,
    Restart,
    ShardState,
    SlotPhase,
    StopExhausted,
    Tick,
    VersionCommitted,
    check_quorum,
    decide,
    plan_membership,
)

CALLS = list(CallKind)
LIFECYCLE = {CallKind.PAUSE, CallKind.REFIT, CallKind.RESUME}
FAILURES = [f for f in FailureClass if f is not FailureClass.EXHAUSTED]
GONE = {ShardState.DEAD, ShardState.RETIRED}
LIVE_STATES = {ShardState.HEALTHY, ShardState.STALE}

OP_KINDS = ["observe", "observe", "observe", "probe", "probe", "ready", "ready_all", "report",
            "late", "refit_start", "commit", "finish", "refit_cycle", "refit_cycle", "tick",
            "tick", "advance"]


@st.composite
def configs(draw) -> HealthConfig:
    n = draw(st.integers(1, 6))
    base = draw(st.sampled_from([0.0, 0.5, 2.0]))
    return HealthConfig(
        num_engines=n,
        min_healthy_engines=draw(st.integers(1, n)),
        unhealthy_threshold=draw(st.integers(1, 3)),
        suspect_timeout_s=draw(st.sampled_from([1.0, 5.0, 20.0])),
        restart_budget=draw(st.integers(0, 3)),
        backoff_base_s=base,
        backoff_cap_s=base * draw(st.sampled_from([1, 4])),
        on_hang=draw(st.sampled_from(["evict", "stop"])),
    )


ops = st.lists(
    st.tuples(
        st.sampled_from(OP_KINDS),
        st.integers(0, 5),                      # slot (mod fleet size)
        st.sampled_from(CALLS),
        st.sampled_from(FAILURES),
        st.sampled_from(list(RefitResult)),
        st.integers(0, 2),                      # version offset / incarnation lag
        st.sampled_from([0.0, 0.3, 1.0, 4.0, 25.0]),  # clock advance
    ),
    min_size=10,
    max_size=80,
)
# Most runs begin from a serving fleet (every slot ready, one refit done), so the
# random part spends its events on a fleet that has something to lose.
WARM_START = [("ready_all", 0, CallKind.GENERATE, FailureClass.OK, RefitResult.COMPLETE, 0, 0.0),
              ("refit_cycle", 0, CallKind.GENERATE, FailureClass.OK, RefitResult.COMPLETE, 0, 0.0)]
warm = st.sampled_from([True, True, True, False])


@dataclass
class Model:
    """What the test knows independently of the ledger."""

    now: float = 0.0
    ever_gone: set[tuple[int, int]] = field(default_factory=set)
    last_weights: dict[tuple[int, int], object] = field(default_factory=dict)
    incarnations: dict[int, int] = field(default_factory=dict)
    plan: MembershipPlan = field(default_factory=MembershipPlan.initial)


def make_events(ledger: Ledger, model: Model, op) -> list:
    """Turn one drawn op into the events a controller could send now."""
    kind, slot, call, failure, result, offset, dt = op
    slot %= ledger.num_slots
    inc = ledger.raw(slot).incarnation
    refit, current = ledger.refit_version, ledger.current_version
    next_version = (current + 1 if current is not None else 0) + offset
    if kind == "observe":
        return [Observed(slot, inc, call, failure, "random")]
    if kind == "probe":
        probe = FailureClass.OK if offset else failure
        return [Observed(slot, inc, CallKind.PROBE, probe, "random probe")]
    if kind == "ready":
        return [EngineReady(slot, inc)]
    if kind == "ready_all":
        return [EngineReady(s, ledger.raw(s).incarnation) for s in range(ledger.num_slots)]
    if kind == "report":
        base = refit if refit is not None else (current if current is not None else 0)
        return [RefitReport(slot, inc, base + offset % 2, result)]
    if kind == "late" and inc - 1 - offset >= 1:
        return [Observed(slot, inc - 1 - offset, call, failure, "late")]
    if kind == "refit_start" and refit is None:
        return [RefitStarted(next_version)]
    if kind == "commit" and refit is not None and ledger.fleet.halted is None \
            and current != refit:
        return [VersionCommitted(refit)]
    if kind == "finish" and refit is not None:
        return [RefitFinished(refit)]
    if kind == "refit_cycle":
        return refit_cycle(ledger, slot, result, next_version if refit is None else refit)
    model.now += dt
    if kind == "advance":
        return [Observed(slot, inc, CallKind.GENERATE, FailureClass.OK)]
    return [Tick()]


def refit_cycle(ledger: Ledger, odd_slot: int, odd_result: RefitResult, version: int) -> list:
    """A whole refit as the controller runs it: start, one report per live slot
    (``odd_slot`` gets ``odd_result``, the rest COMPLETE), commit, finish. Events the
    ledger would refuse (commit after an abort) are left out, as a controller would."""
    events: list = [] if ledger.refit_version is not None else [RefitStarted(version)]
    for r in ledger.records():
        if r.state in LIVE_STATES:
            res = odd_result if r.slot == odd_slot else RefitResult.COMPLETE
            events.append(RefitReport(r.slot, r.incarnation, version, res))
    if ledger.fleet.halted is None and ledger.current_version != version:
        events.append(VersionCommitted(version))
    events.append(RefitFinished(version))
    return events


def record_feed(model: Model, event, decision) -> None:
    """Remember what weights each incarnation was told about (accepted events only)."""
    if decision.ignored:
        return
    if isinstance(event, RefitReport) and event.result is RefitResult.COMPLETE:
        model.last_weights[(event.slot, event.incarnation)] = event.version
    elif isinstance(event, RefitReport) and event.result is RefitResult.PARTIAL:
        model.last_weights[(event.slot, event.incarnation)] = "partial"
    elif isinstance(event, Observed) and event.call in LIFECYCLE and \
            event.failure in (FailureClass.LIED, FailureClass.ERROR):
        model.last_weights[(event.slot, event.incarnation)] = "spoiled"


def check_decision(ledger: Ledger, model: Model, event, decision, before: dict) -> None:
    # Deciding alone never changes the ledger.
    assert ledger.to_dict() == before
    for t in decision.transitions:
        if t.after in GONE:
            model.ever_gone.add((t.slot, t.incarnation))
    if decision.ignored:
        assert decision.actions == () and not decision.changes_ledger
    # Unavailability outside probes never condemns on its own, except a resume nobody acknowledged
    # under on_hang=evict (that engine is killed: no probe can tell whether it resumed).
    evicted_resume = event.call is CallKind.RESUME and ledger.config.on_hang == "evict" \
        if isinstance(event, Observed) else False
    if isinstance(event, Observed) and event.failure is FailureClass.SUSPECT \
            and event.call not in (CallKind.PROBE, CallKind.START) and not evicted_resume:
        assert not any(t.after in GONE | {ShardState.RESTARTING} for t in decision.transitions)
    for action in decision.actions:
        if isinstance(action, Restart):
            assert action.incarnation == action.previous_incarnation + 1


def check_ledger(ledger: Ledger, model: Model, decision, before: dict) -> None:
    records = ledger.records()
    config = ledger.config
    cv = ledger.current_version
    if decision.ignored:
        assert ledger.to_dict() == before, "a late event changed the ledger"
    for r in records:
        if r.state in GONE:
            model.ever_gone.add((r.slot, r.incarnation))
        # Incarnations only grow; a dead incarnation never lives again.
        assert r.incarnation >= model.incarnations.get(r.slot, r.incarnation)
        model.incarnations[r.slot] = r.incarnation
        if r.state not in GONE:
            assert (r.slot, r.incarnation) not in model.ever_gone, r
        # A shard serves only on the current version, which landed on it.
        if r.state is ShardState.HEALTHY:
            assert cv is not None and r.weight_version == cv and not r.partial
            assert model.last_weights.get((r.slot, r.incarnation)) == cv, r
    serving = sorted(r.slot for r in records if r.state is ShardState.HEALTHY)
    dead = tuple(sorted(r.slot for r in records if r.state in GONE))
    assert list(ledger.serving_slots()) == serving
    # Quorum agrees with a direct count.
    q = check_quorum(ledger)
    assert (q.serving, q.ok, q.dead_slots) == (
        len(serving), len(serving) >= config.min_healthy_engines, dead)
    if not q.ok:
        for r in records:
            if r.state in GONE:
                assert f"slot {r.slot} (incarnation {r.incarnation}): {r.reason}" in q.message
    for action in decision.actions:
        if isinstance(action, StopExhausted):
            assert action.dead_slots == dead
            for r in records:
                if r.state in GONE:
                    assert f"slot {r.slot} (incarnation {r.incarnation})" in action.message
        if isinstance(action, OpenGate):
            assert action.version == cv and len(serving) >= config.min_healthy_engines
    assert not (ledger.gate_open and ledger.refit_version is not None)
    # Epochs never decrease and change exactly when the participant set changes.
    plan = plan_membership(ledger, model.plan)
    live = {(r.slot, r.incarnation) for r in records if r.state in LIVE_STATES}
    assert plan.members == live
    assert plan.epoch >= model.plan.epoch
    assert (plan.epoch != model.plan.epoch) == (plan.members != model.plan.members)
    assert [p.rank for p in plan.participants] == list(range(1, len(live) + 1))
    model.plan = plan


def check_timers(ledger: Ledger, event) -> None:
    """After a tick nothing is overdue: no frozen shard outlives suspect_timeout_s
    during a refit, and no restart waits past its backoff."""
    if not isinstance(event, (Tick, RefitStarted)):
        return
    now, timeout = ledger.now, ledger.config.suspect_timeout_s
    for slot in range(ledger.num_slots):
        r = ledger.raw(slot)
        if ledger.refit_version is not None and r.phase in (SlotPhase.SUSPECT, SlotPhase.HUNG):
            assert r.since + timeout > now, r  # the arithmetic of the escalation timer
        if isinstance(event, Tick) and r.phase is SlotPhase.DEAD:
            assert r.restart_at > now, r


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), script=ops, warm_start=warm)
def test_random_event_sequences_keep_every_invariant(config, script, warm_start):
    ledger = Ledger(config)
    model = Model()
    for op in (WARM_START if warm_start else []) + script:
        for event in make_events(ledger, model, op):
            before = ledger.to_dict()
            decision = decide(ledger, event, model.now)
            check_decision(ledger, model, event, decision, before)
            ledger.apply(decision)
            record_feed(model, event, decision)
            check_ledger(ledger, model, decision, before)
            check_timers(ledger, event)


@settings(max_examples=100, deadline=None)
@given(config=configs(), script=ops, warm_start=warm)
def test_replaying_the_same_events_gives_the_same_decisions(config, script, warm_start):
    """The core is deterministic: same events and times, same decisions."""
    first, second = Ledger(config), Ledger(config)
    model = Model()
    for op in (WARM_START if warm_start else []) + script:
        for event in make_events(first, model, op):
            a = decide(first, event, model.now)
            b = decide(second, event, model.now)
            assert (a.actions, a.transitions, a.reason, a.failure) == (
                b.actions, b.transitions, b.reason, b.failure)
            first.apply(a)
            second.apply(b)
    assert first.to_dict() == second.to_dict()
