"""A stale engine's re-admission from a live peer (issue 48) meeting a fault in the middle of its copy.

Each scenario kills one serving engine (``stale``): it restarts on the checkpoint, stale while the fleet has
committed a later version, and the controller re-admits it from a donor (``fleet.control.readmission``: the
serving engines, in slot order), with no refit and no new version. The first donor is armed at its hook
point ``donate`` (``fleet.shard.fault_hooks``), which it reaches with the receiver already waiting in its
receive, and the shard journals the fault before it acts: the driver acts on that line, in the middle of the
copy.

- ``readmit_donor_killed``: the first donor dies as it begins to send (``kill`` at ``donate``). The stale
  engine stays stale; the next donor gives the weights: the end record is ``readmitted`` from another donor
  and names the dead one in ``tried``, and the engine turned healthy only then.
- ``readmit_engine_killed``: the first donor's send is held back ``DELAY_S`` (``delay`` at ``donate``); the
  stale engine is killed while its receive waits: a normal restart (that incarnation dead, never healthy),
  and its next incarnation is re-admitted.
- ``readmit_refit_mid_copy``: the send held back, the trainer's refit begins with requests in flight: the
  copy yields (``yielded``) before the refit pauses anything, the refit commits and takes the engine by its
  state (a participant stamped with the refit's version, or left out and re-admitted at it after), every
  request completes; the committed version is the trainer's.
- ``readmit_controller_killed``: the send held back, the controller's process is SIGKILLed from here: Ray
  restarts it, its successor finds the engine stale and re-admits it (``readmitted`` after the successor's
  ``adopted`` record); the committed version does not change.

Meant for shards with no vLLM engine (``faults.matrix.NULL``: real actors, the real controller and the copy's
real bytes over gloo, proven by digests): the point is the controller's decisions; the real vLLM copy is
``tests/integration/test_peer_copy.py``'s. Each returns a record for ``faults.evidence``; ``prove_*`` turns it
into the sentences of what went wrong (empty: the fault fired mid-copy and did what it should).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, Mapping

from rlfleet.faults.polling import wait_until
from rlfleet.faults.timeline import read_log
from rlfleet.fleet.records import Adopted, ControllerRestarted, Fault, Health, Phase, Readmit, Record, Stamp

DELAY_S = 3.0  # the first donor's send held back this long: the driver acts while the receiver waits
UP_S = 60.0  # a NULL engine restarts in about a second; a loaded host may take longer
PROMPT = [3, 13, 23, 33]
SAMPLING = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
DEAD = ("dead", "restarting", "retired")

Sync = Callable[[int], dict]  # ``FaultFiring._sync``: one refit of that version; its call record


# ---------------------------------------------------------------------------------- the scenarios
def readmit_donor_killed(fleet, new_version: Callable[[], int], sync: Sync, say: Callable[[str], Any] = print,
                         stale: int = 2) -> dict:
    f = _copy_with_fault(fleet, _committed(fleet, new_version, sync), stale, "kill", 0.0)
    _readmitted(f, fleet, f["incarnation"])
    say(f"readmit, donor killed: slot {f['donor']} died as it began to send ({_seen(f)}); slot {stale} "
        f"{'serves again' if f['served'] else 'never served again'}")
    return _end(f, fleet)


def readmit_engine_killed(fleet, new_version: Callable[[], int], sync: Sync, say: Callable[[str], Any] = print,
                          stale: int = 1) -> dict:
    f = _copy_with_fault(fleet, _committed(fleet, new_version, sync), stale, "delay", DELAY_S)
    if f["shot"] is not None:
        fleet.fault_injector().kill_shard(stale)
        f["killed_at"] = round(time.monotonic(), 6)
        _readmitted(f, fleet, f["incarnation"] + 1)
    say(f"readmit, engine killed: slot {stale} (incarnation {f['incarnation']}) killed mid-copy ({_seen(f)}); "
        f"{'its next incarnation serves' if f['served'] else 'it never served again'}")
    return _end(f, fleet)


def readmit_refit_mid_copy(fleet, new_version: Callable[[], int], sync: Sync, say: Callable[[str], Any] = print,
                           stale: int = 2) -> dict:
    calls = _committed(fleet, new_version, sync)
    version = new_version()  # the trainer's step, taken before the copy starts: its refit follows the shot at once
    f = _copy_with_fault(fleet, calls, stale, "delay", DELAY_S)
    if f["shot"] is not None:
        pending = [fleet.submit(PROMPT, 2, SAMPLING) for _ in range(4)]  # in flight when the refit begins
        f["calls"] = [sync(version)]
        got = [r for p in pending for r in fleet.collect(p)]
        f["requests"] = {"submitted": len(got), "ok": sum(1 for r in got if r.ok),
                         "versions": sorted({r.result.weight_version for r in got if r.ok})}
        _readmitted(f, fleet, f["incarnation"], version)
        stamp = Stamp.first(fleet.events(kinds=[Stamp]), version=version)
        f["observed"]["joined"] = "stamped by the refit" if stamp and any(m[0] == stale for m in stamp.members) \
            else "re-admitted after the refit"
    say(f"readmit, refit mid-copy: version {version} refit {f['calls'][0]['outcome']} ({_seen(f)}); slot {stale} "
        f"{'serves it' if f['served'] else 'does not serve it'}")
    return _end(f, fleet)


def readmit_controller_killed(fleet, new_version: Callable[[], int], sync: Sync, say: Callable[[str], Any] = print,
                              stale: int = 0) -> dict:
    info = fleet.controller_info()  # read before the copy: its kill follows the donor's journal line at once
    f = _copy_with_fault(fleet, _committed(fleet, new_version, sync), stale, "delay", DELAY_S)
    f["controller"] = {"pid": info["pid"], "generation": info["generation"]}
    if f["shot"] is not None:
        os.kill(info["pid"], signal.SIGKILL)
        f["killed_at"] = round(time.monotonic(), 6)
        after = fleet.controller_info()  # waits for the restarted controller (it re-adopts first)
        f["generation"] = [info["generation"], after["generation"]]
        _readmitted(f, fleet, f["incarnation"])
    say(f"readmit, controller killed mid-copy ({_seen(f)}): generation {f.get('generation')}; slot {stale} "
        f"{'serves again' if f['served'] else 'never served again'}")
    return _end(f, fleet)


# ---------------------------------------------------------------------------------- shared steps
def _status(fleet) -> dict:
    """The committed version, the gate, and each slot's (state, incarnation, weight version), a slot retired
    (removed by a resize, its budget spent) left out."""
    s = fleet.status()
    return {"version": s["version"], "gate_open": s["gate_open"],
            "slots": {r["slot"]: (r["state"], r["incarnation"], r["weight_version"]) for r in s["ledger"]["slots"]
                      if r["state"] != "retired"}}


def _all_serve(fleet, version: int | None = None) -> bool:
    s = _status(fleet)
    v = s["version"] if version is None else version
    return all(state == "healthy" and wv == v for state, _, wv in s["slots"].values())


def _committed(fleet, new_version: Callable[[], int], sync: Sync) -> list[dict]:
    """A committed version >= 1 (a refit if there is none: version 0 is the checkpoint, which a restarted engine
    loads by itself, with nothing to re-admit); the refit's call record, if one ran."""
    return [] if fleet.status()["version"] >= 1 else [sync(new_version())]


def _copy_with_fault(fleet, calls: list[dict], stale: int, action: str, delay_s: float) -> dict:
    """Every slot serving; the first donor armed at ``donate``; ``stale`` killed; wait (bounded) for the donor's
    journal line: the copy into the restarted engine is under way."""
    journal = fleet.config.engine.fault_journal
    if not journal:
        raise ValueError("the re-admission scenarios prove their fault by the shards' fault journal: "
                         "give the fleet's engine config a fault_journal")
    wait_until(lambda: _all_serve(fleet), UP_S)
    before = _status(fleet)
    donor = min(s for s in before["slots"] if s != stale)  # donors are tried in slot order
    t0 = time.monotonic()
    fleet.fault_injector().arm_fault(donor, "donate", action, delay_s)
    inc = before["slots"][stale][1]
    fleet.fault_injector().kill_shard(stale)
    killed_at = time.monotonic()

    def shot() -> dict | None:
        return next((r for r in read_log(journal) if r["t"] >= t0 and r.get("slot") == donor
                     and r.get("point") == "donate" and r.get("action") == action), None)

    wait_until(lambda: shot() is not None, UP_S, poll_s=0.05)
    began = round(t0, 6)
    return {"stale": stale, "donor": donor, "action": action, "delay_s": delay_s, "killed": inc,
            "incarnation": _status(fleet)["slots"][stale][1], "before": before, "shot": shot(), "t0": began,
            "calls": calls or [{"version": before["version"], "outcome": "copied", "error": None, "began": began,
                                "ended": began}], "served": False, "stale_killed_at": round(killed_at, 6)}


def _readmitted(f: dict, fleet, incarnation: int, version: int | None = None) -> None:
    """Wait (bounded) until slot ``f['stale']``, at ``incarnation`` or a later one, serves ``version`` (the
    committed one by default)."""
    def serves() -> bool:
        s = _status(fleet)
        state, inc, wv = s["slots"][f["stale"]]
        return state == "healthy" and inc >= incarnation and wv == (s["version"] if version is None else version)

    f["served"] = wait_until(serves, UP_S, poll_s=0.1)
    since = f.get("killed_at", f["stale_killed_at"])  # the last kill: the stale engine's, or the controller's
    f["observed"] = {"kill_to_serving_s": round(time.monotonic() - since, 2) if f["served"] else None}


def _end(f: dict, fleet) -> dict:
    """Every slot back serving (the killed donor re-admitted too), then the fleet as it ends the scenario."""
    wait_until(lambda: _all_serve(fleet), UP_S)
    f["after"] = _status(fleet)
    f["calls"][-1]["ended"] = round(time.monotonic(), 6)
    return f


def _seen(f: Mapping) -> str:
    shot = f["shot"]
    return "its journal line seen" if shot else f"no journal line of {f['action']} at donate on slot {f['donor']}"


# ---------------------------------------------------------------------------------- the proofs
def _copy_records(f: Mapping, events: list, wrong: list[str]) -> tuple[dict | None, list[Readmit]]:
    """The donor's journal line, and the ``readmit`` records of the stale slot since the scenario began; a
    sentence when the fault did not fire where it was meant to (the first donor, with the copy under way)."""
    shot = f["shot"]
    if shot is None:
        wrong.append(f"the {f['action']} armed at donate on slot {f['donor']} never went off: no journal line "
                     "(no copy reached its donor)")
        return None, []
    recs = Readmit.among(events, lambda r: r.t >= f["t0"], slot=f["stale"])
    begun = [r for r in recs if r.edge == "begin" and r.t <= shot["t"]]
    if not begun:
        wrong.append(f"the {f['action']} went off on slot {f['donor']} at t={shot['t']:.3f} with no re-admission "
                     f"of slot {f['stale']} under way")
    elif begun[-1].donor != f"slot {f['donor']}":
        wrong.append(f"the re-admission of slot {f['stale']} began with donor {begun[-1].donor}, not slot "
                     f"{f['donor']} where the fault was armed")
    return shot, recs


def _mid_copy(f: Mapping, shot: dict, recs: list[Readmit], t: float, what: str, wrong: list[str]) -> None:
    """``what`` happened at ``t`` while the donor held its send back and before the copy into the stale
    incarnation ended."""
    inc = f["incarnation"]
    if not shot["t"] <= t <= shot["t"] + f["delay_s"]:
        wrong.append(f"{what} at t={t:.3f}, not while the donor held its send ({shot['t']:.3f} + {f['delay_s']} s)")
    ended = [r for r in recs if r.edge == "end" and r.incarnation == inc and r.t < t]
    if ended:
        wrong.append(f"the copy into slot {f['stale']} (incarnation {inc}) had ended ({ended[0].outcome}) "
                     f"before {what}")


def _served_unchanged(f: Mapping, wrong: list[str]) -> None:
    if not f["served"]:
        wrong.append(f"slot {f['stale']} never served the committed version again")
    before, after = f["before"]["version"], f["after"]["version"]
    if after != before:
        wrong.append(f"the committed version went {before} -> {after} with no trainer update: a version burned")
    off = {s: v for s, v in f["after"]["slots"].items() if v[0] != "healthy" or v[2] != after}
    if off or not f["after"]["gate_open"]:
        wrong.append(f"the fleet did not end serving version {after} on every slot with the gate open: {f['after']}")


def _healthy_after(events: list, slot: int, inc: int, t: float) -> Health | None:
    return Health.first(events, lambda h: h.t >= t and h.after == "healthy", slot=slot, incarnation=inc)


def prove_readmit_donor_killed(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong: list[str] = []
    shot, recs = _copy_records(f, events, wrong)
    if shot is None:
        return wrong
    donor, inc = f"slot {f['donor']}", f["incarnation"]
    if Health.first(events, lambda h: h.t >= shot["t"] and h.after in DEAD, slot=f["donor"],
                    incarnation=shot["incarnation"]) is None:
        wrong.append(f"the donor {donor} (incarnation {shot['incarnation']}) was not found dead after its kill")
    done = next((r for r in recs if r.edge == "end" and r.incarnation == inc), None)
    if done is None or done.outcome != "readmitted" or done.donor in (None, donor):
        wrong.append(f"the copy into slot {f['stale']} (incarnation {inc}) did not end re-admitted from another "
                     f"donor: {done}")
    elif not any(t.startswith(f"{donor}:") for t in done.tried or []):
        wrong.append(f"its end record does not name the donor that died ({donor}) among those tried: {done.tried}")
    else:
        first = _healthy_after(events, f["stale"], inc, f["t0"])
        if first is None or first.t > done.t or "re-admitted" not in first.reason:
            wrong.append(f"slot {f['stale']} (incarnation {inc}) did not stay stale until its re-admission: {first}")
    _served_unchanged(f, wrong)
    return wrong


def prove_readmit_engine_killed(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong: list[str] = []
    shot, recs = _copy_records(f, events, wrong)
    if shot is None:
        return wrong
    stale, inc = f["stale"], f["incarnation"]
    kill = Fault.first(events, lambda k: k.t >= shot["t"], slot=stale, incarnation=inc, action="kill")
    if kill is None:
        wrong.append(f"slot {stale} (incarnation {inc}) was not killed after the copy into it began")
        return wrong
    _mid_copy(f, shot, recs, kill.t, f"slot {stale}'s kill", wrong)
    if Health.first(events, lambda h: h.t >= kill.t and h.after in DEAD, slot=stale, incarnation=inc) is None:
        wrong.append(f"slot {stale} (incarnation {inc}) was not found dead after its kill: no normal restart")
    if _healthy_after(events, stale, inc, f["t0"]) is not None:
        wrong.append(f"slot {stale} (incarnation {inc}), killed mid-copy, served")
    later = next((r for r in recs if r.edge == "end" and r.incarnation > inc and r.outcome == "readmitted"), None)
    if later is None:
        wrong.append(f"no later incarnation of slot {stale} was re-admitted: "
                     f"{[(r.incarnation, r.edge, r.outcome) for r in recs]}")
    _served_unchanged(f, wrong)
    return wrong


def prove_readmit_refit_mid_copy(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong: list[str] = []
    shot, recs = _copy_records(f, events, wrong)
    if shot is None:
        return wrong
    stale, inc, call = f["stale"], f["incarnation"], calls[-1]
    v = call["version"]
    if call["outcome"] != "committed":
        return wrong + [f"the trainer's refit of version {v} did not commit: {call['outcome']}: {call['error']}"]
    close = Phase.first(events, lambda p: p.t >= shot["t"], phase="close", edge="begin", version=v)
    pause = Phase.first(events, lambda p: p.t >= shot["t"], phase="pause", edge="begin", version=v)
    if close is None or pause is None:
        return wrong + [f"no close and pause records of the refit of version {v}"]
    _mid_copy(f, shot, recs, close.t, f"the refit of version {v} began", wrong)
    ended = next((r for r in recs if r.edge == "end" and r.incarnation == inc), None)
    if ended is None or ended.outcome != "yielded" or ended.t > pause.t:
        wrong.append(f"the copy into slot {stale} (incarnation {inc}) did not yield before the refit paused its "
                     f"engines (pause at t={pause.t:.3f}): {ended}")
    stamp = Stamp.first(events, version=v)
    took = stamp is not None and any(m[0] == stale for m in stamp.members)
    again = any(r.edge == "end" and r.outcome == "readmitted" and r.version == v for r in recs)
    if not f["served"] or not (took or again):
        wrong.append(f"slot {stale} does not serve version {v}: the refit's stamp "
                     f"{'names' if took else 'does not name'} it and no re-admission at {v} followed")
    req = f["requests"]
    if req["ok"] != req["submitted"]:
        wrong.append(f"{req['submitted'] - req['ok']} of {req['submitted']} requests sent as the refit began "
                     "did not complete")
    if f["after"]["version"] != v:
        wrong.append(f"the fleet ends at version {f['after']['version']}, not the trainer's {v}: a version burned")
    return wrong


def prove_readmit_controller_killed(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong: list[str] = []
    shot, recs = _copy_records(f, events, wrong)
    if shot is None:
        return wrong
    _mid_copy(f, shot, recs, f["killed_at"], "the controller's kill", wrong)
    g0, g1 = f["generation"]
    if g1 != g0 + 1:
        wrong.append(f"the controller answered at generation {g1} after its kill at generation {g0}: "
                     "not restarted once")
    back = ControllerRestarted.first(events, lambda r: r.t >= f["killed_at"] and r.generation > g0)
    adopted = None if back is None else Adopted.first(events, lambda a: a.t >= back.t, generation=back.generation)
    if adopted is None:
        return wrong + [f"no controller_restarted and adopted records of a generation above {g0} after the kill"]
    again = next((r for r in recs if r.edge == "end" and r.t >= adopted.t and r.outcome == "readmitted"), None)
    if again is None:
        wrong.append(f"the successor (generation {back.generation}) never re-admitted slot {f['stale']}: "
                     f"{[(r.incarnation, r.edge, r.outcome) for r in recs if r.t >= adopted.t]}")
    _served_unchanged(f, wrong)
    return wrong


# the driver's scenario and its proof, by the plan's ``what`` (``health.faultplan.READMIT_FAULTS``)
SCENARIOS = {"readmit_donor_killed": readmit_donor_killed, "readmit_engine_killed": readmit_engine_killed,
             "readmit_refit_mid_copy": readmit_refit_mid_copy, "readmit_controller_killed": readmit_controller_killed}
PROOFS = {"readmit_donor_killed": prove_readmit_donor_killed, "readmit_engine_killed": prove_readmit_engine_killed,
          "readmit_refit_mid_copy": prove_readmit_refit_mid_copy,
          "readmit_controller_killed": prove_readmit_controller_killed}
