"""Elastic size in the decision core (``health.resize``): the plan of a resize, slots added and removed
through ``decide``, the checkpoint landing at version 0, and that removing slots on purpose is never a
failure. No Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.health import (
    Batch,
    CallKind,
    CheckpointLoaded,
    CloseGate,
    Drain,
    EngineReady,
    FailureClass,
    HealthConfig,
    Ledger,
    Observed,
    RefitStarted,
    Retire,
    ShardState,
    SlotRemoved,
    SlotsAdded,
    StopExhausted,
    Tick,
    check_quorum,
    decide,
    plan_membership,
    plan_resize,
    step,
)
from rlfleet.health.testing import ready_fleet, refit

H, S, R = ShardState.HEALTHY, ShardState.STALE, ShardState.RETIRED


def cfg(n=3, min_healthy=2, **kw):
    return HealthConfig(num_engines=n, min_healthy_engines=min_healthy, restart_budget=kw.pop("budget", 2),
                        backoff_base_s=kw.pop("backoff", 0.0), backoff_cap_s=5.0, **kw)


def states(ledger):
    return [ledger.state(s) for s in range(ledger.num_slots)]


def grow(ledger, count, now=1.0):
    d = step(ledger, SlotsAdded(count), now)
    new = list(range(ledger.num_slots - count, ledger.num_slots))
    step(ledger, Batch(tuple(EngineReady(s, ledger.raw(s).incarnation) for s in new)), now)
    return d, new


# ------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("n", [0, -1, 1.5, "3", True, None])
def test_a_size_that_is_not_an_integer_of_at_least_one_is_refused_naming_it(n):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        plan_resize(ready_fleet(cfg()), n)


def test_a_size_below_min_healthy_engines_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"n=1 is below min_healthy_engines=2"):
        plan_resize(ready_fleet(cfg()), 1)


def test_resizing_to_the_size_it_has_changes_nothing():
    plan = plan_resize(ready_fleet(cfg()), 3)
    assert plan.unchanged and plan.current == plan.target == 3


def test_a_grow_adds_the_difference():
    plan = plan_resize(ready_fleet(cfg()), 5)
    assert (plan.add, plan.remove) == (2, ())


def test_a_shrink_removes_what_serves_least_then_the_highest_slots():
    ledger = ready_fleet(cfg(n=5, min_healthy=1))
    step(ledger, Observed(1, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 1.0)  # restarting (backoff 0)
    step(ledger, Observed(3, 1, CallKind.GENERATE, FailureClass.SUSPECT), 1.0)  # quarantined
    assert states(ledger) == [H, ShardState.RESTARTING, H, ShardState.SUSPECT, H]
    assert [s for s, _ in plan_resize(ledger, 4).remove] == [1]
    assert [s for s, _ in plan_resize(ledger, 3).remove] == [1, 3]
    assert plan_resize(ledger, 2).remove == ((1, 2), (3, 1), (4, 1))  # then the highest healthy slot
    # never below n serving: every non-serving slot goes before a serving one
    for n in range(1, 5):
        left = set(range(5)) - {s for s, _ in plan_resize(ledger, n).remove}
        assert sum(ledger.state(s) is H for s in left) == min(n, 3)


def test_a_slot_retired_by_failures_is_removed_first():
    ledger = ready_fleet(cfg(budget=0))
    step(ledger, Observed(0, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 1.0)
    assert ledger.state(0) is R
    assert plan_resize(ledger, 2).remove == ((0, 1),)


# ------------------------------------------------------------------------------ growing
def test_added_slots_start_then_are_stale_until_a_refit_lands():
    ledger = ready_fleet(cfg(), version=4)
    d = step(ledger, SlotsAdded(2, "resize to 5"), 1.0)
    assert ledger.num_slots == ledger.target_size == 5 and d.failure is FailureClass.OK
    assert [(t.slot, t.incarnation, t.after) for t in d.transitions] == [(3, 1, ShardState.STARTING),
                                                                         (4, 1, ShardState.STARTING)]
    assert "added by a resize (resize to 5)" in ledger.record(3).reason
    step(ledger, Batch((EngineReady(3, 1), EngineReady(4, 1))), 1.0)
    assert states(ledger)[3:] == [S, S] and ledger.serving_slots() == (0, 1, 2)
    assert step(ledger, Batch((CheckpointLoaded(3, 1),)), 1.0).transitions == ()  # version 4 is committed: no landing
    assert [p.slot for p in plan_membership(ledger).participants] == [0, 1, 2, 3, 4]  # they join the next refit
    refit(ledger, 5, 2.0)
    assert ledger.serving_slots() == (0, 1, 2, 3, 4)


def test_at_the_checkpoint_version_a_new_engine_serves_once_ready():
    ledger = ready_fleet(cfg(), version=0)
    _, new = grow(ledger, 1)
    assert ledger.state(3) is S
    d = step(ledger, CheckpointLoaded(3, 1), 1.0)
    assert ledger.state(3) is H and ledger.serving_slots() == (0, 1, 2, 3)
    assert [(t.before, t.after) for t in d.transitions] == [(S, H)]


def test_the_checkpoint_does_not_land_on_an_engine_not_ready_or_during_a_refit():
    ledger = ready_fleet(cfg(), version=0)
    step(ledger, SlotsAdded(1), 1.0)
    step(ledger, CheckpointLoaded(3, 1), 1.0)
    assert ledger.state(3) is ShardState.STARTING
    step(ledger, EngineReady(3, 1), 1.0)
    step(ledger, RefitStarted(1), 1.0)
    step(ledger, CheckpointLoaded(3, 1), 1.0)
    assert ledger.state(3) is S


def test_a_grown_slot_dies_and_restarts_like_any_other():
    ledger = ready_fleet(cfg(), version=0)
    grow(ledger, 1)
    d = step(ledger, Observed(3, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 2.0)
    assert ledger.raw(3).incarnation == 2 and ledger.state(3) is ShardState.RESTARTING
    assert any(type(a).__name__ == "Restart" for a in d.actions)


def test_growing_during_a_refit_or_by_nothing_is_refused_and_changes_nothing():
    ledger = ready_fleet(cfg())
    with pytest.raises(ValueError, match="integer >= 1"):
        decide(ledger, SlotsAdded(0), 1.0)
    step(ledger, RefitStarted(1), 1.0)
    with pytest.raises(ValueError, match="during the refit of version 1"):
        decide(ledger, SlotsAdded(1), 1.0)
    assert ledger.num_slots == 3


# ------------------------------------------------------------------------------ shrinking
def test_a_removed_slot_is_retired_drained_never_restarted_and_not_a_failure():
    ledger = ready_fleet(cfg())
    d = step(ledger, SlotRemoved(2, 1, "resize to 2"), 1.0)
    assert d.failure is FailureClass.OK and ledger.state(2) is R and ledger.raw(2).removed
    assert d.actions == (Drain(2, 1, ledger.raw(2).reason),)
    assert not any(isinstance(a, (Retire, StopExhausted, CloseGate)) for a in d.actions)
    assert "removed by a resize (was healthy): resize to 2" == ledger.raw(2).reason
    assert ledger.target_size == 2 and ledger.num_slots == 3 and ledger.serving_slots() == (0, 1)
    assert ledger.gate_open and check_quorum(ledger).ok and check_quorum(ledger).dead_slots == ()
    assert "2 of 2 engines" in check_quorum(ledger).message
    assert [p.slot for p in plan_membership(ledger).participants] == [0, 1]  # out of refits
    assert ledger.to_dict()["target_size"] == 2 and ledger.record(2).to_dict()["removed"] is True
    assert step(ledger, Observed(2, 1, CallKind.GENERATE, FailureClass.DEAD), 2.0).ignored  # late: nothing restarts


def test_a_dead_slot_removed_before_its_restart_is_due_never_restarts_and_needs_no_drain():
    ledger = ready_fleet(cfg(backoff=2.0))
    step(ledger, Observed(1, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 1.0)
    assert ledger.state(1) is ShardState.DEAD and ledger.next_wake_at() is not None
    d = step(ledger, SlotRemoved(1, 1), 1.5)
    assert d.actions == () and ledger.state(1) is R
    assert step(ledger, Tick(), 10.0).actions == () and ledger.raw(1).incarnation == 1


def test_shrinking_to_min_healthy_with_slots_retired_by_failure_never_stops_the_fleet():
    ledger = ready_fleet(cfg(n=4, budget=0))
    step(ledger, Observed(3, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 1.0)  # retired: budget 0
    for s, inc in plan_resize(ledger, 2).remove:
        d = step(ledger, SlotRemoved(s, inc), 2.0)
        assert not any(isinstance(a, StopExhausted) for a in d.actions) and not ledger.exhausted
    assert ledger.target_size == 2 and ledger.serving_count() == 2 and ledger.gate_open


def test_the_permanent_exhaustion_message_counts_the_target_size_not_removed_slots():
    ledger = ready_fleet(cfg(n=4, budget=0))
    step(ledger, SlotRemoved(3, 1), 1.0)
    step(ledger, Observed(0, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 2.0)
    d = step(ledger, Observed(1, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 2.0)
    stop = next(a for a in d.actions if isinstance(a, StopExhausted))
    assert "2 of 3 slots retired" in stop.message and stop.dead_slots == (0, 1)
    assert "slot 3" not in stop.message


def test_a_removal_below_min_healthy_or_during_a_refit_or_twice_is_refused_or_late():
    ledger = ready_fleet(cfg())
    step(ledger, SlotRemoved(2, 1), 1.0)
    with pytest.raises(ValueError, match="target size would fall to 1, below min_healthy_engines=2"):
        decide(ledger, SlotRemoved(1, 1), 1.0)
    assert decide(ledger, SlotRemoved(2, 1), 1.0).ignored
    with pytest.raises(ValueError, match="never issued"):
        decide(ledger, SlotRemoved(0, 7), 1.0)
    with pytest.raises(ValueError, match="slots 0..2"):
        decide(ledger, SlotRemoved(9, 1), 1.0)
    step(ledger, RefitStarted(1), 1.0)
    with pytest.raises(ValueError, match="during the refit"):
        decide(ledger, SlotRemoved(0, 1), 1.0)


def test_a_batch_of_removals_is_all_or_nothing():
    ledger = ready_fleet(cfg(n=4))
    with pytest.raises(ValueError, match="below min_healthy_engines"):
        decide(ledger, Batch((SlotRemoved(3, 1), SlotRemoved(2, 1), SlotRemoved(1, 1))), 1.0)
    assert ledger.target_size == 4
    d = step(ledger, Batch((SlotRemoved(3, 1), SlotRemoved(2, 1))), 1.0)
    assert [a.slot for a in d.actions] == [3, 2] and ledger.target_size == 2


def test_a_late_removal_of_a_replaced_incarnation_changes_nothing():
    ledger = ready_fleet(cfg())
    step(ledger, Observed(1, 1, CallKind.PROBE, FailureClass.DEAD, "gone"), 1.0)  # restarts as incarnation 2
    assert decide(ledger, SlotRemoved(1, 1), 1.0).ignored


def test_a_removed_slot_restored_from_an_intent_stays_removed():
    ledger = Ledger(cfg(n=4), now=0.0, adopted={0: (1, 0), 1: (2, 1), 3: (1, 0)}, removed={2: 3})
    assert ledger.raw(2).removed and ledger.raw(2).incarnation == 3 and ledger.state(2) is R
    assert ledger.target_size == 3 and ledger.state(1) is ShardState.RESTARTING
    with pytest.raises(ValueError, match="removed slot 1"):
        Ledger(cfg(n=4), adopted={1: (1, 0)}, removed={1: 1})


# ------------------------------------------------------------------------------ property: any mix of resizes and deaths
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["resize", "kill"]), st.integers(0, 7)), max_size=25))
def test_resizes_and_deaths_keep_the_target_size_and_never_stop_the_fleet_by_themselves(ops):
    ledger = ready_fleet(cfg(n=3, min_healthy=2, budget=50), version=0)
    now = 1.0
    for op, arg in ops:
        now += 1.0
        if op == "kill":
            slot = arg % ledger.num_slots
            step(ledger, Observed(slot, ledger.raw(slot).incarnation, CallKind.PROBE, FailureClass.DEAD), now)
            continue
        n = max(2, arg)
        plan = plan_resize(ledger, n)
        if plan.add:
            _, new = grow(ledger, plan.add, now)
            step(ledger, Batch(tuple(CheckpointLoaded(s, 1) for s in new)), now)
        if plan.remove:
            step(ledger, Batch(tuple(SlotRemoved(s, inc) for s, inc in plan.remove)), now)
        assert ledger.target_size == n
    step(ledger, Tick(), now + 100)  # every due restart launches
    assert not ledger.exhausted
    assert ledger.target_size == ledger.num_slots - len(ledger.removed_slots())
    assert ledger.removed_slots() <= ledger.slots_in(ledger.raw(0).phase.__class__.RETIRED)
    assert not set(ledger.serving_slots()) & ledger.removed_slots()
