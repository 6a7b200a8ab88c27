"""The event-log invariant checks catch each violation they exist for."""

from rlfleet.faults import invariants as inv
from rlfleet.fleet.records import Gate, Phase, Readmit, Request, Stamp, Stopped


def req(event, rid, **kw):
    return Request(event=event, request_id=rid, **kw).as_dict()


def stamp(version, members, failed=(), unknown=()):
    return Stamp(version=version, members=members, failed=list(failed), unknown=list(unknown)).as_dict()


def gate(open, version, reason="refit"):
    return Gate(open=open, version=version, reason=reason).as_dict()


def phase(name, edge, **kw):
    return Phase(phase=name, edge=edge, **kw).as_dict()


def test_lost_and_double_ended_requests_are_reported():
    events = [req("accepted", "a"), req("accepted", "b"), req("completed", "a", slot=0, incarnation=1, version=0),
              req("returned", "a", reason="x")]
    out = inv.requests_accounted(events)
    assert any("b accepted but never" in o for o in out) and any("a ended 2 times" in o for o in out)
    assert inv.requests_accounted([req("accepted", "a"), req("returned", "a", reason="r")]) == []


def test_version_tag_must_match_the_last_stamp_of_that_incarnation():
    good = [stamp(1, [[0, 1]]), req("completed", "a", slot=0, incarnation=1, version=1),
            req("completed", "b", slot=0, incarnation=2, version=0)]
    assert inv.version_tags_match_stamps(good) == []
    bad = good + [req("completed", "c", slot=0, incarnation=2, version=1)]
    assert len(inv.version_tags_match_stamps(bad)) == 1


def test_an_engine_resumed_by_its_stamping_call_may_finish_on_the_new_version_before_the_stamp_record():
    """``end_refit`` stamps and resumes in one call; the ``stamp`` record comes once all such calls settled."""
    resume = phase("resume", "begin", version=2)
    early = req("completed", "a", slot=0, incarnation=1, version=2)
    stamped = stamp(2, [[0, 1]], failed=[[1, 1, "unavailable"]])
    assert inv.version_tags_match_stamps([resume, early, stamped]) == []
    assert len(inv.version_tags_match_stamps([early, resume, stamped])) == 1, "before its refit's resume: wrong"
    other = req("completed", "b", slot=1, incarnation=1, version=2)  # its stamp failed: it must not carry 2
    assert len(inv.version_tags_match_stamps([resume, other, stamped])) == 1
    lost = stamp(2, [[0, 1]], unknown=[[1, 1, "unavailable"]])  # no answer at all
    old = req("completed", "c", slot=1, incarnation=1, version=0)
    assert inv.version_tags_match_stamps([resume, other, lost, other, old]) == [], "either tag, until a stamp says"


def test_a_readmitted_engine_carries_the_committed_version_it_was_stamped_with():
    """A re-admission stamps the engine with the committed version outside a refit (no ``stamp`` record);
    only one that ended ``readmitted`` does."""
    def readmit(outcome):
        return Readmit(slot=0, incarnation=2, version=3, edge="end", outcome=outcome, donor="slot 1").as_dict()

    served = req("completed", "a", slot=0, incarnation=2, version=3)
    assert inv.version_tags_match_stamps([stamp(3, [[1, 1]]), readmit("readmitted"), served]) == []
    assert len(inv.version_tags_match_stamps([readmit("yielded"), served])) == 1
    assert len(inv.version_tags_match_stamps([readmit("failed"), served])) == 1
    assert len(inv.version_tags_match_stamps([served, readmit("readmitted")])) == 1, "before it was stamped: wrong"


def test_open_gate_only_sees_current_version():
    events = [gate(True, 2), req("completed", "a", slot=0, incarnation=1, version=1)]
    assert len(inv.open_gate_serves_current_version(events)) == 1
    events = [gate(False, 2), req("completed", "a", slot=0, incarnation=1, version=1)]
    assert inv.open_gate_serves_current_version(events) == []


def test_phase_deadline_and_gate_after_stop():
    assert inv.phases_within_deadline([phase("pause", "end", seconds=12.5)], 10.0)
    assert not inv.phases_within_deadline([phase("pause", "end", seconds=11.0)], 10.0)
    # the transfer phase holds its retry within the same bound (no allowance for a second attempt)
    assert inv.phases_within_deadline([phase("transfer", "end", seconds=25.0)], 10.0)
    assert not inv.phases_within_deadline([phase("transfer", "end", seconds=11.5)], 10.0)
    assert inv.gate_closed_after_stop([Stopped(reason="x").as_dict(), gate(True, 3)])
    assert not inv.gate_closed_after_stop([gate(True, 3), Stopped(reason="x").as_dict()])
