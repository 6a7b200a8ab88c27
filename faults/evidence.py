"""Proof that each fault of a run went off where it was meant to and did what it should.

Arming a fault proves nothing (it may never go off), and a slot leaving ``healthy``
proves nothing either (every refit that lands passes through ``stale``). Two records
say that a fault went off, each written before the fault acts:

- the fault journal: the shard's hook appends a line (slot, incarnation, point,
  action, ``t``) and fsyncs it before it kills, freezes, crashes or lies
  (``fleet.shard.fault_hooks``; the runner names the file in ``EngineConfig.fault_journal``);
- the event log: the controller's ``fault`` record of a step-boundary kill, emitted
  just before it kills that incarnation. Its ``fault`` record of an armed fault
  says only which incarnation the fault was armed in.

``prove(done, events, journal)`` takes the firings the driver did
(``FaultFiring.fired``) and checks each: the controller armed it (or killed) on
the intended slot, it went off in that incarnation at its hook point, and that
incarnation then entered a state its action leads to (``LEADS_TO``). A trainer's
fault (``where: update`` or ``call``) is its own refit call, recorded by the driver as
it ended; its proof is the call's outcome and the event log around it:

- ``corrupt_<kind>``: the refit was refused (``RefitRefused``) naming the tensor
  (``REFUSAL_NAMES``), the log has its ``refit_rolled_back`` record naming it too, the
  fleet kept serving (gate open on the same version, every slot healthy), and a later
  refit reopened the gate on a newer version: ``rolled_back``;
- ``kill_sender``: the sender's actor was dead after the call (Ray's word), the refit
  reached its transfer and rolled back (``RefitSourceFailed`` naming the sender, its
  ``refit_rolled_back`` record), no refit of that version committed, the fleet kept
  serving (gate open on the same version, every slot healthy), and a later refit (from
  a new sender) reopened the gate on a newer version: ``rolled_back``;
- ``stale_version``: refused as not greater than the committed version, with no gate
  record and no phase of that version in the log while the call ran: ``refused``;
- ``concurrent_refit``: both calls ended, one committed, the other committed too or
  was refused as no longer greater, and the phases of the two refits never
  interleave: ``serialized``;
- ``refit_under_load``: the refit committed while client threads kept submitting
  (requests were alive while it ran), no ``latest`` request mixed versions, every
  request a lagging client sent under the pre-refit epoch was refused by its shard
  without running, and the shards' refusal counters grew by at least that many: ``held``;
- ``resize_under_load``: both resizes happened around a committed refit, the new engine
  served after it, the removed one finished what it held, admitted nothing more and was
  retired as removed, nothing lost (``faults.resize_evidence``): ``resized``;
- ``admission_hold_across_refit``: the refit committed, an engine holding requests had its stats missing
  for ``absent_fallback_s`` while it ran, every shard's admission cap after it is its cap before, no
  fallback was counted, and the held requests completed (``faults.admission_hold``): ``caps_kept``;
- ``readmit_*``: a fault in the middle of a stale engine's re-admission (``faults.readmit``): the donor's
  journal line shows the fault went off at ``donate`` with the copy under way, and the ``readmit`` records
  show what followed: another donor gave the weights (``readmitted``), the engine killed mid-copy restarted
  and its next incarnation was re-admitted (``restarted``), the copy yielded to the trainer's refit, which
  took the engine (``yielded``), the controller's successor re-admitted it (``readmitted``).

A ``kill_controller`` (``where: between_refits``, a refit phase or ``shutdown``) is proven
by the event log, which the restarted controller appends to: at a phase, the controller's
``fault`` record of the crash armed there, then its ``fault`` record ``fired: True`` from
the process the driver aimed at (``pid``), written just before it killed itself (a
delayed crash that found its phase over writes ``fired: False``: not fired); from
outside, the driver's own record of the ``os.kill`` on the pid the controller reported
just before, and the controller answering again from another process. Either way a
``controller_restarted`` record of a later generation follows, then that generation's
``adopted`` record (with ``shutdown_finished`` exactly when it died in the shutdown):
``restarted``; ``recover_s`` is firing -> ``adopted``, and ``completed_while_down`` counts the
requests that completed on the shards in between (the clients' records: the data plane
does not wait for the controller; a client only notices the death a second or so late).

It returns one evidence row per firing that went off (with fault -> reopen and time
to recover, measured from the firing) and one sentence per firing that failed.

Times: both records carry ``time.monotonic()`` of their process; on one host (the
local Ray of the fault runner and the soak) that is one clock. Pure: no Ray, no file;
nothing here raises on an incomplete log: a record that is missing proves nothing, and
the firing it would have proved is reported as not fired.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from rlfleet.faults.admission_hold import prove_admission_hold_across_refit
from rlfleet.faults.firing import hook_point
from rlfleet.faults.loop_fault import prove_loop_error_then_kill
from rlfleet.faults.operator import prove_controller_kill_under_keep_pause, prove_operator_resume_mid_refit
from rlfleet.faults.poison import prove_poison_in_batch, prove_poison_request
from rlfleet.faults.readmit import PROOFS as READMIT_PROOFS
from rlfleet.faults.relay_commit import prove_relay_commit_lost
from rlfleet.faults.resize_evidence import prove_resize_under_load
from rlfleet.faults.timeline import departure, fault_to_reopen, recover_s, refit_spans
from rlfleet.fleet.records import Adopted, ControllerRestarted, Fault, Gate, Phase, RefitRolledBack, Request, all_of
from rlfleet.health.faultplan import CONTROLLER_WHAT, CORRUPTIONS, TRAINER_WHERE
from rlfleet.refit.manifest import layer_group

QUARANTINE_OR_DEAD = ("suspect", "hung", "dead", "retired")
# What a fault's action leads to. A shard's: the health states it puts the incarnation it hit into
# (health.core): killed or crashed -> dead (retired when the restart budget is spent); frozen, hung or
# unavailable -> quarantined, later evicted; a lie -> its weight stamp dropped (stale). ``slow`` and ``delay``
# lead nowhere by necessity. A trainer's: what became of its refit call (module docstring). The controller's: it was
# restarted and re-adopted the fleet.
LEADS_TO: dict[str, tuple[str, ...]] = {
    "kill": ("dead", "retired"),
    "crash_engine": ("dead", "retired"),
    "freeze": QUARANTINE_OR_DEAD,
    "freeze_core": QUARANTINE_OR_DEAD,
    "hang": QUARANTINE_OR_DEAD,
    "unavailable": QUARANTINE_OR_DEAD,
    "false_ack": ("stale",) + QUARANTINE_OR_DEAD,
    "error": ("stale",) + QUARANTINE_OR_DEAD,
    "slow": (),
    "delay": (),
    **{f"corrupt_{kind}": ("rolled_back",) for kind in CORRUPTIONS},
    "kill_sender": ("rolled_back",),
    "stale_version": ("refused",),
    "concurrent_refit": ("serialized",),
    "refit_under_load": ("held",),
    "resize_under_load": ("resized",),
    "poison_request": ("contained",),
    "poison_in_batch": ("contained",),
    "operator_resume_mid_refit": ("owned",),
    "controller_kill_under_keep_pause": ("kept_paused",),
    "loop_error_then_kill": ("found",),
    "relay_commit_lost": ("kept",),
    "admission_hold_across_refit": ("caps_kept",),
    "readmit_donor_killed": ("readmitted",),
    "readmit_engine_killed": ("restarted",),
    "readmit_refit_mid_copy": ("yielded",),
    "readmit_controller_killed": ("readmitted",),
    "kill_controller": ("restarted",),
}
# What a refused corrupt update's message must say, for the corrupted tensor ``t`` (refit.manifest's words).
REFUSAL_NAMES = {
    "shape": lambda t: f"tensor {t}: shape",
    "dtype": lambda t: f"tensor {t}: dtype",
    "missing_tensor": lambda t: f"missing tensors: {t}",
    "missing_layer": lambda t: f"missing tensors: {layer_group(t)}.*",
}
NOT_GREATER = "is not greater than the committed version"
FIELDS = ("slot", "incarnation", "point", "action")


def _take(records: list[dict], **want) -> dict | None:
    """Remove and return the first record whose fields equal ``want`` (each record proves one firing)."""
    for i, r in enumerate(records):
        if all(r.get(k) == v for k, v in want.items()):
            return records.pop(i)
    return None


def describe(fault: Mapping) -> str:
    """``kill at transfer on slot 0 (incarnation 1)`` for a firing, an evidence row or a record;
    ``corrupt_shape at update`` for a trainer's fault."""
    where = fault.get("where", fault.get("point"))
    what = f"{fault.get('what', fault.get('action'))} at {where}"
    if fault.get("slot") is None:
        return what
    inc = f" (incarnation {fault['incarnation']})" if fault.get("incarnation") is not None else ""
    return f"{what} on slot {fault['slot']}{inc}"


def evidence(events: list[dict], fired: Mapping) -> dict:
    """What followed one firing: the departure it caused, fault -> reopen and time to recover (seconds)."""
    left = departure(events, fired["slot"], fired["incarnation"], fired["t"], LEADS_TO[fired["action"]])
    return {
        **{k: fired[k] for k in FIELDS},
        "t": fired["t"],
        "left_for": left.after if left else None,
        "fault_to_reopen_s": fault_to_reopen(events, fired["t"]),
        "recover_s": recover_s(events, left) if left else None,
    }


def had_effect(row: Mapping) -> bool:
    """The firing of an evidence row was followed by what its action leads to."""
    return not LEADS_TO[row["action"]] or row["left_for"] is not None


def prove(done: Iterable[Mapping], events: list[dict], journal: Iterable[dict]) -> tuple[list[dict], list[str]]:
    """Evidence rows of the firings in ``done`` that went off, and a sentence for each that failed (see above)."""
    arms = [a.as_dict() for a in Fault.among(events, lambda a: bool(a.armed))]  # matched like the journal's lines
    shots = [dict(r) for r in journal]
    rows: list[dict] = []
    problems: list[str] = []
    for f in done:
        if f["where"] in TRAINER_WHERE:
            row, wrong = _prove_trainer_fault(f, events)
        elif f["what"] in CONTROLLER_WHAT:
            row, wrong = _prove_controller_fault(f, arms, events)
        else:
            row, wrong = _prove_shard_fault(f, arms, shots, events)
        rows += [row] if row is not None else []
        problems += wrong
    return rows, problems


def _prove_shard_fault(f: Mapping, arms: list[dict], shots: list[dict], events: list[dict]) -> tuple[dict | None, list[str]]:
    point = hook_point(f["where"], f["what"])
    arm = _take(arms, slot=f["slot"], point=point, action=f["what"])
    if arm is None:
        return None, [f"fault {describe(f)} did not fire: the event log has no 'fault' record of it "
                      f"(the controller never armed it)"]
    if point == "step_boundary":
        fired = arm
    else:
        want = {k: arm[k] for k in FIELDS}
        if arm["action"] == "slow":  # it delays every hooked call from its arming on: journaled at the first
            want.pop("point")
        fired = _take(shots, **want)
        fired = fired if fired is None else {**fired, "point": arm["point"]}
    if fired is None:
        return None, [f"fault {describe(arm)} did not fire: armed at t={arm['t']:.3f}, but no shard "
                      f"recorded it going off in the fault journal"]
    row = evidence(events, fired)
    if had_effect(row):
        return row, []
    return row, [f"fault {describe(row)} fired at t={row['t']:.3f}, but that incarnation never became "
                 f"{' or '.join(LEADS_TO[row['action']])} after it (no such health record)"]


# ---------------------------------------------------------------------------------- the controller's faults
def _prove_controller_fault(f: Mapping, arms: list[dict], events: list[dict]) -> tuple[dict | None, list[str]]:
    """A row for a ``kill_controller`` that went off (module docstring); ``left_for`` is ``restarted`` when
    the controller came back and re-adopted the fleet, else None, and the sentences say what did not."""
    where, aimed, wrong = f["where"], f.get("controller") or {}, []
    if where == "between_refits":
        t = f.get("killed_at")
        if t is None:
            return None, [f"fault {describe(f)} did not fire: {f.get('error') or 'the driver killed no process'}"]
        after = f.get("after") or {}
        if after.get("pid") == aimed.get("pid"):
            wrong.append(f"the controller still answered from pid {aimed.get('pid')} after the kill: "
                         "that pid was not its process")
    else:
        arm = _take(arms, target="controller", point=where, action="crash")
        if arm is None:
            return None, [f"fault {describe(f)} did not fire: the event log has no 'fault' record of the "
                          f"controller's crash armed at {where}"]
        shot = Fault.first(events, lambda s: s.fired is not None and s.t >= arm["t"], target="controller", point=where)
        if shot is None:
            return None, [f"fault {describe(f)} did not fire: armed at t={arm['t']:.3f}, but the controller "
                          f"never recorded it going off (it did not reach {where})"]
        if not shot.fired:
            return None, [f"fault {describe(f)} did not fire: {shot.reason or 'the controller says it did not'}"]
        if shot.pid != aimed.get("pid"):
            wrong.append(f"it fired in pid {shot.pid}, not in the controller's process the driver "
                         f"armed (pid {aimed.get('pid')})")
        t = shot.t
    generation = aimed.get("generation", -1)
    restarted = ControllerRestarted.first(events, lambda r: r.t >= t and r.generation > generation)
    adopted = None if restarted is None else Adopted.first(events, lambda a: a.t >= restarted.t,
                                                           generation=restarted.generation)
    if restarted is None:
        wrong.append(f"no controller_restarted record of a generation above {generation} follows the kill at "
                     f"t={t:.3f}: the controller did not come back")
    elif adopted is None:
        wrong.append(f"the controller restarted (generation {restarted.generation}) but no adopted record "
                     "follows: it never re-adopted the fleet")
    elif bool(adopted.shutdown_finished) != (where == "shutdown"):
        wrong.append(f"the restarted controller's adopted record {'lacks' if where == 'shutdown' else 'has'} "
                     f"shutdown_finished: {adopted}")
    row = {"slot": None, "incarnation": None, "point": where, "action": f["what"], "t": t,
           "left_for": None if wrong else LEADS_TO[f["what"]][0],
           "fault_to_reopen_s": fault_to_reopen(events, t),
           "recover_s": None if adopted is None else round(adopted.t - t, 3),
           "generation": None if restarted is None else restarted.generation,
           "adopt_s": None if adopted is None else adopted.seconds,
           "completed_while_down": len(Request.among(
               events, lambda r: t <= r.t <= (adopted.t if adopted else float("inf")), event=Request.COMPLETED)),
           **({"outage": f["outage"]} if "outage" in f else {})}
    return row, [f"fault {describe(f)}: {w}" for w in wrong]


# ---------------------------------------------------------------------------------- a trainer's faults
def _prove_trainer_fault(f: Mapping, events: list[dict]) -> tuple[dict | None, list[str]]:
    """A row for the refit call(s) the fault made (it went off when they were made); ``left_for`` is what it
    leads to when every sentence of its proof holds, else None, and the sentences say what did not."""
    calls = f.get("calls") or []
    if not calls:
        return None, [f"fault {describe(f)} did not fire: the driver made no refit call for it"]
    what = f["what"]
    prover = _corrupt_update if what.startswith("corrupt_") else _TRAINER_PROOFS[what]
    wrong = [f"fault {describe(f)} (version(s) {', '.join(str(c['version']) for c in calls)}): {p}"
             for p in prover(f, calls, events)]
    began = min(c["began"] for c in calls)
    row = {"slot": None, "incarnation": None, "point": f["where"], "action": what, "t": began,
           "left_for": None if wrong else LEADS_TO[what][0],
           "fault_to_reopen_s": fault_to_reopen(events, began), "recover_s": None}
    if f.get("returned"):
        row["returned"] = f["returned"]  # requests the fault had returned on purpose (a poison)
    if f.get("observed"):
        row["observed"] = f["observed"]  # what the driver measured of it (``faults.readmit``: kill -> serving)
    return row, wrong


def _corrupt_update(f: Mapping, calls: list[dict], events: list[dict]) -> list[str]:
    call, before, after = calls[0], f["before"], f["after"]
    names = REFUSAL_NAMES[f["what"].removeprefix("corrupt_")](f["tensor"])
    wrong = []
    if call["outcome"] != "refused" or names not in (call["error"] or ""):
        wrong.append(f"the refit was not refused naming {names!r}: {call['outcome']}: {call['error']}")
    back = RefitRolledBack.first(events, version=call["version"])
    if back is None or names not in back.reason:
        wrong.append(f"no refit_rolled_back record of version {call['version']} names {names!r}"
                     + (f" (it says {back.reason[:200]!r})" if back else ""))
    return wrong + _kept_then_refit(before, after, call, events, "refit")


def _kept_then_refit(before: Mapping, after: Mapping, call: Mapping, events: list[dict], later: str) -> list[str]:
    """A refit that changed nothing: the fleet still serves ``before``'s version with every slot healthy, and a
    ``later`` refit, after the call ended, reopened the gate on a newer version."""
    wrong = []
    kept = after["gate_open"] and after["version"] == before["version"] and set(after["states"].values()) == {"healthy"}
    if not kept:
        wrong.append(f"the fleet did not keep serving version {before['version']} with every slot healthy: {after}")
    if not Gate.among(events, lambda g: g.version > before["version"] and g.t > call["ended"], open=True):
        wrong.append(f"no later {later} reopened the gate on a version above {before['version']}")
    return wrong


def _killed_sender(f: Mapping, calls: list[dict], events: list[dict]) -> list[str]:
    call, before, after, v = calls[0], f["before"], f["after"], calls[0]["version"]
    wrong = []
    if f.get("sender_state") != "DEAD":
        wrong.append(f"the sender was not killed: Ray says its actor is {f.get('sender_state')!r}")
    if Phase.first(events, phase="transfer", edge="begin", version=v) is None:
        wrong.append("the refit never reached its transfer: the sender was not killed mid-refit")
    if call["outcome"] != "rolled_back" or "RefitSourceFailed" not in (call["error"] or "") \
            or f["sender"] not in (call["error"] or ""):
        wrong.append(f"the refit did not roll back with RefitSourceFailed naming {f['sender']}: "
                     f"{call['outcome']}: {call['error']}")
    if RefitRolledBack.first(events, version=v) is None:
        wrong.append(f"no refit_rolled_back record of version {v}")
    if Gate.first(events, open=True, version=v) is not None:
        wrong.append(f"the gate opened on version {v}, which the killed sender never delivered")
    return wrong + _kept_then_refit(before, after, call, events, "refit (from a new sender)")


def _stale_version(f: Mapping, calls: list[dict], events: list[dict]) -> list[str]:
    call = calls[0]
    wrong = []
    if call["outcome"] != "refused" or NOT_GREATER not in (call["error"] or ""):
        wrong.append(f"the refit was not refused as not greater than the committed version: "
                     f"{call['outcome']}: {call['error']}")
    during = [e for e in all_of(events) if call["began"] <= e.t <= call["ended"]
              and (isinstance(e, Gate) or (isinstance(e, Phase) and e.version == call["version"]))]
    if during:
        changed = [(e.kind, e.phase if isinstance(e, Phase) else e.open) for e in during]
        wrong.append(f"the refused call changed something: {changed}")
    return wrong


def _concurrent_refits(f: Mapping, calls: list[dict], events: list[dict]) -> list[str]:
    wrong = []
    committed = [c["version"] for c in calls if c["outcome"] == "committed"]
    refused_ok = all(c["outcome"] == "committed" or (c["outcome"] == "refused" and NOT_GREATER in c["error"])
                     for c in calls)
    if not committed or not refused_ok:
        wrong.append("not one committed and the other committed or refused as no longer greater: "
                     f"{[(c['version'], c['outcome'], c['error']) for c in calls]}")
    spans = {s["version"]: s for s in refit_spans(events) if s["version"] in {c["version"] for c in calls}}
    missing = [v for v in committed if v not in spans]
    if missing:
        wrong.append(f"no phase records of the committed refit(s) {missing}")
    if len(spans) == 2:
        a, b = sorted(spans.values(), key=lambda s: s["begin"])
        if b["begin"] < a["end"]:
            wrong.append(f"the refits overlapped: version {b['version']} began at t={b['begin']:.3f}, before "
                         f"version {a['version']} ended at t={a['end']:.3f}")
    return wrong


def _refit_under_load(f: Mapping, calls: list[dict], events: list[dict]) -> list[str]:
    call, wrong = calls[0], []
    if call["outcome"] != "committed":
        wrong.append(f"the refit under load did not commit: {call['outcome']}: {call['error']}")
    if not f["overlapping"]:
        wrong.append(f"no request was alive while the refit ran ({f['submitted']} submitted): the load did not overlap it")
    if f["mixed"]:
        wrong.append(f"{f['mixed']} 'latest' request(s) completed with samples from two versions")
    lagging = f["lagging"]
    if not lagging:
        wrong.append("the lagging client sent nothing while the gate was closed")
    ran = [s for s in lagging if not s["refused"]]
    if ran:
        wrong.append(f"shards took work routed under the pre-refit epoch {f['stale_epoch']}: {ran}")
    counted = sum(f["refused_delta"].values())
    if counted < len(lagging):
        wrong.append(f"the shards counted {counted} refusal(s) for {len(lagging)} lagging request(s): {f['refused_delta']}")
    return wrong


_TRAINER_PROOFS = {"kill_sender": _killed_sender, "stale_version": _stale_version, "concurrent_refit": _concurrent_refits,
                   "refit_under_load": _refit_under_load, "resize_under_load": prove_resize_under_load,
                   "poison_request": prove_poison_request, "poison_in_batch": prove_poison_in_batch,
                   "operator_resume_mid_refit": prove_operator_resume_mid_refit,
                   "controller_kill_under_keep_pause": prove_controller_kill_under_keep_pause,
                   "loop_error_then_kill": prove_loop_error_then_kill,
                   "relay_commit_lost": prove_relay_commit_lost,
                   "admission_hold_across_refit": prove_admission_hold_across_refit, **READMIT_PROOFS}
