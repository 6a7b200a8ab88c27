"""The proof of the ``resize-under-load`` variant (``faults.resize_evidence``) on hand-made records: a run
that did everything passes, and each condition broken on its own fails the variant with its sentence.
No Ray."""

from __future__ import annotations

import copy

import pytest

from rlfleet.faults.evidence import prove
from rlfleet.faults.runner import VariantReport, judge
from rlfleet.health.faultplan import load_plan
from rlfleet.fleet.records import Gate, Health, Phase, Record, Resize, Stamp

GROW = {"n": 4, "outcome": "ok", "error": None, "summary": {"added": [3]}, "began": 10.0, "ended": 20.0}
REFIT = {"version": 5, "outcome": "committed", "error": None, "began": 21.0, "ended": 23.0}
SHRINK = {"n": 3, "outcome": "ok", "error": None, "summary": {"removed": [3]}, "began": 30.0, "ended": 32.0}
DRAINED = {"incarnation": 1, "drained": True, "in_flight_at_removal": 2, "finished": 2, "aborted": 0,
           "admitted_at_removal": 40, "admitted_at_end": 40, "refused_after_removal": 3, "drain_s": 0.4,
           "shutdown": "ok", "told": "ok"}


def ev(t, kind: type[Record], **f):
    return kind(t=t, **f).as_dict()


def fired():
    return {"step": 1, "where": "call", "what": "resize_under_load", "slot": None, "delay_s": 0.0, "t": 0.5,
            "calls": [dict(REFIT)], "resizes": [copy.deepcopy(GROW), copy.deepcopy(SHRINK)], "size": 3,
            "added": [3], "removed": [3], "victim_busy": True,
            "new_engine": {"slot": 3, "incarnation": 1, "admitted_after_refit": 17, "completed_on_version": 12},
            "removed_state": {"3": {"slot": 3, "state": "retired", "removed": True}},
            "threads": 6, "submitted": 90, "completed": 90, "returned": []}


def events():
    return [
        ev(10.1, Resize, edge="begin", size_from=3, size_to=4, add=1, remove=[]),
        ev(19.0, Resize, edge="end", size_from=3, size_to=4, added=[3], removed=[], drained={}, serving=[0, 1, 2]),
        ev(21.0, Phase, phase="close", edge="begin", version=5),
        ev(21.1, Gate, open=False, version=4, reason="refit of version 5"),
        ev(22.0, Stamp, version=5, members=[[0, 1], [1, 1], [2, 1], [3, 1]], failed=[], unknown=[]),
        ev(22.5, Gate, open=True, version=5, reason="4 engine(s) serve version 5"),
        ev(30.1, Resize, edge="begin", size_from=4, size_to=3, add=0, remove=[3]),
        ev(30.2, Health, slot=3, incarnation=1, before="healthy", after="retired",
           reason="removed by a resize (was healthy): resize to 3 engines"),
        ev(31.0, Resize, edge="end", size_from=4, size_to=3, added=[], removed=[3], drained={"3": dict(DRAINED)},
           serving=[0, 1, 2]),
    ]


def verdict(f, evs):
    rep = judge(VariantReport("resize-under-load", "recovers", "recovers", accepted=90, completed=90), [f], evs, [])
    return rep


def test_the_variant_is_in_the_matrix_and_its_plan_is_valid():
    from rlfleet.faults.matrix import by_name

    [variant] = by_name(["resize-under-load"])
    plan = load_plan(variant.plan)
    assert [(f.where, f.what, f.shard) for f in plan.faults] == [("call", "resize_under_load", None)]


def test_a_run_that_did_everything_passes():
    rep = verdict(fired(), events())
    assert rep.passed and not rep.violations, rep.violations
    assert rep.faults[0]["left_for"] == "resized" and rep.fault_to_reopen_s == 1.5  # the refit began -> the gate reopened


def broken(change):
    f, evs = fired(), events()
    change(f, evs)
    rows, problems = prove([f], evs, [])
    assert rows[0]["left_for"] is None
    return problems


def _drop(evs, pred):
    evs[:] = [e for e in evs if not pred(e)]


CASES = {
    "the refit did not commit": (
        lambda f, evs: f["calls"][0].update(outcome="stopped", error="FleetStopped: x"),
        "the refit between the resizes did not commit: stopped"),
    "the grow never happened": (
        lambda f, evs: f["resizes"][0].update(outcome="failed", error="ConfigError: n"),
        "the grow did not happen: ConfigError: n"),
    "no record of the grow": (
        lambda f, evs: _drop(evs, lambda e: Resize.matches(e) and e["t"] == 19.0),
        "no resize end record of the grow (to 4 engines)"),
    "no record of the shrink": (
        lambda f, evs: _drop(evs, lambda e: Resize.matches(e) and e["t"] == 31.0),
        ("no resize end record of the shrink (to 3 engines)", "no drain record of the removed slot 3")),
    "the shrink went the wrong way": (
        lambda f, evs: evs[-1].update(size_from=4, size_to=5),
        "the shrink's resize record goes from 4 to 5 engines, not 4 to 3"),
    "the refit was not between the resizes": (
        lambda f, evs: f["calls"][0].update(began=35.0, ended=36.0),
        "the refit did not run between the grow and the shrink"),
    "the refit did not land on the new engine": (
        lambda f, evs: evs[4].update(members=[[0, 1], [1, 1], [2, 1]]),
        "did not land on the new engine (slot 3, incarnation 1)"),
    "the new engine admitted nothing after the refit": (
        lambda f, evs: f["new_engine"].update(admitted_after_refit=0),
        "the new engine (slot 3) admitted no request after the refit"),
    "nothing completed on the new engine with the new version": (
        lambda f, evs: f["new_engine"].update(completed_on_version=0),
        "no request completed on the new engine (slot 3) with version 5"),
    "the removed engine held nothing": (
        lambda f, evs: evs[-1]["drained"]["3"].update(in_flight_at_removal=0, finished=0),
        "slot 3 held no request when it was removed: its drain proves nothing"),
    "requests were aborted instead of finishing": (
        lambda f, evs: evs[-1]["drained"]["3"].update(finished=1, aborted=1),
        "slot 3 did not finish the 2 request(s) it held: finished 1, aborted 1"),
    "it admitted requests after its removal": (
        lambda f, evs: evs[-1]["drained"]["3"].update(admitted_at_end=41),
        "slot 3 admitted requests after its removal: 40 at removal, 41 at the end"),
    "it was not retired": (
        lambda f, evs: _drop(evs, lambda e: Health.matches(e)),
        "slot 3 (incarnation 1) was not retired as removed by the resize: health record missing"),
    "retired by a failure, not removed": (
        lambda f, evs: f["removed_state"]["3"].update(removed=False),
        "removed=False"),
    "a request was lost": (
        lambda f, evs: f.update(completed=89, returned=["redispatch budget (3) spent"]),
        "not every request completed: 89 of 90 submitted"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_condition_broken_fails_the_variant_with_its_sentence(case):
    change, sentences = CASES[case]
    sentences = (sentences,) if isinstance(sentences, str) else sentences
    problems = broken(change)
    assert len(problems) == len(sentences) and all(s in p for s, p in zip(sentences, problems)), problems
    assert all(p.startswith("fault resize_under_load at call (version(s) 5): ") for p in problems)
