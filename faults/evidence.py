"""Proof that each fault of a run went off where it was meant to and did what it should.

Arming a fault proves nothing (it may never go off), and a slot leaving ``healthy``
proves nothing either (every refit that lands passes through ``stale``). Two records
say that a fault went off, each written before the fault acts:

- the fault journal: the shard's hook appends a line (slot, incarnation, point,
  action, ``t``) and fsyncs it before it kills, freezes, crashes or lies
  (``fleet.fault_hooks``; the runner names the file in ``EngineConfig.fault_journal``);
- the event log: the controller's ``fault`` record of a step-boundary kill, emitted
  just before it kills that incarnation. Its ``fault`` record of an armed fault
  says only which incarnation the fault was armed in.

``prove(done, events, journal)`` takes the firings the driver did
(``FaultFiring.fired``) and checks each: the controller armed it (or killed) on
the intended slot, it went off in that incarnation at its hook point, and that
incarnation then entered a state its action leads to (``LEADS_TO``). It returns one
evidence row per firing that went off (with fault -> reopen and time to recover,
measured from the firing) and one sentence per firing that failed.

Times: both records carry ``time.monotonic()`` of their process; on one host (the
local Ray of the fault runner and the soak) that is one clock. Pure: no Ray, no file;
nothing here raises on an incomplete log: a record that is missing proves nothing, and
the firing it would have proved is reported as not fired.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from faults.firing import hook_point
from faults.timeline import departure, fault_to_reopen, recover_s

QUARANTINE_OR_DEAD = ("suspect", "hung", "dead", "retired")
# The health states a fault's action puts the incarnation it hit into (health.core): killed or crashed -> dead
# (retired when the restart budget is spent); frozen or hung -> quarantined, later evicted; a lie -> its weight
# stamp dropped (stale). ``slow`` leads nowhere by necessity.
LEADS_TO: dict[str, tuple[str, ...]] = {
    "kill": ("dead", "retired"),
    "crash_engine": ("dead", "retired"),
    "freeze": QUARANTINE_OR_DEAD,
    "hang": QUARANTINE_OR_DEAD,
    "false_ack": ("stale",) + QUARANTINE_OR_DEAD,
    "slow": (),
}
FIELDS = ("slot", "incarnation", "point", "action")


def _take(records: list[dict], **want) -> dict | None:
    """Remove and return the first record whose fields equal ``want`` (each record proves one firing)."""
    for i, r in enumerate(records):
        if all(r.get(k) == v for k, v in want.items()):
            return records.pop(i)
    return None


def describe(fault: Mapping) -> str:
    """``kill at transfer on slot 0 (incarnation 1)`` for a firing, an evidence row or a record."""
    inc = f" (incarnation {fault['incarnation']})" if "incarnation" in fault else ""
    where = fault.get("where", fault.get("point"))
    return f"{fault.get('what', fault.get('action'))} at {where} on slot {fault['slot']}{inc}"


def evidence(events: list[dict], fired: Mapping) -> dict:
    """What followed one firing: the departure it caused, fault -> reopen and time to recover (seconds)."""
    left = departure(events, fired["slot"], fired["incarnation"], fired["t"], LEADS_TO[fired["action"]])
    return {
        **{k: fired[k] for k in FIELDS},
        "t": fired["t"],
        "left_for": left["after"] if left else None,
        "fault_to_reopen_s": fault_to_reopen(events, fired),
        "recover_s": recover_s(events, left) if left else None,
    }


def had_effect(row: Mapping) -> bool:
    """The firing of an evidence row was followed by the health transition its action leads to."""
    return not LEADS_TO[row["action"]] or row["left_for"] is not None


def prove(done: Iterable[Mapping], events: list[dict], journal: Iterable[dict]) -> tuple[list[dict], list[str]]:
    """Evidence rows of the firings in ``done`` that went off, and a sentence for each that failed (see above)."""
    arms = [e for e in events if e["kind"] == "fault" and e.get("armed")]
    shots = [dict(r) for r in journal]
    rows: list[dict] = []
    problems: list[str] = []
    for f in done:
        point = hook_point(f["where"], f["what"])
        arm = _take(arms, slot=f["slot"], point=point, action=f["what"])
        if arm is None:
            problems.append(f"fault {describe(f)} did not fire: the event log has no 'fault' record of it "
                            f"(the controller never armed it)")
            continue
        fired = arm if point == "step_boundary" else _take(shots, **{k: arm[k] for k in FIELDS})
        if fired is None:
            problems.append(f"fault {describe(arm)} did not fire: armed at t={arm['t']:.3f}, but no shard "
                            f"recorded it going off in the fault journal")
            continue
        row = evidence(events, fired)
        rows.append(row)
        if not had_effect(row):
            problems.append(f"fault {describe(row)} fired at t={row['t']:.3f}, but that incarnation never became "
                            f"{' or '.join(LEADS_TO[row['action']])} after it (no such health record)")
    return rows, problems
