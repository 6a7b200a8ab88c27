"""The proof of the matrix variant ``long-refit-keeps-admission-caps`` (``faults.admission_hold``) fails when any
part of its point is missing: a refit that did not commit, a silence too short to have fallen back, a cap that
changed (what the law that read a paused engine's silence as absence did), a fallback counted, a held request
lost."""

from __future__ import annotations

from rlfleet.faults.admission_hold import prove_admission_hold_across_refit, silent_spans
from rlfleet.faults.evidence import LEADS_TO
from rlfleet.fleet.records import RefitHeld
from rlfleet.health.faultplan import ALLOWED

CALL = {"version": 1, "outcome": "committed", "error": None, "began": 100.0, "ended": 110.0}
HELD = [RefitHeld(version=1, requests=12, by_slot={"0": 6, "1": 6})]  # the refit's record of what it held


def samples(slot=0, silent=(101.0, 106.0), in_flight=6, step=0.2):
    """Samples of ``slot`` every ``step`` s from 100 to 110, its stats missing within ``silent``; slot 1 fresh."""
    out, t = [], 100.0
    while t <= 110.0:
        missing = silent[0] <= t <= silent[1]
        out.append({"t": round(t, 3), "slot": slot, "data": "missing" if missing else "fresh",
                    "rule": "paused" if missing else "refit", "cap": 64, "in_flight": in_flight})
        out.append({"t": round(t, 3), "slot": 1, "data": "fresh", "rule": "refit", "cap": 64, "in_flight": 6})
        t += step
    return out


def record(**over):
    f = {"calls": [CALL], "slowed": 1, "caps_before": {0: 64, 1: 64}, "caps_after": {0: 64, 1: 64},
         "capacity_before": {0: 64, 1: 64},
         "fallbacks_before": {0: 0, 1: 0}, "fallbacks_after": {0: 0, 1: 0}, "samples": samples(),
         "held": [{"ok": True, "reason": None}] * 12, "absent_fallback_s": 3.0, "fallback_cap": 4}
    f.update(over)
    return f


def test_a_refit_that_kept_every_cap_across_a_long_silence_passes():
    assert ALLOWED["admission_hold_across_refit"] == ("call",) and LEADS_TO["admission_hold_across_refit"]
    assert prove_admission_hold_across_refit(record(), [CALL], HELD) == []


def test_the_silence_is_the_longest_run_of_missing_samples_with_requests_in_flight():
    spans = silent_spans(samples(silent=(101.0, 106.0)) + samples(slot=2, in_flight=0))
    assert round(spans[0], 1) == 4.8 and 1 not in spans and 2 not in spans  # idle or fresh: never silent


def test_caps_that_fell_back_across_the_refit_fail_naming_them():
    fell = record(caps_after={0: 4, 1: 64}, fallbacks_after={0: 1, 1: 0})
    problems = prove_admission_hold_across_refit(fell, [CALL], HELD)
    assert any("caps changed across the refit" in p and "0: (64, 4)" in p for p in problems), problems
    assert any("fell back to fallback_cap 4" in p and "{0: 1}" in p for p in problems), problems


def test_a_cap_below_its_capacity_before_may_grow_back_but_not_past_it_nor_fall():
    grew = record(caps_before={0: 64, 1: 4}, caps_after={0: 64, 1: 5})  # slot 1 fell back before the variant
    assert prove_admission_hold_across_refit(grew, [CALL], HELD) == []
    past = record(caps_before={0: 64, 1: 4}, caps_after={0: 64, 1: 80})
    assert "1: (4, 80)" in prove_admission_hold_across_refit(past, [CALL], HELD)[0]
    at_capacity_grew = record(caps_after={0: 80, 1: 64})
    assert "0: (64, 80)" in prove_admission_hold_across_refit(at_capacity_grew, [CALL], HELD)[0]


def test_a_silence_shorter_than_the_absence_bound_proves_nothing():
    short = record(samples=samples(silent=(101.0, 103.0)))
    [problem] = prove_admission_hold_across_refit(short, [CALL], HELD)
    assert "the fault did not fire" in problem
    none_held = prove_admission_hold_across_refit(record(), [CALL], [RefitHeld(version=1, requests=0, by_slot={})])
    assert none_held == ["the refit of version 1 held no request across its pause ({}): the fault proved nothing"]
    at_floor = record(caps_before={0: 4, 1: 64}, caps_after={0: 4, 1: 64})  # nothing to lose
    [problem] = prove_admission_hold_across_refit(at_floor, [CALL], HELD)
    assert "the fault did not fire" in problem


def test_a_refit_that_did_not_commit_or_a_lost_request_fails():
    stopped = {**CALL, "outcome": "stopped", "error": "FleetStopped: x"}
    assert prove_admission_hold_across_refit(record(calls=[stopped]), [stopped], HELD) == [
        "the refit did not commit: stopped: FleetStopped: x"]
    lost = record(held=[{"ok": True, "reason": None}] * 11 + [{"ok": False, "reason": "returned"}])
    [problem] = prove_admission_hold_across_refit(lost, [CALL], HELD)
    assert problem.startswith("1 of 12 held request(s) did not complete")
