"""The proof of the ``spare-promotion`` matrix variant (``faults.promotion``): it passes on the log of a real
(fake-door) controller whose spare replaced a killed serving slot, and each of its conditions, broken in that
log, fails it with its own sentence. Also the bench's time to full serving capacity."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.faults.promotion import capacity_restored_s, prove_promotion
from tests.unit.fleet_fakes import run_virtual
from tests.unit.test_spares import RESTART_S, started
from rlfleet.fleet.records import Fault, Gate, Health, Promote, Restart, Routing, Stamp


@pytest.fixture
def log(model_dir):
    """A fleet of 2 serving + 1 spare (min 2): slot 0 killed between refits, the spare promoted, slot 0 restarted
    (taking RESTART_S), then a refit that lands on it: the controller's own event log."""
    async def go():
        ctl, door = await started(model_dir, slow_restarts=(0,))
        await ctl.sync_weights(1)
        await ctl.kill_shard(0)
        await asyncio.sleep(RESTART_S + 2)
        await ctl.sync_weights(2)
        events = ctl.events()
        await ctl.shutdown()
        return events

    return run_virtual(go())


def position(events, pred):
    return next(i for i, e in enumerate(events) if pred(e))


def without(events, pred):
    return [e for e in events if not pred(e)]


def first(events, pred):
    return next(e for e in events if pred(e))


def test_the_log_of_a_spare_that_replaced_a_killed_slot_proves_it(log):
    assert prove_promotion(log, 0) == []
    assert capacity_restored_s(log, 0, 2) is not None and capacity_restored_s(log, 0, 2) < RESTART_S


def test_without_the_kill_nothing_is_proven(log):
    broken = without(log, lambda e: Fault.matches(e))
    assert prove_promotion(broken, 0) == ["no kill of slot 0 fired: the event log has no step-boundary 'fault' record of it"]
    assert prove_promotion(log, 1)[0].startswith("no kill of slot 1 fired")  # a kill of another slot proves nothing
    assert capacity_restored_s(broken, 0, 2) is None


def test_a_kill_never_recorded_dead_fails(log):
    broken = without(log, lambda e: Health.matches(e) and e["slot"] == 0 and e["after"] == "dead")
    assert [p for p in prove_promotion(broken, 0) if "never recorded dead" in p]


def test_no_promotion_fails(log):
    broken = without(log, lambda e: Promote.matches(e))
    assert prove_promotion(broken, 0) == [f"no spare was promoted in place of slot 0 after its kill at "
                                          f"t={first(log, lambda e: Fault.matches(e))['t']:.3f}"]


def test_a_promotion_routing_never_followed_fails(log):
    promo = first(log, lambda e: Promote.matches(e))
    broken = without(log, lambda e: Routing.matches(e) and e["t"] >= promo["t"] and "members" in e
                     and [2, 1] in e["members"])
    assert [p for p in prove_promotion(broken, 0) if "no routing state after it sends traffic to it" in p]


def test_routing_that_changed_only_after_the_restart_finished_fails(log):
    end = first(log, lambda e: Restart.matches(e) and e.get("edge") == "end" and e["slot"] == 0)
    broken = without(log, lambda e: e is end)
    broken.insert(position(broken, lambda e: Promote.matches(e)) + 1, end)  # it ended before clients saw the spare
    assert [p for p in prove_promotion(broken, 0) if "not before slot 0's restart finished" in p]


def test_a_slot_that_never_restarted_fails(log):
    broken = without(log, lambda e: Restart.matches(e) and e.get("edge") == "end")
    assert prove_promotion(broken, 0) == ["slot 0 never finished a restart after its kill: it cannot have become "
                                          "the spare"]


def test_a_gate_that_closed_before_the_spare_served_fails(log):
    k = position(log, lambda e: Fault.matches(e))
    broken = log[:k + 1] + [Gate(t=log[k]["t"], open=False, version=1, reason="below quorum between refits").as_dict()] + log[k + 1:]
    assert [p for p in prove_promotion(broken, 0) if "the gate closed at" in p]


def test_a_restarted_slot_no_refit_landed_on_is_not_a_warm_spare(log):
    broken = without(log, lambda e: Stamp.matches(e) and [0, 2] in e["members"])
    assert prove_promotion(broken, 0) == ["slot 0 incarnation 2 restarted but no refit landed on it: not a warm spare"]


def test_a_restarted_slot_that_serves_again_is_not_the_spare(log):
    stamp = first(log, lambda e: Stamp.matches(e) and [0, 2] in e["members"])
    back = [Promote(t=stamp["t"] + 1e-4, slot=0, incarnation=2, replaced=1, replaced_incarnation=1, reason="slot 1 is dead", serving=[]).as_dict(),
            Routing(t=stamp["t"] + 2e-4, epoch=99, gate_open=True, version=2, stopped=False, members=[[0, 2], [2, 1]]).as_dict()]
    s = position(log, lambda e: e is stamp)
    problems = prove_promotion(log[:s + 1] + back + log[s + 1:], 0)
    assert [p for p in problems if "was promoted again" in p] and [p for p in problems if "must serve nothing" in p]


def test_capacity_counts_only_states_without_the_killed_engine_and_with_the_gate_open(log):
    k = position(log, lambda e: Fault.matches(e))
    full = capacity_restored_s(log, 0, 2)
    promoted = first(log[k:], lambda e: Routing.matches(e) and "members" in e)
    assert sorted(promoted["members"]) == [[1, 1], [2, 1]] and full == round(promoted["t"] - log[k]["t"], 3)
    assert full > 0  # the monitor found the death a probe interval after the kill
    assert capacity_restored_s(log, 0, 3) is None  # three never serve: one is a spare
