"""Numbers read off an event log (``faults.timeline``), and the proof that a fault fired (``faults.evidence``,
the fault runner's ``judge``): one definition each, checked on small hand-made logs and fault journals."""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlfleet.faults.evidence import prove
from rlfleet.faults.runner import VariantReport, judge
from rlfleet.fleet.records import (
    Decision, Fault, Gate, Health, Phase, RefitRolledBack, Request, Restart, Routing, Stamp, Stopped,
)
from rlfleet.faults.timeline import (
    departure,
    fault_to_reopen,
    log_numbers,
    percentile,
    read_log,
    readmissions,
    recover_s,
    refit_spans,
    reopen_s,
)


def demo_log() -> list[dict]:
    """A fleet of 2: start, one refit, slot 1 killed, restarted, re-admitted by the next refit, shut down."""
    recs = []

    def ev(t, kind, **f):
        recs.append(kind(t=t, seq=len(recs), **f).as_dict())

    ev(0.0, Phase, phase="start", edge="begin", engines=2)
    for s in (0, 1):
        ev(5.0, Health, slot=s, incarnation=1, before="starting", after="stale", reason="ready")
        ev(5.1, Health, slot=s, incarnation=1, before="stale", after="healthy", reason="v0")
    ev(5.2, Gate, open=True, version=0, reason="2 serve")
    for i in range(3):
        ev(6.0 + i, Request, event="accepted", request_id=f"r{i}")
        ev(6.5 + i, Request, event="completed", request_id=f"r{i}", slot=i % 2, incarnation=1, version=0, version_start=0)

    def refit(t, version, members):
        ev(t, Phase, phase="close", edge="begin", version=version)
        ev(t, Gate, open=False, version=version - 1, reason="refit")
        ev(t + 0.01, Phase, phase="close", edge="end", version=version, seconds=0.01)
        ev(t + 0.1, Phase, phase="transfer", edge="begin", version=version)
        ev(t + 0.5, Phase, phase="transfer", edge="end", version=version, seconds=0.4)
        ev(t + 0.6, Stamp, version=version, members=members, failed=[], unknown=[])
        ev(t + 0.7, Phase, phase="reopen", edge="begin", version=version)
        ev(t + 0.7, Gate, open=True, version=version, reason="ok")
        ev(t + 0.8, Phase, phase="reopen", edge="end", version=version, seconds=0.1)

    refit(10.0, 1, [[0, 1], [1, 1]])
    ev(12.0, Fault, slot=1, incarnation=1, point="step_boundary", action="kill", armed=True)
    ev(12.5, Health, slot=1, incarnation=1, before="healthy", after="dead", reason="died")
    ev(13.0, Restart, slot=1, incarnation=2, edge="begin", attempt=1)
    ev(13.0, Health, slot=1, incarnation=2, before="dead", after="restarting", reason="restart")
    refit(14.0, 2, [[0, 1]])
    ev(20.0, Restart, slot=1, incarnation=2, edge="end", outcome="ok")
    ev(20.0, Health, slot=1, incarnation=2, before="restarting", after="stale", reason="ready")
    refit(22.0, 3, [[0, 1], [1, 2]])
    ev(22.6, Health, slot=1, incarnation=2, before="stale", after="healthy", reason="v3")
    ev(23.0, Request, event="accepted", request_id="r9")
    ev(23.5, Request, event="completed", request_id="r9", slot=1, incarnation=2, version=3, version_start=3)
    ev(24.0, Request, event="accepted", request_id="r10")
    ev(30.0, Stopped, reason="controller shut down", shutdown=True)
    ev(30.0, Request, event="returned", request_id="r10", reason="fleet stopped: controller shut down")
    ev(30.1, Phase, phase="shutdown", edge="end", shards={})
    return recs


# ---------------------------------------------------------------------------------- percentile
def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert percentile([1.0, 2.0], 0.0) == 1.0 and percentile([1.0, 2.0], 1.0) == 2.0
    assert percentile([7.12345], 0.95, 3) == 7.123
    assert percentile([None, 1.0, None, 3.0], 0.5) == 2.0, "None values are skipped"
    assert percentile([], 0.5) is None and percentile([None], 0.5, default="n/a") == "n/a"
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 50)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.integers(1, 99))
def test_percentile_agrees_with_the_standard_library(xs, pct):
    want = xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=100, method="inclusive")[pct - 1]
    assert percentile(xs, pct / 100) == pytest.approx(want, rel=1e-9, abs=1e-6)
    assert percentile(xs, 0.5) == pytest.approx(statistics.median(xs), rel=1e-9, abs=1e-6)


# ---------------------------------------------------------------------------------- the demo's numbers
def test_log_numbers_count_faults_recoveries_and_requests():
    n = log_numbers(demo_log())
    assert n["requests"] == {"accepted": 5, "completed": 4, "returned": 1, "requeued": 0}
    assert n["prompts_lost"] == 0
    assert n["faults_injected"] == 1 and n["deaths"] == 1
    assert n["restarts_started"] == n["restarts_ok"] == 1
    assert n["recoveries"] == 1
    assert n["readmissions"][0] | {} == {"slot": 1, "incarnation": 2, "version": 3, "t": 22.6, "restart_end_t": 20.0,
                                         "served_after": 1, "how": "refit", "donor": None, "before_next_refit": False}
    assert n["readmitted_by_peer"] == n["readmitted_before_next_refit"] == 0
    assert n["gate_reopenings_after_fault"] == 2
    assert n["stopped"] is None, "the controller's own shutdown is not a stop"
    assert n["refits"] == 3 and n["refit_s_max"] == pytest.approx(0.8)
    assert n["refit_s_p50"] == pytest.approx(0.8)


def test_a_lost_request_and_a_real_stop_show():
    log = demo_log()[:-3] + [Stopped(t=31.0, seq=999, reason="below quorum").as_dict()]
    n = log_numbers(log)
    assert n["prompts_lost"] == 1 and n["stopped"] == "below quorum"


def test_restart_without_a_stamp_is_not_a_recovery():
    log = [e for e in demo_log() if not (Stamp.matches(e) and e["version"] == 3)]
    assert readmissions(log) == [] and log_numbers(log)["recoveries"] == 0


def test_refit_spans():
    spans = refit_spans(demo_log())
    assert [s["version"] for s in spans] == [1, 2, 3]
    assert spans[0]["begin"] == 10.0 and spans[0]["end"] == pytest.approx(10.8)
    assert [p for p, _, _ in spans[0]["phases"]] == ["close", "transfer", "reopen"]


# ---------------------------------------------------------------------------------- recovery and reopening
def test_fault_to_reopen_from_the_firing():
    log = demo_log()
    kill = Fault.first(log)
    assert fault_to_reopen(log, kill.t) == pytest.approx(14.7 - 12.0)
    assert fault_to_reopen(log, 30.5) is None, "the gate never reopened"
    stop = Stopped(t=12.1, seq=-1, reason="below quorum").as_dict()
    cut = kill.seq + 1
    assert fault_to_reopen(log[:cut] + [stop] + log[cut:], kill.t) is None, "after a stop the gate stays closed"


def test_departure_is_the_first_record_of_a_state_the_fault_leads_to_after_the_firing():
    log = demo_log()
    assert departure(log, 1, 1, 12.0, ("dead", "retired")).t == 12.5
    assert departure(log, 0, 1, 0.0, ("dead", "retired")) is None
    assert departure(log, 1, 2, 0.0, ("stale",)).before == "restarting"
    assert departure(log, 1, 1, 13.0, ("dead",)) is None, "only records after the firing count"


def test_recover_s_until_a_new_incarnation_is_stamped_or_the_same_one_is_healthy_again():
    left = departure(demo_log(), 1, 1, 12.0, ("dead",))
    assert recover_s(demo_log(), left) == pytest.approx(22.6 - 12.5)
    events = [
        Health(slot=2, incarnation=1, before="healthy", after="hung", t=50.0, reason=""),
        Health(slot=2, incarnation=1, before="hung", after="healthy", t=53.0, reason=""),
    ]
    assert recover_s(events, events[0]) == 3.0 and recover_s(events[:1], events[0]) is None


def test_a_replacement_re_admitted_from_a_peer_has_recovered_though_no_refit_stamped_it():
    """The CI soak's last fault: its slot came back by a peer copy after the last refit, so no stamp names it."""
    from rlfleet.fleet.records import Readmit

    left = Health(slot=1, incarnation=1, before="healthy", after="dead", t=10.0, reason="")
    peer = dict(slot=1, version=4, edge="end", donor="slot 0", outcome="readmitted")
    assert recover_s([left, Readmit(t=31.5, seq=2, incarnation=2, **peer)], left) == 21.5
    failed = dict(peer, outcome="failed", error="donor died")
    assert recover_s([left, Readmit(t=31.5, seq=2, incarnation=2, **failed)], left) is None
    assert recover_s([left, Readmit(t=31.5, seq=2, incarnation=1, **peer)], left) is None, "the departed one itself"


def test_reopen_s_counts_only_openings_after_the_record():
    events = [Gate(open=True, t=1.0, version=0, reason="").as_dict(),
              Fault(t=2.0, slot=0, incarnation=1, point="transfer", action="kill", armed=True).as_dict(),
              Gate(open=False, t=3.0, version=0, reason="").as_dict(), Gate(open=True, t=5.5, version=1, reason="").as_dict()]
    assert reopen_s(events, 1) == 3.5 and reopen_s(events, 3) is None


def test_read_log_skips_a_line_cut_short(tmp_path):
    path = tmp_path / "events.jsonl"
    assert read_log(path) == []
    path.write_text(json.dumps(Gate(t=1.0, open=True, version=None, reason="").as_dict()) + "\n" + '{"t": 2.0, "ki')
    assert read_log(path) == [Gate(t=1.0, open=True, version=None, reason="").as_dict()]


# ---------------------------------------------------------------------------------- the judge: did the fault fire?
def transfer_log() -> list[dict]:
    """3 slots; a kill armed at slot 0's transfer; refit 1 lands on slots 1 and 2 (each passes through stale)."""
    recs = [Gate(open=True, version=0, t=1.0, reason="").as_dict(),
            Fault(slot=0, incarnation=1, point="transfer", action="kill", armed=True, t=2.0).as_dict(),
            Gate(open=False, version=0, t=3.0, reason="").as_dict()]
    for s in (1, 2):
        recs.append(Health(slot=s, incarnation=1, before="healthy", after="stale", t=3.2, reason="refit of version 1 landed").as_dict())
    recs.append(Health(slot=0, incarnation=1, before="healthy", after="dead", t=3.3, reason="died during transfer").as_dict())
    for s in (1, 2):
        recs.append(Health(slot=s, incarnation=1, before="stale", after="healthy", t=3.5, reason="").as_dict())
    recs.append(Gate(open=True, version=1, t=3.6, reason="").as_dict())
    return recs


DONE = [{"step": 1, "where": "transfer", "what": "kill", "slot": 0, "delay_s": 0.0, "t": 0.5}]
SHOT = {"t": 3.1, "wall": 0.0, "slot": 0, "incarnation": 1, "point": "transfer", "action": "kill", "delay_s": 0.0, "pid": 7}


def recovers() -> VariantReport:
    return VariantReport("kill-during-transfer", "recovers", "recovers", accepted=4, completed=4)


def test_a_fault_that_went_off_passes_with_its_slot_incarnation_and_fault_to_reopen():
    rep = judge(recovers(), DONE, transfer_log(), [SHOT])
    assert rep.passed and not rep.violations
    assert rep.faults == [{"slot": 0, "incarnation": 1, "point": "transfer", "action": "kill", "t": 3.1,
                           "left_for": "dead", "fault_to_reopen_s": 0.5, "recover_s": None}]
    assert rep.fault_to_reopen_s == 0.5


def test_a_fault_that_did_not_fire_fails_the_variant_though_the_log_shows_departures():
    rep = judge(recovers(), DONE, transfer_log(), journal=[])
    assert not rep.passed and rep.faults == [] and rep.fault_to_reopen_s is None
    assert rep.violations == ["fault kill at transfer on slot 0 (incarnation 1) did not fire: armed at t=2.000, "
                              "but no shard recorded it going off in the fault journal"]


def test_a_fault_never_armed_fails_the_variant():
    log = [e for e in transfer_log() if not Fault.matches(e)]
    rep = judge(recovers(), DONE, log, [SHOT])
    assert not rep.passed and "did not fire: the event log has no 'fault' record" in rep.violations[0]


def test_a_firing_in_another_incarnation_or_slot_does_not_count():
    for other in ({**SHOT, "incarnation": 2}, {**SHOT, "slot": 1}, {**SHOT, "point": "pause"}):
        rep = judge(recovers(), DONE, transfer_log(), [other])
        assert not rep.passed and "did not fire" in rep.violations[0], other


def test_a_fault_that_fired_but_did_nothing_fails_the_variant():
    log = [e for e in transfer_log() if e.get("after") != "dead"]  # only the refit's own pass through stale is left
    rep = judge(recovers(), DONE, log, [SHOT])
    assert not rep.passed and rep.faults[0]["left_for"] is None
    assert rep.violations == ["fault kill at transfer on slot 0 (incarnation 1) fired at t=3.100, but that "
                              "incarnation never became dead or retired after it (no such health record)"]


def test_a_step_boundary_kill_is_proven_by_the_controller_s_own_record():
    done = [{"step": 1, "where": "step_boundary", "what": "kill", "slot": 1, "delay_s": 0.0, "t": 0.0}]
    rows, problems = prove(done, demo_log(), journal=[])
    assert problems == [] and len(rows) == 1
    assert rows[0] | {} == {"slot": 1, "incarnation": 1, "point": "step_boundary", "action": "kill", "t": 12.0,
                            "left_for": "dead", "fault_to_reopen_s": 2.7, "recover_s": 10.1}
    rows, problems = prove(done * 2, demo_log(), journal=[])
    assert len(rows) == 1 and "did not fire" in problems[0], "one record proves one firing"


# ---------------------------------------------------------------------------------- a trainer's faults: fired and proven
from rlfleet.faults.firing import TENSOR, FaultFiring  # noqa: E402
from rlfleet.faults.invariants import requests_waited_below_quorum  # noqa: E402
from rlfleet.fleet.errors import RefitRefused  # noqa: E402
from rlfleet.health.faultplan import Firing  # noqa: E402

SHAPE = f"tensor {TENSOR}: shape (8, 9), engine expects (8, 8)"


class _Trainer:
    source = "the-source"

    def __init__(self):
        self.version, self.corruptions = 3, []

    def new_version(self):
        self.version += 1
        return self.version

    def corrupt_next_update(self, kind, tensor):
        self.corruptions.append((kind, tensor))


class _Fleet:
    """Commits versions above ``committed`` unless the trainer's update is corrupt; kills make slots restart."""

    def __init__(self, trainer=None):
        self.trainer, self.committed, self.synced = trainer, 3, []
        self.slots = {s: ["healthy", 1] for s in range(3)}
        self.epoch = 5
        self.client = _LaggingClient(self)

    def status(self):
        return {"gate_open": True, "version": self.committed, "requests": {"in_progress": 2}, "routing_epoch": self.epoch,
                "ledger": {"slots": [{"slot": s, "state": st, "incarnation": i} for s, (st, i) in self.slots.items()]}}

    def sync_weights(self, version, source):
        self.synced.append(version)
        if self.trainer and self.trainer.corruptions and self.trainer.corruptions[-1][0]:
            raise RefitRefused(f"weight update for version {version} refused: {SHAPE}")
        if version <= self.committed:
            raise RefitRefused(f"sync_weights: version {version} is not greater than the committed version "
                               f"{self.committed}")
        self.committed = version
        return {"version": version}

    def fault_injector(self):  # the fake fleet is its own injector
        return self

    def kill_shard(self, slot):
        self.slots[slot] = ["restarting", self.slots[slot][1] + 1]
        self.epoch += 1  # the controller publishes the change; the client hears of it a few reads later


class _LaggingClient:
    """The client's routing state reaches the controller's epoch only on its third read after a change."""

    def __init__(self, fleet):
        self.fleet, self.epoch, self.reads = fleet, fleet.epoch, 0

    def routing(self):
        self.reads += 1
        if self.reads % 3 == 0:
            self.epoch = self.fleet.epoch
        return type("Routing", (), {"epoch": self.epoch})()


def test_trainer_faults_are_refit_calls_the_firing_makes_and_records():
    trainer = _Trainer()
    fleet = _Fleet(trainer)
    firing = FaultFiring(fleet, [Firing(1, "update", "corrupt_shape", None), Firing(1, "call", "stale_version", None),
                                 Firing(1, "call", "concurrent_refit", None)], trainer=trainer)
    firing.at(1)
    bad, stale, both = firing.fired
    assert trainer.corruptions == [("shape", TENSOR), (None, TENSOR)], "corrupted for one refit, then restored"
    assert [(c["version"], c["outcome"]) for c in bad["calls"]] == [(4, "refused")] and SHAPE in bad["calls"][0]["error"]
    assert bad["tensor"] == TENSOR and bad["after"]["version"] == 3
    assert [(c["version"], c["outcome"]) for c in stale["calls"]] == [(3, "refused")]
    assert sorted(c["version"] for c in both["calls"]) == [5, 6] and fleet.committed in (5, 6)
    assert {c["outcome"] for c in both["calls"]} <= {"committed", "refused"}
    with pytest.raises(ValueError, match="needs the trainer"):
        FaultFiring(fleet).fire(Firing(1, "call", "stale_version", None))


def test_between_refits_kills_wait_for_the_controller_then_load_then_the_restarts():
    fleet = _Fleet()
    seen = []

    def load():
        seen.append({s: st for s, (st, _) in fleet.slots.items()})
        assert fleet.client.epoch == fleet.epoch, "requests submitted under the client's view of the close"
        for s in (0, 1):
            fleet.slots[s][0] = "stale"  # the restarts come back
        return 8

    firing = FaultFiring(fleet, [Firing(1, "between_refits", "kill", 0), Firing(1, "between_refits", "kill", 1)],
                         load=load, up_timeout_s=5)
    firing.at(1)
    assert seen == [{0: "restarting", 1: "restarting", 2: "healthy"}], "requests submitted while both were gone"
    assert [(f["slot"], f["submitted_while_gone"]) for f in firing.fired] == [(0, 8), (1, 8)]


def _call(version, outcome, error=None, began=10.0, ended=11.0):
    return {"version": version, "outcome": outcome, "error": error, "began": began, "ended": ended}


def _refit(t, version, reopen=True):
    out = [Phase(phase=p, edge=e, version=version, t=t + k * 0.1).as_dict()
           for k, (p, e) in enumerate([("close", "begin"), ("close", "end"), ("reopen", "begin"), ("reopen", "end")])]
    return out + ([Gate(open=True, version=version, t=t + 0.25, reason="").as_dict()] if reopen else [])


def _corrupt_done(**over):
    base = {"step": 1, "where": "update", "what": "corrupt_shape", "slot": None, "delay_s": 0.0, "t": 1.0,
            "tensor": TENSOR, "calls": [_call(4, "refused", f"RefitRefused: ... {SHAPE}")],
            "before": {"gate_open": True, "version": 3, "states": {0: "healthy"}},
            "after": {"gate_open": True, "version": 3, "states": {0: "healthy"}}}
    return {**base, **over}


def _corrupt_log():
    return [Gate(open=False, version=3, t=10.1, reason="refit of version 4").as_dict(),
            RefitRolledBack(version=4, reason=f"RefitRefused: {SHAPE}", t=10.5, resumed=[], gate_closed=True).as_dict(),
            Gate(open=True, version=3, t=10.6, reason="").as_dict()] + _refit(12.0, 5)


def test_a_refused_update_is_proven_by_its_rollback_naming_the_tensor_and_the_next_commit():
    rows, problems = prove([_corrupt_done()], _corrupt_log(), journal=[])
    assert problems == [] and rows == [{"slot": None, "incarnation": None, "point": "update", "action": "corrupt_shape",
                                        "t": 10.0, "left_for": "rolled_back", "fault_to_reopen_s": 0.6,
                                        "recover_s": None}]
    no_rollback = [e for e in _corrupt_log() if not RefitRolledBack.matches(e)]
    rows, problems = prove([_corrupt_done()], no_rollback, journal=[])
    assert rows[0]["left_for"] is None and "no refit_rolled_back record of version 4" in problems[0]
    committed = _corrupt_done(calls=[_call(4, "committed")], after={"gate_open": True, "version": 4, "states": {0: "healthy"}})
    _, problems = prove([committed], _corrupt_log(), journal=[])
    assert "was not refused naming" in problems[0] and "did not keep serving version 3" in problems[1]
    _, problems = prove([_corrupt_done()], _corrupt_log()[:3], journal=[])
    assert problems == ["fault corrupt_shape at update (version(s) 4): no later refit reopened the gate on a version above 3"]
    _, problems = prove([_corrupt_done(calls=[])], _corrupt_log(), journal=[])
    assert problems == ["fault corrupt_shape at update did not fire: the driver made no refit call for it"]


def test_a_stale_version_is_refused_without_touching_the_gate():
    done = {"step": 1, "where": "call", "what": "stale_version", "slot": None, "t": 1.0,
            "calls": [_call(3, "refused", "RefitRefused: version 3 is not greater than the committed version 3")]}
    quiet = [Decision(t=10.5, event="Tick", failure=None, reason="").as_dict()] + _refit(12.0, 4)
    rows, problems = prove([done], quiet, journal=[])
    assert problems == [] and rows[0]["left_for"] == "refused" and rows[0]["fault_to_reopen_s"] == 2.25
    closed = [Gate(open=False, version=3, t=10.5, reason="refit of version 3").as_dict()] + quiet
    _, problems = prove([done], closed, journal=[])
    assert "the refused call changed something" in problems[0]


def test_concurrent_refits_must_not_interleave():
    done = {"step": 1, "where": "call", "what": "concurrent_refit", "slot": None, "t": 1.0,
            "calls": [_call(4, "committed"), _call(5, "committed")]}
    rows, problems = prove([done], _refit(10.0, 4) + _refit(10.5, 5), journal=[])
    assert problems == [] and rows[0]["left_for"] == "serialized"
    interleaved = sorted(_refit(10.0, 4) + _refit(10.15, 5), key=lambda e: e["t"])
    _, problems = prove([done], interleaved, journal=[])
    assert "the refits overlapped: version 5 began at t=10.150, before version 4 ended" in problems[0]
    second_refused = {**done, "calls": [_call(5, "committed"), _call(4, "refused", "RefitRefused: version 4 is not "
                                                                                  "greater than the committed version 5")]}
    assert prove([second_refused], _refit(10.0, 5), journal=[])[1] == []
    failed = {**done, "calls": [_call(4, "committed"), _call(5, "stopped", "FleetStopped: ...")]}
    assert "not one committed and the other" in prove([failed], _refit(10.0, 4), journal=[])[1][0]


def test_a_refit_under_load_is_proven_only_when_the_shards_refused_every_lagging_request():
    lagging = [{"slot": s, "incarnation": 1, "refused": True, "reason": "paused"} for s in range(3)]
    done = {"step": 1, "where": "call", "what": "refit_under_load", "slot": None, "t": 1.0,
            "calls": [_call(4, "committed")], "threads": 4, "submitted": 40, "overlapping": 9, "completed": 40,
            "mixed": 0, "lagging": lagging, "stale_epoch": 7, "refused_delta": {"paused": 3, "epoch": 2}}
    rows, problems = prove([done], _refit(10.0, 4), journal=[])
    assert problems == [] and rows[0]["left_for"] == "held"
    ran = {**done, "lagging": lagging[:2] + [{**lagging[2], "refused": False, "reason": "ok"}]}
    assert "shards took work routed under the pre-refit epoch 7" in prove([ran], _refit(10.0, 4), journal=[])[1][0]
    idle = {**done, "overlapping": 0}
    assert "the load did not overlap it" in prove([idle], _refit(10.0, 4), journal=[])[1][0]
    nobody = {**done, "lagging": [], "refused_delta": {}}
    assert "the lagging client sent nothing" in prove([nobody], _refit(10.0, 4), journal=[])[1][0]
    uncounted = {**done, "refused_delta": {"paused": 1}}
    assert "counted 1 refusal(s) for 3 lagging" in prove([uncounted], _refit(10.0, 4), journal=[])[1][0]
    mixed = {**done, "mixed": 2}
    assert "2 'latest' request(s) completed with samples from two versions" in prove([mixed], _refit(10.0, 4),
                                                                                     journal=[])[1][0]


def _below_quorum_log(returned=False, early=False):
    log = [Gate(open=False, version=3, t=1.0, reason="below quorum between refits: 1 engine(s)").as_dict(),
           Request(event="accepted", request_id="r1", t=2.0).as_dict()]
    if returned:
        log.append(Request(event="returned", request_id="r0", t=2.5).as_dict())
    if early:
        log.append(Request(event="completed", request_id="r1", t=2.6).as_dict())
    return log + _refit(5.0, 4) + [Request(event="completed", request_id="r1", t=6.0).as_dict()]


def test_requests_wait_while_the_fleet_is_below_quorum_until_a_refit_reopens_the_gate():
    assert requests_waited_below_quorum(_below_quorum_log()) == []
    assert requests_waited_below_quorum(_below_quorum_log(returned=True)) == [
        "request r0 returned while the gate was closed below quorum"]
    assert requests_waited_below_quorum(_below_quorum_log(early=True)) == [
        "request r1 completed while the gate was closed below quorum"]
    assert requests_waited_below_quorum(_refit(5.0, 4)) == ["the gate never closed below quorum between refits"]
    stopped = _below_quorum_log()[:2] + [Stopped(reason="x", t=3.0).as_dict()]
    assert "no refit reopened it" in requests_waited_below_quorum(stopped)[0]


def test_a_request_its_client_accepted_before_it_saw_the_gate_close_may_finish_on_a_survivor():
    """The close reaches a client with its next routing state: a request accepted under the client's
    still-open view (``gate_open`` True in its record) may be served meanwhile by a shard that survived on
    the committed version; one accepted under a closed view must wait for the refit that reopens the gate."""
    log = _below_quorum_log()
    log.insert(1, Request(event="accepted", request_id="r2", gate_open=True, t=1.1).as_dict())
    log.insert(2, Request(event="completed", request_id="r2", t=1.4).as_dict())
    assert requests_waited_below_quorum(log) == []
    log[1] = {**log[1], "gate_open": False}
    assert requests_waited_below_quorum(log) == ["request r2 completed while the gate was closed below quorum"]
    only_before = [e for e in log if e.get("request_id") != "r1"]
    only_before[1] = {**only_before[1], "gate_open": True}
    assert requests_waited_below_quorum(only_before) == [
        "no request was accepted while the gate was closed below quorum (t=1.000)"]


def test_a_peer_readmission_before_the_next_refit_is_the_recovery_with_its_donor():
    """Issue 48: the restarted engine was re-admitted from a peer (a ``readmit`` end record) before the refit that
    followed its restart; that refit's stamp of it later is not its re-admission."""
    from rlfleet.fleet.records import Readmit

    log = demo_log()
    restart_end = next(e for e in log if Restart.matches(e) and e["edge"] == "end")
    peer = Readmit(t=restart_end["t"] + 0.5, seq=len(log), slot=1, incarnation=2, version=2, edge="end",
                   donor="slot 0", outcome="readmitted", seconds=0.4).as_dict()
    log = sorted(log + [peer], key=lambda e: (e["t"], e["seq"]))
    n = log_numbers(log)
    (r,) = n["readmissions"]
    assert (r["how"], r["donor"], r["version"], r["before_next_refit"]) == ("peer", "slot 0", 2, True)
    assert n["recoveries"] == n["readmitted_by_peer"] == n["readmitted_before_next_refit"] == 1
