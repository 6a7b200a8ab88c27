"""The proofs of the re-admission variants (``faults.readmit``) fail when any part of their point is missing: a
fault that never went off or went off outside the copy, a donor that was not replaced, an engine that served
before its copy, no restart, a copy that did not yield to the refit, no re-admission by the controller's
successor, a version burned."""

from __future__ import annotations

import pytest

from rlfleet.faults.evidence import LEADS_TO
from rlfleet.faults.readmit import (DELAY_S, prove_readmit_controller_killed, prove_readmit_donor_killed,
                            prove_readmit_engine_killed, prove_readmit_refit_mid_copy)
from rlfleet.fleet.records import Adopted, ControllerRestarted, Fault, Health, Phase, Readmit, Stamp
from rlfleet.health.faultplan import ALLOWED, READMIT_FAULTS

SERVING = {"version": 3, "gate_open": True, "slots": {0: ("healthy", 1, 3), 1: ("healthy", 1, 3), 2: ("healthy", 2, 3)}}
COPY = {"version": 3, "outcome": "copied", "error": None, "began": 100.0, "ended": 100.0}


def record(action="delay", **over):
    """Slot 2 killed at t=100, back as incarnation 2; its copy from slot 0 (incarnation 1) began at t=100.5 and the
    fault at ``donate`` went off on slot 0 at t=101."""
    f = {"stale": 2, "donor": 0, "action": action, "delay_s": DELAY_S if action == "delay" else 0.0, "killed": 1,
         "incarnation": 2, "before": SERVING, "after": SERVING, "t0": 100.0, "calls": [COPY], "served": True,
         "shot": {"t": 101.0, "slot": 0, "incarnation": 1, "point": "donate", "action": action},
         "stale_killed_at": 100.0}
    f.update(over)
    return f


def began(inc=2, t=100.5, donor="slot 0"):
    return Readmit(t=t, slot=2, incarnation=inc, version=3, edge="begin", donor=donor)


def end(outcome, inc=2, t=102.0, donor="slot 1", tried=None, version=3):
    return Readmit(t=t, slot=2, incarnation=inc, version=version, edge="end", outcome=outcome, donor=donor, tried=tried)


def healthy(slot, inc, t, reason="re-admitted from slot 1: holds the committed version 3"):
    return Health(t=t, slot=slot, incarnation=inc, before="stale", after="healthy", reason=reason)


def dead(slot, inc, t):
    return Health(t=t, slot=slot, incarnation=inc, before="healthy", after="dead", reason="died")


def test_every_readmit_fault_is_a_call_that_leads_somewhere():
    assert all(ALLOWED[w] == ("call",) and LEADS_TO[w] for w in READMIT_FAULTS)


# -- the donor dies as it begins to send ---------------------------------------------------------------------
DONOR_DIED = [began(), dead(0, 1, 101.2), healthy(2, 2, 104.9),
              end("readmitted", t=105.0, tried=["slot 0: the donor's send failed: died"])]


def test_a_donor_that_died_mid_copy_and_was_replaced_passes():
    assert prove_readmit_donor_killed(record("kill"), [COPY], DONOR_DIED) == []


@pytest.mark.parametrize("change, says", [
    ({"shot": None}, "never went off"),
    ({"events": [began(), dead(0, 1, 101.2), healthy(2, 2, 104.9), end("readmitted", t=105.0, donor="slot 0")]},
     "did not end re-admitted from another donor"),
    ({"events": [began(), dead(0, 1, 101.2), healthy(2, 2, 104.9), end("readmitted", t=105.0)]},
     "does not name the donor that died"),
    ({"events": [began(), dead(0, 1, 101.2), healthy(2, 2, 100.8, "version 3 stamped"),
                 end("readmitted", t=105.0, tried=["slot 0: died"])]}, "did not stay stale"),
    ({"events": [began(donor="slot 1")] + DONOR_DIED[1:]}, "began with donor slot 1, not slot 0"),
    ({"events": DONOR_DIED[:1] + DONOR_DIED[2:]}, "was not found dead"),
    ({"after": {**SERVING, "version": 4}}, "a version burned"),
])
def test_the_donor_proof_fails_when_a_part_is_missing(change, says):
    events = change.pop("events", DONOR_DIED)
    assert any(says in w for w in prove_readmit_donor_killed(record("kill", **change), [COPY], events))


# -- the stale engine dies mid-copy ---------------------------------------------------------------------------
KILL = Fault(t=102.0, slot=2, incarnation=2, point="step_boundary", action="kill", armed=True)
ENGINE_DIED = [began(), KILL, dead(2, 2, 102.1), end("failed", t=104.0, donor="slot 0"), began(inc=3, t=105.0),
               healthy(2, 3, 105.4), end("readmitted", inc=3, t=105.5, donor="slot 0")]


def test_an_engine_killed_mid_copy_that_restarted_and_was_readmitted_passes():
    assert prove_readmit_engine_killed(record(), [COPY], ENGINE_DIED) == []


@pytest.mark.parametrize("events, says", [
    ([began(), Fault(t=104.5, slot=2, incarnation=2, point="step_boundary", action="kill", armed=True)]
     + ENGINE_DIED[2:], "not while the donor held its send"),
    ([began(), end("failed", t=101.5, donor="slot 0")] + ENGINE_DIED[1:3], "had ended (failed) before"),
    (ENGINE_DIED[:2] + ENGINE_DIED[3:], "no normal restart"),
    (ENGINE_DIED[:4], "no later incarnation of slot 2 was re-admitted"),
    (ENGINE_DIED + [healthy(2, 2, 103.0)], "killed mid-copy, served"),
    ([began()], "was not killed after the copy into it began"),
])
def test_the_engine_proof_fails_when_a_part_is_missing(events, says):
    assert any(says in w for w in prove_readmit_engine_killed(record(), [COPY], events))


# -- the trainer's refit begins mid-copy ----------------------------------------------------------------------
REFIT = {"version": 4, "outcome": "committed", "error": None, "began": 101.2, "ended": 103.0}
AFTER = {"version": 4, "gate_open": True, "slots": {0: ("healthy", 1, 4), 1: ("healthy", 1, 4), 2: ("healthy", 2, 4)}}
YIELDED = [began(), Phase(t=101.3, phase="close", edge="begin", version=4), end("yielded", t=101.35, donor=None),
           Phase(t=101.5, phase="pause", edge="begin", version=4),
           Stamp(t=102.5, version=4, members=[[0, 1], [1, 1], [2, 2]], failed=[], unknown=[])]


def refit_record(**over):
    held = {"submitted": 8, "ok": 8, "versions": [3, 4]}
    return record(**{"calls": [REFIT], "after": AFTER, "requests": held, **over})


def test_a_copy_that_yielded_to_a_refit_which_took_the_engine_passes():
    assert prove_readmit_refit_mid_copy(refit_record(), [REFIT], YIELDED) == []


@pytest.mark.parametrize("over, events, says", [
    ({"calls": [{**REFIT, "outcome": "rolled_back", "error": "RefitSourceFailed"}]}, YIELDED, "did not commit"),
    ({}, YIELDED[:2] + [end("yielded", t=101.6, donor=None)] + YIELDED[3:], "did not yield before the refit paused"),
    ({}, YIELDED[:2] + YIELDED[3:], "did not yield"),
    ({}, [began(), Phase(t=104.5, phase="close", edge="begin", version=4), end("yielded", t=104.6),
          Phase(t=104.7, phase="pause", edge="begin", version=4)] + YIELDED[4:], "not while the donor held its send"),
    ({}, YIELDED[:4], "does not serve version 4"),
    ({"requests": {"submitted": 8, "ok": 7, "versions": [3, 4]}}, YIELDED, "1 of 8 requests"),
    ({"after": {**AFTER, "version": 5}}, YIELDED, "a version burned"),
])
def test_the_refit_proof_fails_when_a_part_is_missing(over, events, says):
    f = refit_record(**over)
    assert any(says in w for w in prove_readmit_refit_mid_copy(f, f["calls"], events))


def test_an_engine_left_out_of_the_refit_and_readmitted_at_its_version_after_passes():
    events = YIELDED[:4] + [Stamp(t=102.5, version=4, members=[[0, 1], [1, 1]], failed=[], unknown=[]),
                            end("readmitted", t=103.5, version=4)]
    assert prove_readmit_refit_mid_copy(refit_record(), [REFIT], events) == []


# -- the controller dies mid-copy ------------------------------------------------------------------------------
RESTARTED = ControllerRestarted(t=103.0, fleet="f", generation=1, committed=3, refit=None, shutdown=False, stopped=None)
ADOPTED = Adopted(t=103.5, intent=True, generation=1, fenced=[], seconds=0.5)
SUCCESSOR = [began(), RESTARTED, ADOPTED, began(t=104.0), end("readmitted", t=104.5, donor="slot 0")]


def controller_record(**over):
    return record(**{"killed_at": 102.0, "generation": [0, 1], "controller": {"pid": 7, "generation": 0}, **over})


def test_a_copy_the_controller_died_in_and_its_successor_readmitted_passes():
    assert prove_readmit_controller_killed(controller_record(), [COPY], SUCCESSOR) == []


@pytest.mark.parametrize("over, events, says", [
    ({"killed_at": 104.5}, SUCCESSOR, "not while the donor held its send"),
    ({"generation": [0, 2]}, SUCCESSOR, "not restarted once"),
    ({}, SUCCESSOR[:1], "no controller_restarted and adopted records"),
    ({}, SUCCESSOR[:4], "never re-admitted slot 2"),
    ({}, [began(), end("readmitted", t=101.5, donor="slot 0")] + SUCCESSOR[1:], "had ended (readmitted) before"),
    ({"served": False}, SUCCESSOR, "never served the committed version again"),
])
def test_the_controller_proof_fails_when_a_part_is_missing(over, events, says):
    assert any(says in w for w in prove_readmit_controller_killed(controller_record(**over), [COPY], events))
