"""Liveness as progress (``health.progress``): driven by events and a clock, no engine."""

from __future__ import annotations

import pytest

from rlfleet.health.clock import FakeClock
from rlfleet.health.progress import ProgressFacts, ProgressWatch, stall_verdict

BOUND = 10.0


def watch_at(t=0.0, **kw):
    clock = FakeClock(t)
    return ProgressWatch(clock.now(), **kw), clock


def test_work_with_no_token_past_the_bound_is_a_stall_naming_the_numbers():
    w, clock = watch_at(100.0)
    w.busy(2, clock.now())
    clock.advance(10.5)
    facts = w.facts(2, clock.now())
    assert facts.stalled_s == pytest.approx(10.5)
    why = stall_verdict(facts, BOUND)
    assert "10.5 s" in why and "2 request(s) in flight" in why and "stall_timeout_s=10" in why


def test_tokens_keep_it_alive_and_the_clock_counts_from_the_last_one():
    w, clock = watch_at()
    w.busy(1, clock.now())
    for _ in range(5):
        clock.advance(8.0)
        w.stepped(clock.now(), tokens=1)
        assert stall_verdict(w.facts(1, clock.now()), BOUND) is None
    clock.advance(10.1)
    assert stall_verdict(w.facts(1, clock.now()), BOUND) is not None


def test_steps_that_produce_no_token_are_not_progress():
    w, clock = watch_at()
    w.busy(1, clock.now())
    for _ in range(11):
        clock.advance(1.0)
        w.stepped(clock.now(), tokens=0)
    assert stall_verdict(w.facts(1, clock.now()), BOUND) is not None


def test_an_idle_engine_is_never_stalled_and_work_arriving_after_a_long_idle_starts_a_fresh_clock():
    w, clock = watch_at()
    w.stepped(clock.now(), tokens=3)
    clock.advance(3600.0)
    assert w.facts(0, clock.now()).stalled_s == 0.0
    w.busy(1, clock.now())
    clock.advance(1.0)
    assert w.facts(1, clock.now()).stalled_s == pytest.approx(1.0)
    w.busy(0, clock.now())  # done; the next request starts its own clock
    clock.advance(50.0)
    w.busy(1, clock.now())
    assert w.facts(1, clock.now()).stalled_s == 0.0


def test_a_hold_stops_the_clock_and_its_release_restarts_it():
    w, clock = watch_at()
    w.busy(3, clock.now())
    w.hold("paused", clock.now())
    clock.advance(60.0)
    facts = w.facts(3, clock.now())
    assert facts.held == "paused" and facts.stalled_s == 0.0 and stall_verdict(facts, BOUND) is None
    w.release("paused", clock.now())
    clock.advance(2.0)
    assert w.facts(3, clock.now()).stalled_s == pytest.approx(2.0)


def test_nested_holds_release_one_by_one_and_an_unmatched_release_is_refused():
    w, clock = watch_at()
    w.busy(1, clock.now())
    w.hold("worker_rpc", clock.now())
    w.hold("worker_rpc", clock.now())
    w.release("worker_rpc", clock.now())
    assert w.facts(1, clock.now()).held == "worker_rpc"
    w.release("worker_rpc", clock.now())
    assert w.facts(1, clock.now()).held is None
    with pytest.raises(ValueError, match="release\\('paused'\\) without a matching hold"):
        w.release("paused", clock.now())


def test_a_backend_without_step_marks_says_nothing_and_is_never_condemned():
    w, clock = watch_at(steps=False)
    w.busy(4, clock.now())
    clock.advance(1000.0)
    facts = w.facts(4, clock.now())
    assert facts.stalled_s is None and stall_verdict(facts, BOUND) is None


def test_verdict_reads_plain_dicts_and_ignores_missing_facts():
    assert stall_verdict(None, BOUND) is None
    assert stall_verdict({}, BOUND) is None
    assert stall_verdict({"in_flight": 1, "stalled_s": 11.0, "held": None}, BOUND) is not None
    assert stall_verdict({"in_flight": 0, "stalled_s": 11.0}, BOUND) is None
    assert stall_verdict(ProgressFacts(1, 11.0, None, "worker_rpc"), BOUND) is None
    assert stall_verdict(ProgressFacts(1, 10.0, None, None), BOUND) is None  # at the bound: not yet


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_a_bad_bound_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="bound_s"):
        stall_verdict({"in_flight": 1, "stalled_s": 99.0}, bad)


def test_bad_arguments_are_refused_naming_them():
    w, clock = watch_at()
    with pytest.raises(ValueError, match="in_flight"):
        w.busy(-1, clock.now())
    with pytest.raises(ValueError, match="now"):
        w.busy(1, float("nan"))
