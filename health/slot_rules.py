"""Rules for slot events: ``EngineReady``, ``Observed`` and ``RefitReport``.

Each ``on_*`` function reads the ledger through a ``Draft`` and records the new
records, actions and reasons (see ``health.core`` for the rule table). ``condemn``
and ``restart`` are shared with the fleet rules (evictions and due restarts).

Guarantee on failure: a malformed event raises ``ValueError`` naming the slot,
incarnation and value before anything is recorded; nothing here touches the ledger.
"""

from __future__ import annotations

from rlfleet.health.decision import AbortRefit, Evict, Probe, Restart, Retire, Transition
from rlfleet.health.draft import Draft
from rlfleet.health.events import EngineReady, Observed, RefitReport, SlotEvent
from rlfleet.health.ledger import SlotRecord, view_state
from rlfleet.health.states import CallKind, FailureClass, RefitResult, ShardState, SlotPhase

__all__ = ["condemn", "land_all", "on_observed", "on_ready", "on_report", "restart"]

_LAUNCHING = SlotPhase.LAUNCHING
_LIVE = SlotPhase.LIVE
_SUSPECT = SlotPhase.SUSPECT
_HUNG = SlotPhase.HUNG
_DEAD = SlotPhase.DEAD
_RETIRED = SlotPhase.RETIRED

_OK = FailureClass.OK
_COMPLETE = RefitResult.COMPLETE
_F_DEAD = FailureClass.DEAD
_F_SUSPECT = FailureClass.SUSPECT
_F_HUNG = FailureClass.HUNG
_F_LATE = FailureClass.LATE

_START = CallKind.START
_PROBE = CallKind.PROBE
_GENERATE = CallKind.GENERATE
_STAMP = CallKind.STAMP
_PAUSE_OR_RESUME = frozenset({CallKind.PAUSE, CallKind.RESUME})
# An engine whose stamp raised or lied this many refits in a row is evicted (one failure: stale until a refit
# stamps it; the second in a row says the engine cannot take a stamp, and a fresh incarnation can).
STAMP_FAILURES_TO_EVICT = 2

# Enum ``.value`` is a Python-level property; reasons are built on every event.
_NAME = {
    m: m.value for e in (CallKind, FailureClass, RefitResult, ShardState, SlotPhase) for m in e
}


def _resolve(d: Draft, ev: SlotEvent) -> SlotRecord | None:
    """The slot's record if ``ev`` is about its current, not-condemned incarnation;
    ``None`` (decision marked LATE) if it is about a replaced or dead one."""
    rec = _slot_record(d, ev)
    slot = ev.slot
    inc = ev.incarnation
    if inc == rec.incarnation:
        if rec.phase is _DEAD or rec.phase is _RETIRED:
            d.late(
                f"{_describe(ev)} from slot {slot} incarnation {inc}, which is already "
                f"{_NAME[rec.phase]} ({rec.reason}): ignored"
            )
            return None
        return rec
    if type(inc) is int and inc < rec.incarnation:
        d.late(
            f"late {_describe(ev)} from slot {slot} incarnation {inc}; the slot is on "
            f"incarnation {rec.incarnation}: ignored, it cannot condemn the replacement"
        )
        return None
    raise ValueError(
        f"{type(ev).__name__} names slot {slot} incarnation {inc!r}, which the ledger never "
        f"issued (current incarnation {rec.incarnation}); only Restart actions create "
        "incarnations"
    )


def _slot_record(d: Draft, ev: SlotEvent) -> SlotRecord:
    """The slot's record as the draft sees it: an earlier event of the same batch may have changed it."""
    slot = ev.slot
    records = d.ledger._records
    if type(slot) is not int or not 0 <= slot < len(records):
        raise ValueError(
            f"{type(ev).__name__} names slot {slot!r}, but the fleet has slots "
            f"0..{len(records) - 1}"
        )
    changed = d.changed
    return changed[slot] if slot in changed else records[slot]


def _describe(ev: SlotEvent) -> str:
    if type(ev) is Observed:
        return f"{_NAME[ev.call]} {_NAME[ev.failure]}" + (f" ({ev.detail})" if ev.detail else "")
    if type(ev) is RefitReport:
        return f"refit report ({_NAME[ev.result]}, version {ev.version})"
    return "ready"


def on_ready(d: Draft, ev: EngineReady) -> None:
    rec = _resolve(d, ev)
    if rec is not None:
        _ready(d, rec)


def _ready(d: Draft, rec: SlotRecord) -> None:
    if rec.phase is not _LAUNCHING:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} reported ready while "
            f"{_NAME[_state(d, rec)]}: nothing to do"
        )
        return
    cv = d.ledger._fleet.current_version
    target = "its first refit" if cv is None else f"a refit of version {cv} (or later)"
    reason = f"ready; stale until {target} lands on it"
    new = rec._replace(
        phase=_LIVE, weight_version=None, partial=False, since=d.now,
        failed_probes=0, restart_at=None, reason=reason,
    )
    d.put(rec, new)
    d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} is {reason}")


def on_observed(d: Draft, ev: Observed) -> None:
    f = ev.failure
    if f is FailureClass.EXHAUSTED or type(f) is not FailureClass or type(ev.call) is not CallKind:
        raise ValueError(
            f"Observed for slot {ev.slot} incarnation {ev.incarnation} has call {ev.call!r} "
            f"and failure {f!r}; it needs a CallKind and a FailureClass other than "
            "EXHAUSTED (EXHAUSTED is a fleet verdict, not an observation of one shard)"
        )
    if f is _F_LATE:  # the caller already classified it late; still check the slot
        _slot_record(d, ev)
        d.late(f"{_describe(ev)} from slot {ev.slot} incarnation {ev.incarnation}: ignored")
        return
    rec = _resolve(d, ev)
    if rec is None:
        return
    d.failure = f
    call = ev.call
    if f is _OK:
        _observed_ok(d, rec, call)
    elif f is _F_DEAD:
        condemn(d, rec, f"died during {_NAME[call]}: {ev.detail or 'ActorDiedError'}", evict=False)
    elif call is _PROBE:
        _failed_probe(d, rec, ev)
    elif call is _START:
        _start_failed(d, rec, ev)
    elif f is _F_SUSPECT or f is _F_HUNG:
        _quarantine(d, rec, ev)
    else:
        _bad_answer(d, rec, ev)


def _observed_ok(d: Draft, rec: SlotRecord, call: CallKind) -> None:
    if call is _START:
        _ready(d, rec)
        return
    if call is _STAMP and rec.stamp_failures:
        d.put(rec, rec._replace(stamp_failures=0, reason="stamp acknowledged"))
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} acknowledged its stamp: "
                         "its count of failed stamps is cleared")
        return
    if call is _PROBE and (rec.phase is _SUSPECT or rec.phase is _HUNG):
        new = rec._replace(phase=_LIVE, since=d.now, failed_probes=0, reason="probe ok")
        d.put(rec, new)
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} answered its probe: "
            f"{_NAME[_state(d, new)]} again"
        )
        return
    d.reasons.append(f"{_NAME[call]} ok on slot {rec.slot} incarnation {rec.incarnation}")


def _quarantine(d: Draft, rec: SlotRecord, ev: Observed) -> None:
    """SUSPECT or HUNG outside probes and starts."""
    what = "unavailable" if ev.failure is _F_SUSPECT else "hung (deadline passed)"
    cause = f"{what} during {_NAME[ev.call]}" + (f": {ev.detail}" if ev.detail else "")
    unacknowledged_resume = ev.failure is _F_SUSPECT and ev.call is CallKind.RESUME
    wedged = (ev.failure is _F_HUNG and ev.call in _PAUSE_OR_RESUME or unacknowledged_resume) \
        and rec.phase is not _LAUNCHING
    if wedged and d.ledger.config.on_hang == "evict":
        # A pause or resume nobody acknowledged leaves an engine in a state no probe can tell. Under
        # ``evict`` it is killed (a SIGKILL ends a stopped process too) and counts as dead: the refit goes
        # on with the rest when quorum holds, the slot restarts within its budget, and its clients re-send
        # its in-flight requests the moment the kill fails their calls.
        condemn(d, rec, f"{cause}; evicted (on_hang=evict)", evict=True)
        return
    unstamped = ev.call is _STAMP and rec.weight_version is not None
    if unstamped:
        # nobody knows which tag the engine carries now: it must not serve until a refit lands on it again
        # (a probe that finds it alive brings it back stale, never healthy)
        cause = f"{cause}; version unknown until a refit lands"
    if rec.phase is _LIVE:
        phase = _SUSPECT if ev.failure is _F_SUSPECT else _HUNG
        new = rec._replace(phase=phase, since=d.now, failed_probes=0, reason=cause,
                           weight_version=None if unstamped else rec.weight_version)
        d.put(rec, new)
        d.actions.append(Probe(rec.slot, rec.incarnation, d.now, cause))
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} {cause}: quarantined, probing"
        )
    else:
        if unstamped:
            d.put(rec, rec._replace(weight_version=None, reason=cause))
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} {cause} while "
            f"{_NAME[_state(d, rec)]}: state unchanged"
        )
    if wedged:
        # on_hang=stop (seed 001): a pause or resume nobody acknowledged stops the refit with the gate closed.
        _abort(d, rec, ev, cause)


def _bad_answer(d: Draft, rec: SlotRecord, ev: Observed) -> None:
    """LIED or ERROR in PAUSE, REFIT, RESUME or GENERATE."""
    what = "lied (ack not exactly True)" if ev.failure is FailureClass.LIED else "raised"
    cause = f"{_NAME[ev.call]} {what}" + (f": {ev.detail}" if ev.detail else "")
    if ev.call is _GENERATE or rec.phase is _LAUNCHING:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} {cause}: not a liveness "
            "signal, state unchanged"
        )
        return
    if ev.call is _STAMP:
        _stamp_refused(d, rec, cause)
        return
    if rec.weight_version is not None:
        new = rec._replace(weight_version=None, reason=f"{cause}; weights unknown")
        d.put(rec, new)
    d.reasons.append(
        f"slot {rec.slot} incarnation {rec.incarnation} {cause}: never counted as "
        "success, weights unknown until a refit lands"
    )
    _abort(d, rec, ev, cause)


def _stamp_refused(d: Draft, rec: SlotRecord, cause: str) -> None:
    """A stamp that raised or lied, after the commit: the engine answered, holds the new weights whole
    (its transfer landed) and kept its old tag, and ``end_refit`` aborted what it held. Its version is
    unknown: it is stale (out of routing) until a later refit lands on it and stamps it, and the refit goes
    on with the others (the gate reopens on quorum). Not a reason to stop the fleet: the version is
    committed on every engine that acknowledged. The ``STAMP_FAILURES_TO_EVICT``-th failure in a row
    evicts it: a fresh incarnation starts from the checkpoint and takes the next refit's stamp."""
    failures = rec.stamp_failures + 1
    if failures >= STAMP_FAILURES_TO_EVICT:
        condemn(d, rec, f"{cause}; its stamp failed {failures} refits in a row: evicted", evict=True)
        return
    d.put(rec, rec._replace(weight_version=None, stamp_failures=failures,
                            reason=f"{cause}; version unknown (stale) until a refit lands and stamps it"))
    d.reasons.append(
        f"slot {rec.slot} incarnation {rec.incarnation} {cause}: stale (version unknown, out of routing) "
        f"until a refit stamps it; the refit goes on with the others ({failures} of "
        f"{STAMP_FAILURES_TO_EVICT} failed stamps before eviction)"
    )


def _abort(d: Draft, rec: SlotRecord, ev: Observed, cause: str) -> None:
    fleet = d.fleet_now()
    version = fleet.refit_version
    which = f"the refit of version {version}" if version is not None else "the lifecycle step"
    message = (
        f"{_NAME[ev.call]} of slot {rec.slot} (incarnation {rec.incarnation}) failed: "
        f"{cause}; {which} stops and the gate stays closed"
    )
    d.actions.append(AbortRefit(rec.slot, rec.incarnation, ev.call, ev.failure, version, message))
    d.reasons.append("refit aborted")
    if version is not None and fleet.halted is None:
        # an exhausted fleet keeps its own reason: it is the permanent one (and in a batch the stop, decided
        # as the batch's last gate action, says so too: one by one and batched agree)
        reason = fleet.gate_reason if fleet.exhausted else message
        d.fleet = fleet._replace(halted=message, gate_open=False, gate_reason=reason)


def _failed_probe(d: Draft, rec: SlotRecord, ev: Observed) -> None:
    cause = f"probe {_NAME[ev.failure]}" + (f": {ev.detail}" if ev.detail else "")
    if rec.phase is _LAUNCHING:
        d.reasons.append(f"slot {rec.slot} is still starting; {cause} ignored")
        return
    quarantined = rec.phase is _SUSPECT or rec.phase is _HUNG
    failed = rec.failed_probes + 1 if quarantined else 1
    threshold = d.ledger.config.unhealthy_threshold
    if failed >= threshold:
        verdict = f"dead after {failed} failed probe(s) (unhealthy_threshold={threshold})"
        history = f"last {cause}; quarantined for: {rec.reason}" if quarantined else cause
        condemn(d, rec, f"{verdict}; {history}", evict=True)
        return
    if quarantined:
        new = rec._replace(failed_probes=failed)
    else:
        phase = _HUNG if ev.failure is _F_HUNG else _SUSPECT
        new = rec._replace(phase=phase, since=d.now, failed_probes=failed, reason=cause)
    d.put(rec, new)
    interval = d.ledger.config.probe_interval_s
    d.actions.append(Probe(rec.slot, rec.incarnation, d.now + interval, cause))
    d.reasons.append(
        f"slot {rec.slot} incarnation {rec.incarnation} {cause} "
        f"({failed} of {threshold} failed probes): probing again in {interval:g} s"
    )


def _start_failed(d: Draft, rec: SlotRecord, ev: Observed) -> None:
    cause = f"start {_NAME[ev.failure]}" + (f": {ev.detail}" if ev.detail else "")
    if rec.phase is not _LAUNCHING:
        d.reasons.append(
            f"start outcome for slot {rec.slot} incarnation {rec.incarnation}, which is "
            f"already {_NAME[_state(d, rec)]}: ignored"
        )
        return
    if ev.failure is _F_SUSPECT:
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} {cause}: still starting")
        return
    condemn(d, rec, f"failed to start: {cause}", evict=True)


def condemn(d: Draft, rec: SlotRecord, cause: str, *, evict: bool) -> None:
    """The incarnation in ``rec`` is dead: evict if asked, then restart or retire."""
    if evict:
        d.actions.append(Evict(rec.slot, rec.incarnation, cause))
    plan = d.ledger.policy.plan(rec.restarts, d.now)
    if not plan.allowed:
        new = rec._replace(
            phase=_RETIRED, weight_version=None, partial=False, since=d.now,
            failed_probes=0, restart_at=None, reason=f"{cause}; {plan.reason}",
        )
        d.put(rec, new)
        d.actions.append(Retire(rec.slot, rec.incarnation, new.reason))
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} retired: {new.reason}")
        return
    dead = rec._replace(
        phase=_DEAD, weight_version=None, partial=False, since=d.now,
        failed_probes=0, restart_at=plan.not_before, reason=cause,
    )
    d.put(rec, dead)
    assert plan.not_before is not None  # an allowed restart has its launch time
    if plan.not_before <= d.now:
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} dead: {cause}")
        restart(d, dead)
    else:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} dead: {cause}; {plan.reason}"
        )


def restart(d: Draft, dead: SlotRecord) -> None:
    attempt = dead.restarts + 1
    budget = d.ledger.policy.restart_budget
    new = SlotRecord(
        dead.slot, dead.incarnation + 1, _LAUNCHING, None, False, d.now, 0, attempt, None,
        f"restart {attempt} of {budget} after: {dead.reason}",
    )
    d.put(dead, new)
    d.actions.append(Restart(dead.slot, new.incarnation, dead.incarnation, attempt, dead.reason))
    d.reasons.append(f"slot {dead.slot}: launching incarnation {new.incarnation} ({new.reason})")


def on_report(d: Draft, ev: RefitReport) -> None:
    rec = _resolve(d, ev)
    if rec is None:
        return
    result = ev.result
    if result is RefitResult.COMPLETE:
        _landed(d, ev, rec)
        return
    where = f"slot {rec.slot} incarnation {rec.incarnation}"
    if result is RefitResult.NOT_STARTED:
        d.reasons.append(
            f"refit of version {ev.version} moved no bytes to {where}: weights untouched"
        )
        return
    if result is RefitResult.PARTIAL:
        reason = (
            f"partial refit of version {ev.version}: mixed weights, stale until a "
            "complete refit lands"
        )
        d.put(rec, rec._replace(weight_version=None, partial=True, reason=reason))
        d.reasons.append(f"{where}: {reason}")
        return
    raise ValueError(f"RefitReport for {where} has result {result!r}, not a RefitResult")


def _landed(d: Draft, ev: RefitReport, rec: SlotRecord) -> None:
    """A COMPLETE report: the slot holds ``ev.version`` (stamped) unless the refit it belongs to is not the
    one in progress, was aborted, or the slot is not ready. Runs once per participant of every refit."""
    fleet = d.fleet_now()  # an earlier event of the same batch may have aborted the refit
    if fleet.refit_version != ev.version:
        why = f"the refit in progress is {fleet.refit_version}"
    elif fleet.halted is not None:
        why = "that refit was aborted, so nothing from it counts as success"
    elif rec.phase is _LAUNCHING:
        why = "it is not ready"
    else:
        why = None
    if why is not None:
        d.late(
            f"complete refit of version {ev.version} reported for slot {rec.slot} incarnation "
            f"{rec.incarnation}, but {why}: ignored, weight stamp unchanged"
        )
        return
    d.put(rec, _stamped(rec, ev.version, f"refit of version {ev.version} landed"))
    d.reasons.append(_landed_reason(rec, ev.version, fleet.current_version))


def _stamped(rec: SlotRecord, version: int, reason: str) -> SlotRecord:
    """``rec`` holding ``version`` completely. Built field by field (not ``_replace``): this runs once per
    participant of every refit."""
    return SlotRecord(
        rec.slot, rec.incarnation, rec.phase, version, False, rec.since, rec.failed_probes,
        rec.restarts, rec.restart_at, reason, rec.removed, rec.stamp_failures, rec.readmit_failures,
        rec.readmit_after,
    )


def _landed_reason(rec: SlotRecord, version: int, committed: int | None) -> str:
    serves = "serves" if committed == version else "serves once it is committed"
    return f"version {version} landed on slot {rec.slot} incarnation {rec.incarnation}; it {serves}"


def land_all(d: Draft, events: tuple) -> bool:
    """A batch of COMPLETE reports of the refit in progress, one per slot, each about a slot's live
    incarnation (the transfer step of every refit that went well): decided in one pass, with exactly
    the records, transitions, reasons and stored order that ``on_report`` event by event gives (see
    ``health.core._decide_batch``). Returns False, having changed nothing, when the batch is any other
    kind: the general rule decides it then."""
    fleet = d.fleet_now()
    if fleet.halted is not None or fleet.refit_version is None or d.changed:
        return False
    version = fleet.refit_version
    records = d.ledger._records
    count = len(records)
    olds = []
    for ev in events:
        if type(ev) is not RefitReport or ev.result is not _COMPLETE or ev.version != version:
            return False
        slot = ev.slot
        if type(slot) is not int or not 0 <= slot < count:
            return False  # the general rule names the bad slot
        rec = records[slot]
        if rec.incarnation != ev.incarnation or rec.phase is not _LIVE:
            return False
        olds.append(rec)
    if len({rec.slot for rec in olds}) != len(olds):
        return False  # a slot reported twice: the general rule keeps the per-event order
    cv = d.ledger._fleet.current_version  # what ``Draft.put`` compares views against
    landed = f"refit of version {version} landed"
    changed, stored, transitions, reasons = d.changed, d.stored, d.transitions, d.reasons
    assert stored is not None  # a batch's draft (``Draft.begin_batch``)
    for rec in olds:
        new = _stamped(rec, version, landed)
        changed[rec.slot] = new
        stored.append(new)
        before, after = view_state(rec, cv), view_state(new, cv)
        if before is not after:
            transitions.append(Transition(rec.slot, rec.incarnation, before, after, landed))
        reasons.append(_landed_reason(rec, version, cv))
    d.puts += len(olds)
    return True


def _state(d: Draft, rec: SlotRecord) -> ShardState:
    return view_state(rec, d.ledger._fleet.current_version)
