"""Quorum judgement and its exhausted message; permanent exhaustion after
retirements; membership planning (participants, ranks, epochs); ledger snapshots."""

from __future__ import annotations

import json

import pytest

from rlfleet.health import (
    TRAINER_RANK,
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    Ledger,
    MembershipPlan,
    Observed,
    Participant,
    RefitResult,
    StopExhausted,
    Tick,
    check_quorum,
    plan_membership,
    step,
)
from rlfleet.health.testing import ready_fleet, refit

GENERATE = CallKind.GENERATE


def config(**overrides) -> HealthConfig:
    values = dict(num_engines=4, min_healthy_engines=2, unhealthy_threshold=2,
                  suspect_timeout_s=10.0, restart_budget=1, backoff_base_s=5.0, backoff_cap_s=5.0)
    values.update(overrides)
    return HealthConfig(**values)


def died(ledger, slot, now, why="ActorDiedError: boom"):
    inc = ledger.record(slot).incarnation
    return step(ledger, Observed(slot, inc, GENERATE, FailureClass.DEAD, why), now)


# --------------------------------------------------------------------- quorum


def test_quorum_holds_with_enough_serving_engines():
    ledger = ready_fleet(config())
    died(ledger, 0, 1.0)
    died(ledger, 1, 1.0)
    q = check_quorum(ledger)
    assert q.ok and (q.serving, q.needed) == (2, 2) and q.dead_slots == (0, 1)
    assert "quorum holds: 2 of 4" in q.message


def test_failed_quorum_names_every_dead_and_retired_slot_and_why():
    ledger = ready_fleet(config(restart_budget=0))
    step(ledger, Observed(0, 1, GENERATE, FailureClass.SUSPECT), 1.0)
    died(ledger, 2, 1.0, "ActorDiedError: node 7 preempted")
    died(ledger, 3, 1.0, "ActorDiedError: CUDA OOM")
    q = check_quorum(ledger)
    assert not q.ok and (q.serving, q.needed) == (1, 2) and q.dead_slots == (2, 3)
    for text in ("fleet exhausted: 1 of 4 engines serve weight version 0",
                 "slot 2 (incarnation 1)", "node 7 preempted",
                 "slot 3 (incarnation 1)", "CUDA OOM", "restart budget spent",
                 "Not serving: suspect slot 0 (incarnation 1)", "Gate stays closed"):
        assert text in q.message, text


def test_quorum_threshold_can_be_overridden_and_is_validated():
    ledger = ready_fleet(config())
    assert check_quorum(ledger, 4).ok and not check_quorum(ledger, 4).dead_slots
    died(ledger, 0, 1.0)
    assert not check_quorum(ledger, 4).ok
    with pytest.raises(ValueError, match=r"between 1 and num_engines \(4\), got 5"):
        check_quorum(ledger, 5)


def test_a_fresh_fleet_has_no_quorum_until_its_first_refit():
    ledger = Ledger(config())
    for s in range(4):
        step(ledger, EngineReady(s, 1), 0.0)
    assert not check_quorum(ledger).ok
    refit(ledger, 0, 1.0)
    assert check_quorum(ledger).ok


def test_retirements_that_make_quorum_unreachable_stop_once():
    ledger = ready_fleet(config(num_engines=3, min_healthy_engines=2, restart_budget=0))
    assert not any(isinstance(a, StopExhausted) for a in died(ledger, 1, 1.0).actions)
    d = died(ledger, 2, 2.0, "ActorDiedError: second loss")
    [stop] = [a for a in d.actions if isinstance(a, StopExhausted)]
    assert d.failure is FailureClass.EXHAUSTED and ledger.exhausted and not ledger.gate_open
    assert stop.dead_slots == (1, 2) and (stop.serving, stop.needed) == (1, 2)
    assert "2 of 3 slots retired" in stop.message and "second loss" in stop.message
    later = died(ledger, 0, 3.0)
    assert not any(isinstance(a, StopExhausted) for a in later.actions)


def test_deaths_with_restarts_pending_are_not_permanent_exhaustion():
    ledger = ready_fleet(config(num_engines=2, min_healthy_engines=2, restart_budget=3))
    d = died(ledger, 0, 1.0)
    assert not any(isinstance(a, StopExhausted) for a in d.actions) and not ledger.exhausted


# ----------------------------------------------------------------- membership


def test_plan_lists_live_slots_with_ranks_after_the_trainer():
    ledger = ready_fleet(config())
    step(ledger, Observed(1, 1, GENERATE, FailureClass.SUSPECT), 1.0)
    plan = plan_membership(ledger)
    assert TRAINER_RANK == 0
    assert plan.participants == (Participant(0, 1, 1), Participant(2, 1, 2), Participant(3, 1, 3))
    assert plan.epoch == 1 and plan.world_size == 4
    assert plan.rank_of(2) == 2 and plan.rank_of(1) is None


def test_stale_slots_join_refits():
    ledger = ready_fleet(config())
    refit(ledger, 1, 1.0, {3: RefitResult.NOT_STARTED})
    assert ledger.state(3).value == "stale"
    assert 3 in {p.slot for p in plan_membership(ledger).participants}


def test_epoch_is_unchanged_when_the_participant_set_is_the_same():
    ledger = ready_fleet(config())
    first = plan_membership(ledger)
    step(ledger, Observed(1, 1, GENERATE, FailureClass.SUSPECT), 1.0)
    step(ledger, Observed(1, 1, CallKind.PROBE, FailureClass.OK), 2.0)
    refit(ledger, 1, 3.0)  # weights change, membership does not
    again = plan_membership(ledger, first)
    assert again.epoch == first.epoch and again == first


def test_epoch_increases_when_a_member_leaves_and_when_it_returns_as_a_new_incarnation():
    ledger = ready_fleet(config(backoff_base_s=0.0, backoff_cap_s=0.0))
    plans = [plan_membership(ledger)]
    died(ledger, 2, 1.0)  # restarts at once as incarnation 2 (launching, not live)
    plans.append(plan_membership(ledger, plans[-1]))
    step(ledger, EngineReady(2, 2), 2.0)
    plans.append(plan_membership(ledger, plans[-1]))
    assert [p.epoch for p in plans] == [1, 2, 3]
    assert (2, 1) in plans[0].members and (2, 2) in plans[2].members
    assert {s for s, _ in plans[1].members} == {0, 1, 3}


def test_planning_does_not_change_the_ledger_and_checks_its_input():
    ledger = ready_fleet(config())
    before = ledger.to_dict()
    plan_membership(ledger, MembershipPlan.initial())
    assert ledger.to_dict() == before
    with pytest.raises(TypeError, match="MembershipPlan or None"):
        plan_membership(ledger, 3)


def test_empty_fleet_plan_keeps_the_initial_epoch():
    assert plan_membership(Ledger(config())) == MembershipPlan.initial()


# ------------------------------------------------------------------ snapshots


def test_snapshot_is_json_ready_and_says_why_each_slot_is_where_it_is():
    ledger = ready_fleet(config())
    died(ledger, 1, 1.0, "ActorDiedError: segfault")
    snap = json.loads(json.dumps(ledger.to_dict()))
    assert snap["current_version"] == 0 and snap["serving"] == 3 and snap["gate_open"]
    slot1 = snap["slots"][1]
    assert slot1["state"] == "dead" and "segfault" in slot1["reason"] and slot1["restart_at"] == 6.0
    assert ledger.record(1).to_dict() == slot1
    assert ledger.serving_slots() == (0, 2, 3)
    assert ledger.next_wake_at() == 6.0
    step(ledger, Tick(), 6.0)
    assert ledger.to_dict()["slots"][1]["state"] == "restarting"


def test_reading_a_missing_slot_names_the_range():
    with pytest.raises(ValueError, match=r"slot 9 does not exist: the fleet has slots 0\.\.3"):
        ready_fleet(config()).record(9)
