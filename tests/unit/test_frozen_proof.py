"""The proof for a shard frozen between refits (``faults.frozen.prove_resent``) fails when any part of its
promise is broken: no freeze, no eviction, an eviction past the bound, no request in flight on it, a
request re-sent late, a re-sent request that never completed."""

from __future__ import annotations

from rlfleet.faults.frozen import prove_resent
from rlfleet.fleet.records import Kill, Request

SHOT = {"slot": 2, "incarnation": 1, "point": "generate", "action": "freeze", "t": 10.0}
REASON = "slot 2 (incarnation 1) failed: died: ActorDiedError: the actor died"


def records(kill_t=16.0, resent_t=16.2, completed=True, reason=REASON):
    events = [
        Request(event="accepted", request_id="r1", t=9.9).as_dict(),
        Kill(slot=2, incarnation=1, reason="evicted: dead after 2 failed probe(s)", t=kill_t).as_dict(),
        Request(event="requeued", request_id="r1", reason=reason, t=resent_t).as_dict(),
    ]
    if completed:
        events.append(Request(event="completed", request_id="r1", slot=0, t=resent_t + 0.5).as_dict())
    return events


def test_a_freeze_evicted_within_the_bound_with_its_request_resent_and_completed_is_proven():
    measured: dict = {}
    assert prove_resent(records(), [SHOT], slot=2, bound_s=8.0, measured=measured) == []
    assert measured == {"evicted_after_s": 6.0, "bound_s": 8.0, "resent": 1}


def test_each_broken_promise_is_named():
    assert "never froze" in prove_resent(records(), [], 2, 8.0)[0]
    no_kill = [e for e in records() if not Kill.matches(e)]
    assert "never evicted" in prove_resent(no_kill, [SHOT], 2, 8.0)[0]
    [late_kill] = prove_resent(records(kill_t=30.0, resent_t=30.1), [SHOT], 2, 8.0)
    assert "past the detection bound" in late_kill
    [nothing_held] = prove_resent(records(reason="slot 0 (incarnation 1) failed: x"), [SHOT], 2, 8.0)
    assert "none was in flight" in nothing_held
    [resent_late] = prove_resent(records(resent_t=40.0), [SHOT], 2, 8.0)
    assert "re-sent only" in resent_late
    [never_done] = prove_resent(records(completed=False), [SHOT], 2, 8.0)
    assert "never completed" in never_done


CORE_SHOT = {**SHOT, "action": "freeze_core", "engine_pids": [4242, 4343]}


def test_a_frozen_engine_core_under_a_live_actor_is_proven_like_a_frozen_shard():
    assert prove_resent(records(), [CORE_SHOT], slot=2, bound_s=8.0) == []


def test_the_stopped_engine_core_must_die_with_the_eviction_and_each_broken_promise_is_named():
    from rlfleet.faults.frozen import prove_core_reaped

    assert prove_core_reaped([CORE_SHOT], 2, alive=lambda pid: False) == []
    [left] = prove_core_reaped([CORE_SHOT], 2, alive=lambda pid: pid == 4343)
    assert "[4343]" in left and "slot 2 (incarnation 1)" in left and "outlived its eviction" in left
    assert "never froze" in prove_core_reaped([SHOT], 2, alive=lambda pid: False)[0]
    assert "stopped no engine-core process" in prove_core_reaped([{**CORE_SHOT, "engine_pids": []}], 2,
                                                                 alive=lambda pid: False)[0]
