"""The controller's faults (``kill_controller``): how they are fired (``faults.firing``), how they are proven
(``faults.evidence``: the crash's ``fired`` record, then ``controller_restarted`` and ``adopted``), and that the
invariant checks read a log that spans a controller's restart. Hand-made logs; no Ray."""

from __future__ import annotations

import subprocess

import pytest

from rlfleet.faults import invariants as inv
from rlfleet.faults.evidence import prove
from rlfleet.faults.firing import FaultFiring
from rlfleet.faults.runner import VariantReport, judge
from rlfleet.health.faultplan import Firing
from rlfleet.fleet.records import Adopt, Adopted, ControllerRestarted, Fault, Gate, Health, Kill, Phase, Record, Request, Stamp

PID, NEW_PID = 4242, 5151


def ev(t, kind: type[Record], **f):
    return kind(t=t, **f).as_dict()


def restart_log(point="pause", fired=True, restarted=True, adopted=True, pid=PID, shutdown=False):
    """The controller (generation 0, pid ``PID``) armed to crash at ``point`` in the refit of version 2; it dies
    there; Ray restarts it (generation 1, its ``seq`` from 0 again), it re-adopts 3 shards and reopens the gate."""
    recs = [ev(1.0, Gate, open=True, version=1, reason="3 serve", seq=10),
            ev(2.0, Fault, target="controller", point=point, action="crash", delay_s=0.0, armed=True, seq=11),
            ev(2.1, Phase, phase="close", edge="begin", version=2, seq=12),
            ev(2.1, Gate, open=False, version=1, reason="refit of version 2", seq=13),
            ev(2.2, Phase, phase="close", edge="end", version=2, seconds=0.1, seq=14),
            ev(2.3, Phase, phase=point, edge="begin", version=2, seq=15)]  # never ends: it died in it
    if fired is not None:
        recs.append(ev(2.31, Fault, target="controller", point=point, action="crash", fired=fired, seq=16,
                       **({"pid": pid} if fired else {"reason": f"the {point} phase had ended when the delay ran out"})))
    if restarted:
        recs.append(ev(5.0, ControllerRestarted, fleet="f", generation=1, committed=1, refit=[2, "closing"],
                       shutdown=shutdown, stopped=None, seq=0))
    if adopted and not shutdown:
        recs += [ev(5.1, Adopt, slot=s, incarnation=1, weight_version=1, dirty=False, paused=True, serves=True,
                    stamped=False, aborted=0, resumed=True, seq=1 + s) for s in range(3)]
        recs.append(ev(5.2, Gate, open=True, version=1, reason="3 engine(s) serve version 1", seq=4))
        recs.append(ev(5.3, Adopted, intent=True, generation=1, committed=1, serving=[0, 1, 2], stale=[],
                       missing=[], gate_open=True, fenced=[], seconds=0.3, seq=5))
    elif adopted:
        recs.append(ev(8.0, Adopted, intent=True, generation=1, shutdown_finished=True, shards={}, fenced=[], seconds=3.0, seq=2))
    return recs


def crash(point="pause", delay_s=0.0):
    return {"step": 1, "where": point, "what": "kill_controller", "slot": None, "delay_s": delay_s, "t": 0.5,
            "controller": {"pid": PID, "generation": 0}}


def recovers(name="controller-kill-during-pause"):
    return VariantReport(name, "recovers", "recovers", accepted=4, completed=4)


# ---------------------------------------------------------------------------------- proof of a crash at a phase
def test_a_crash_that_fired_and_was_followed_by_the_restart_and_the_adoption_passes():
    rep = judge(recovers(), [crash()], restart_log(), journal=[])
    assert rep.passed and not rep.violations, rep.violations
    assert rep.faults == [{"slot": None, "incarnation": None, "point": "pause", "action": "kill_controller", "t": 2.31,
                           "left_for": "restarted", "fault_to_reopen_s": 2.89, "recover_s": 2.99, "generation": 1,
                           "adopt_s": 0.3, "completed_while_down": 0}]
    assert rep.fault_to_reopen_s == 2.89


def test_a_crash_without_its_fired_record_fails_the_variant_though_the_controller_restarted():
    rep = judge(recovers(), [crash()], restart_log(fired=None), journal=[])
    assert not rep.passed and rep.faults == []
    assert rep.violations == ["fault kill_controller at pause did not fire: armed at t=2.000, but the controller "
                              "never recorded it going off (it did not reach pause)"]


def test_a_delayed_crash_that_found_its_phase_over_did_not_fire():
    rep = judge(recovers(), [crash("transfer", 0.75)], restart_log("transfer", fired=False), journal=[])
    assert not rep.passed and rep.faults == []
    assert rep.violations == ["fault kill_controller at transfer did not fire: the transfer phase had ended when "
                              "the delay ran out"]


def test_a_crash_never_armed_or_armed_elsewhere_did_not_fire():
    log = [e for e in restart_log() if not e.get("armed")]
    rep = judge(recovers(), [crash()], log, journal=[])
    assert not rep.passed and "has no 'fault' record of the controller's crash armed at pause" in rep.violations[0]
    rep = judge(recovers(), [crash("resume")], restart_log("pause"), journal=[])
    assert not rep.passed and "did not fire" in rep.violations[0]


def test_a_crash_without_controller_restarted_or_adopted_fails():
    rep = judge(recovers(), [crash()], restart_log(restarted=False, adopted=False), journal=[])
    assert not rep.passed and rep.faults[0]["left_for"] is None
    assert rep.violations == ["fault kill_controller at pause: no controller_restarted record of a generation "
                              "above 0 follows the kill at t=2.310: the controller did not come back"]
    rep = judge(recovers(), [crash()], restart_log(adopted=False), journal=[])
    assert not rep.passed and rep.violations == [
        "fault kill_controller at pause: the controller restarted (generation 1) but no adopted record follows: "
        "it never re-adopted the fleet"]


def test_a_crash_fired_by_another_process_than_the_one_armed_fails():
    rep = judge(recovers(), [crash()], restart_log(pid=999), journal=[])
    assert not rep.passed and "fired in pid 999, not in the controller's process the driver armed (pid 4242)" in \
        rep.violations[0]


def test_a_restart_from_before_the_crash_proves_nothing():
    log = restart_log(restarted=False, adopted=False)
    log.insert(1, ev(1.5, ControllerRestarted, fleet="f", generation=1, committed=1, refit=None, shutdown=False,
                     stopped=None, seq=0))
    rep = judge(recovers(), [crash()], log, journal=[])
    assert not rep.passed and "no controller_restarted record" in rep.violations[0]


def test_a_crash_in_the_shutdown_is_proven_only_by_an_adoption_that_finished_it():
    done = [crash("shutdown")]
    rows, problems = prove(done, restart_log("shutdown", shutdown=True), journal=[])
    assert problems == [] and rows[0]["left_for"] == "restarted" and rows[0]["recover_s"] == 5.69
    rows, problems = prove(done, restart_log("shutdown"), journal=[])  # re-adopted as if nothing was shutting down
    assert len(problems) == 1 and "lacks shutdown_finished" in problems[0]


# ---------------------------------------------------------------------------------- proof of a kill from outside
def outside(**over):
    base = {"step": 1, "where": "between_refits", "what": "kill_controller", "slot": None, "delay_s": 0.0, "t": 0.5,
            "controller": {"pid": PID, "generation": 0}, "killed_at": 2.31, "after": {"pid": NEW_PID, "generation": 1},
            "outage": {"outages": 1, "down_s": 2.9, "completed_while_down": 5, "submitted_while_down": 8}}
    return {**base, **over}


def between_log(restarted=True):
    """Killed from outside at t=2.31, between refits; requests completed on the shards meanwhile (3.0, 3.1) and
    after the successor re-adopted the fleet (5.6)."""
    recs = [e for e in restart_log(restarted=restarted, adopted=restarted)
            if not Fault.matches(e) and e.get("phase") != "pause"]
    recs += [ev(1.2, Request, event="accepted", request_id=r) for r in "abc"]
    recs += [ev(t, Request, event="completed", request_id=r, slot=0, incarnation=1, version=1)
             for t, r in ((3.0, "a"), (3.1, "b"), (5.6, "c"))]
    return sorted(recs, key=lambda e: e["t"])


def test_an_outside_kill_is_proven_by_the_pid_it_killed_and_the_restart_that_follows():
    rows, problems = prove([outside()], between_log(), journal=[])
    assert problems == []
    assert rows == [{"slot": None, "incarnation": None, "point": "between_refits", "action": "kill_controller",
                     "t": 2.31, "left_for": "restarted", "fault_to_reopen_s": 2.89, "recover_s": 2.99,
                     "generation": 1, "adopt_s": 0.3, "completed_while_down": 2,
                     "outage": {"outages": 1, "down_s": 2.9, "completed_while_down": 5, "submitted_while_down": 8}}]


def test_an_outside_kill_fails_without_a_restart_or_when_the_same_process_still_answers():
    rows, problems = prove([outside()], between_log(restarted=False), journal=[])
    assert rows[0]["left_for"] is None and "the controller did not come back" in problems[0]
    rows, problems = prove([outside(after={"pid": PID, "generation": 1})], between_log(), journal=[])
    assert "still answered from pid 4242 after the kill: that pid was not its process" in problems[0]
    rows, problems = prove([outside(killed_at=None, error="os.kill(4242): No such process")], between_log(), [])
    assert rows == [] and problems == ["fault kill_controller at between_refits did not fire: os.kill(4242): No such "
                                       "process"]


# ---------------------------------------------------------------------------------- firing
class _Fleet:
    """A controller that can be armed, or whose (stand-in) process can be killed; it restarts at the next call."""

    def __init__(self, pid, process=None):
        self.pid, self.generation, self.armed, self.faults = pid, 0, [], []
        self.process = process  # the stand-in controller process, if any
        self.client = self

    def controller_info(self):
        if self.process is not None and self._died():
            self.pid, self.generation = NEW_PID, self.generation + 1  # "Ray restarted it"
        return {"fleet": "f", "generation": self.generation, "pid": self.pid, "stopped": None}

    def _died(self):
        try:
            self.process.wait(timeout=0.5)
            return True
        except subprocess.TimeoutExpired:
            return False

    def fault_injector(self):  # the fake fleet is its own injector
        return self

    def arm_controller_crash(self, point, delay_s=0.0):
        self.armed.append((point, delay_s))
        return True

    incarnation, dies_as_armed = 1, 0  # the next ``dies_as_armed`` arms find the slot's incarnation dead

    def status(self):
        return {"ledger": {"slots": [{"slot": s, "state": "healthy", "incarnation": self.incarnation} for s in range(3)]}}

    def arm_fault(self, slot, point, action, delay_s=0.0, after_calls=0):
        if self.dies_as_armed:
            self.dies_as_armed -= 1
            self.incarnation += 1  # the controller replaced it
            raise RuntimeError(f"arm_fault({point!r}, {action!r}) on slot {slot} (incarnation {self.incarnation - 1}) "
                               "failed: died: ActorDiedError; nothing was armed (bound 30 s)")
        self.faults.append((slot, point, action, delay_s, self.incarnation))
        return True

    def controller_outage(self):
        return {"unreachable_since": None, "outages": self.generation, "down_s_total": 2.5 * self.generation,
                "completed_while_down": 3 * self.generation}


def test_a_crash_at_a_phase_is_armed_on_the_controller_with_its_delay():
    fleet = _Fleet(PID)
    firing = FaultFiring(fleet, [Firing(1, "transfer", "kill_controller", None, 0.75)])
    firing.at(1)
    assert fleet.armed == [("transfer", 0.75)]
    assert firing.fired[0]["controller"] == {"pid": PID, "generation": 0} and "killed_at" not in firing.fired[0]


def test_an_outside_kill_sigkills_the_pid_the_controller_named_then_waits_for_it():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        fleet = _Fleet(victim.pid, victim)
        firing = FaultFiring(fleet, [Firing(1, "between_refits", "kill_controller", None)], load=lambda: 8)
        firing.at(1)
        assert victim.returncode == -9, "SIGKILLed"
    finally:
        victim.kill()
    rec = firing.fired[0]
    assert rec["controller"] == {"pid": victim.pid, "generation": 0} and rec["killed_at"] > 0
    assert rec["after"] == {"pid": NEW_PID, "generation": 1}
    assert rec["outage"] == {"outages": 1, "down_s": 2.5, "completed_while_down": 3, "submitted_while_down": 8}


def test_a_slow_shard_is_made_fast_again_after_its_step():
    fleet = _Fleet(PID)
    firing = FaultFiring(fleet, [Firing(1, "transfer", "slow", 0, 2.0), Firing(1, "transfer", "kill_controller", None, 0.75)])
    firing.at(1)
    assert fleet.faults == [(0, "transfer", "slow", 2.0, 1)]
    assert [f.what for f in firing.settle(1)] == ["slow"] and fleet.faults[-1] == (0, "ping", "slow", 0.0, 1)
    assert firing.settle(2) == []


def test_a_shard_that_dies_as_its_fault_is_armed_gets_it_on_its_next_incarnation_once():
    fleet, said = _Fleet(PID), []
    fleet.dies_as_armed = 1
    firing = FaultFiring(fleet, [Firing(1, "generate", "freeze", 2)], log=said.append)
    firing.at(1)
    assert fleet.faults == [(2, "generate", "freeze", 0.0, 2)] and "died as its fault was armed" in said[0]
    fleet.dies_as_armed = 2  # dead again on the next incarnation: the plan fails, naming the slot
    with pytest.raises(RuntimeError, match="slot 2 .*died"):
        FaultFiring(fleet, [Firing(1, "generate", "freeze", 2)], log=said.append).at(1)


def test_a_slow_fault_is_proven_by_its_first_delayed_call_whatever_the_point():
    done = [{"step": 1, "where": "transfer", "what": "slow", "slot": 0, "delay_s": 2.0, "t": 0.5}]
    log = [ev(2.0, Fault, slot=0, incarnation=1, point="transfer", action="slow", armed=True)]
    shot = {"t": 2.2, "slot": 0, "incarnation": 1, "point": "ping", "action": "slow", "delay_s": 2.0}
    rows, problems = prove(done, log, [shot])
    assert problems == [] and rows[0]["point"] == "transfer" and rows[0]["t"] == 2.2
    rows, problems = prove(done, log, [{**shot, "incarnation": 2}])
    assert rows == [] and "did not fire" in problems[0]


# ---------------------------------------------------------------------------------- invariants across a restart
def requests_around_the_restart():
    """Requests completed on the shards while the controller was down (gate last open on 1) and after."""
    return [ev(1.5, Request, event="accepted", request_id="a"),
            ev(3.0, Request, event="completed", request_id="a", slot=0, incarnation=1, version=1),
            ev(5.5, Request, event="accepted", request_id="b"),
            ev(5.6, Request, event="completed", request_id="b", slot=2, incarnation=1, version=1)]


def test_the_invariants_hold_on_a_log_that_spans_a_controller_restart():
    log = sorted(restart_log() + [ev(0.5, Stamp, version=1, members=[[0, 1], [1, 1], [2, 1]], failed=[], unknown=[])]
                 + requests_around_the_restart(), key=lambda e: e["t"])
    assert inv.check_all(log, deadline_s=15.0) == []
    wrong = log + [ev(6.0, Request, event="completed", request_id="c", slot=1, incarnation=1, version=2),
                   ev(5.9, Request, event="accepted", request_id="c")]
    out = inv.check_all(sorted(wrong, key=lambda e: e["t"]), deadline_s=15.0)
    assert len(out) == 2 and all("request c" in o for o in out), "a wrong tag after the restart still counts"


def test_an_engine_the_successor_stamped_serves_the_committed_version_and_no_other():
    log = [ev(0.5, Stamp, version=1, members=[[0, 1]], failed=[], unknown=[]),
           ev(5.0, ControllerRestarted, fleet="f", generation=1, committed=2, refit=[2, "committed"], shutdown=False,
              stopped=None),
           ev(5.1, Adopt, slot=0, incarnation=1, weight_version=1, dirty=False, paused=True, serves=True, stamped=True),
           ev(5.1, Adopt, slot=1, incarnation=1, weight_version=2, dirty=False, paused=True, serves=True,
              stamped=False),
           ev(5.5, Request, event="completed", request_id="a", slot=0, incarnation=1, version=2),
           ev(5.6, Request, event="completed", request_id="b", slot=1, incarnation=1, version=2)]
    assert inv.version_tags_match_stamps(log) == []
    stale = log + [ev(5.7, Request, event="completed", request_id="c", slot=0, incarnation=1, version=1)]
    assert len(inv.version_tags_match_stamps(stale)) == 1
    unstamped = [dict(e, stamped=False) if Adopt.matches(e) else e for e in log]
    assert len(inv.version_tags_match_stamps(unstamped)) == 1, "slot 0 reported version 1: tag 2 is wrong"


@pytest.mark.parametrize("seconds, bad", [(1.0, False), (30.0, True)])
def test_a_phase_the_dead_controller_began_is_not_timed_but_ended_ones_still_are(seconds, bad):
    log = restart_log() + [ev(9.0, Phase, phase="pause", edge="end", version=2, seconds=seconds, seq=9)]
    assert bool(inv.phases_within_deadline(log, 15.0)) is bad


def test_a_failed_variant_names_every_slot_the_fleet_lost_and_why_a_passing_one_adds_nothing():
    """A variant that stops where it should recover says, in its notes, which shards the controller killed
    and which slots left the serving states, with the event log's reasons: a kill the plan did not make
    (a probe lost under load, say) is visible in the CI log, not only in a deleted event log."""
    losses = [ev(3.0, Health, slot=2, incarnation=1, before="healthy", after="suspect", reason="probe timed out"),
              ev(3.5, Health, slot=2, incarnation=1, before="suspect", after="dead", reason="2 probes failed"),
              ev(3.6, Kill, slot=2, incarnation=1, reason="dead: 2 probes failed"),
              ev(3.7, Health, slot=0, incarnation=1, before="stale", after="healthy", reason="stamped")]
    rep = judge(recovers(), [crash()], restart_log() + losses, journal=[])
    assert rep.passed and not any("slot 2" in n for n in rep.notes)
    stopped = VariantReport("controller-kill-during-pause", "recovers", "stops", accepted=4, completed=4)
    rep = judge(stopped, [crash()], restart_log() + losses, journal=[])
    assert not rep.passed
    assert rep.notes == ["slot 2 (incarnation 1) healthy -> suspect: probe timed out",
                         "slot 2 (incarnation 1) suspect -> dead: 2 probes failed",
                         "killed slot 2 (incarnation 1): dead: 2 probes failed"]
