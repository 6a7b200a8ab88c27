"""The decision core: ``decide(ledger, event, now) -> Decision``.

``decide`` is a pure function: it reads the ledger and returns what must change
(new slot records, new fleet state), what the controller must do (actions) and why
(reason). ``Ledger.apply(decision)`` makes the change; ``step`` does both.

Transition rules (DESIGN.md failure classes; "quarantine" = SUSPECT or HUNG):

- any event naming an incarnation older than the slot's, or a dead/retired one:
  LATE, ignored, nothing changes; a newer one was never issued: ``ValueError``.
- ``EngineReady`` / START ok: STARTING|RESTARTING -> STALE (no weights yet).
- DEAD (``ActorDiedError``) in any call: the incarnation is dead at once.
- SUSPECT (unavailable) or HUNG (deadline) outside probes: HEALTHY|STALE ->
  quarantine, ``Probe``. Never dead on its own. A hung PAUSE or RESUME also
  ``AbortRefit`` (gate stays closed); a hung REFIT takes the recovery path.
- LIED / ERROR in PAUSE, REFIT or RESUME: the weight stamp is dropped (STALE) and
  ``AbortRefit``. In GENERATE: not a liveness signal, nothing changes.
- probe ok: quarantine -> HEALTHY if still on the current version, else STALE.
  Probe failed (unavailable, hung, lie, error): one failed probe; at
  ``unhealthy_threshold`` failed probes -> dead with ``Evict``.
- START failed (hung, lie, error): ``Evict``, dead. START unavailable: keep waiting.
- dead -> ``RestartPolicy``: within budget, DEAD until the backoff runs out, then
  (on a ``Tick``) RESTARTING at incarnation + 1 with ``Restart``; immediately when
  the backoff is zero. Budget spent -> RETIRED with ``Retire``.
- ``RefitReport``: COMPLETE of the refit in progress stamps the version on that
  incarnation; PARTIAL drops the stamp (mixed weights: STALE, rejoins the next
  refit; a complete refit overwrites every weight); NOT_STARTED changes nothing.
- ``RefitStarted``: gate closed; quarantined shards already past
  ``suspect_timeout_s`` are evicted; during the refit a ``Tick`` evicts the rest
  when their time runs out.
- ``VersionCommitted``: holders of that version become HEALTHY, every other live
  slot STALE.
- ``RefitFinished``: ``OpenGate`` iff the refit was committed, not aborted, and
  quorum holds; ``KeepGateClosed`` if aborted/uncommitted; ``StopExhausted`` (naming
  every dead slot) below quorum.
- whenever retirements leave fewer than ``min_healthy_engines`` slots that could
  ever serve: ``StopExhausted`` (once).

Guarantee on failure: ``decide`` raises ``ValueError`` (naming the slot,
incarnation, version or time at fault) or ``TypeError`` for a non-event, before the
ledger could change; ``decide`` itself never changes the ledger.
"""

from __future__ import annotations

from health.decision import (
    AbortRefit,
    Action,
    Decision,
    Evict,
    KeepGateClosed,
    OpenGate,
    Probe,
    Restart,
    Retire,
    StopExhausted,
    Transition,
)
from health.events import (
    EngineReady,
    Event,
    Observed,
    RefitFinished,
    RefitReport,
    RefitStarted,
    Tick,
    VersionCommitted,
)
from health.ledger import (
    QUARANTINE,
    TIMER_RESTART,
    FleetState,
    Ledger,
    SlotRecord,
    view_state,
)
from health.quorum import check_quorum, exhausted_message
from health.states import CallKind, FailureClass, RefitResult, ShardState, SlotPhase

__all__ = ["decide", "step"]

_LAUNCHING = SlotPhase.LAUNCHING
_LIVE = SlotPhase.LIVE
_SUSPECT = SlotPhase.SUSPECT
_HUNG = SlotPhase.HUNG
_DEAD = SlotPhase.DEAD
_RETIRED = SlotPhase.RETIRED

_OK = FailureClass.OK
_F_DEAD = FailureClass.DEAD
_F_SUSPECT = FailureClass.SUSPECT
_F_HUNG = FailureClass.HUNG
_F_LATE = FailureClass.LATE

_START = CallKind.START
_PROBE = CallKind.PROBE
_GENERATE = CallKind.GENERATE
_PAUSE_OR_RESUME = frozenset({CallKind.PAUSE, CallKind.RESUME})


class _Draft:
    """The decision under construction: reads through to the ledger, records
    changes without writing them."""

    __slots__ = (
        "ledger", "event", "now", "failure", "changed", "actions",
        "transitions", "reasons", "fleet", "fires_timers", "retired",
    )

    def __init__(self, ledger: Ledger, event: Event, now: float) -> None:
        self.ledger = ledger
        self.event = event
        self.now = now
        self.failure = _OK
        self.changed: dict[int, SlotRecord] = {}
        self.actions: list[Action] = []
        self.transitions: list[Transition] = []
        self.reasons: list[str] = []
        self.fleet: FleetState | None = None
        self.fires_timers = False
        self.retired = False

    def get(self, slot: int) -> SlotRecord:
        rec = self.changed.get(slot)
        return rec if rec is not None else self.ledger._records[slot]

    def fleet_now(self) -> FleetState:
        return self.fleet if self.fleet is not None else self.ledger._fleet

    def put(self, old: SlotRecord, new: SlotRecord) -> None:
        self.changed[new.slot] = new
        cv = self.ledger._fleet.current_version
        before = view_state(old, cv)
        after = view_state(new, cv)
        if before is not after or old.incarnation != new.incarnation:
            self.transitions.append(Transition(new.slot, new.incarnation, before, after, new.reason))
        if new.phase is _RETIRED:
            self.retired = True

    def late(self, reason: str) -> None:
        self.failure = _F_LATE
        self.reasons.append(reason)

    def finish(self) -> Decision:
        if self.retired:
            _check_permanent_exhaustion(self)
        return Decision(
            self.event, self.now, self.failure, tuple(self.actions),
            tuple(self.transitions), "; ".join(self.reasons) or "nothing to do",
            self.ledger._serial, tuple(self.changed.values()), self.fleet,
            self.fires_timers,
        )


def decide(ledger: Ledger, event: Event, now: float) -> Decision:
    """Decide what ``event``, observed at ``now``, means for the fleet.

    Preconditions: ``now`` is not earlier than ``ledger.now`` (a monotonic clock);
    slot events name an existing slot and an incarnation the ledger issued.
    Returns a ``Decision``; the ledger is not modified (see ``Ledger.apply``).
    """
    if not now >= ledger._now:  # also rejects NaN
        raise ValueError(
            f"decide got now={now!r}, earlier than the ledger's last time "
            f"{ledger._now!r}: feed it a monotonic clock"
        )
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"decide got a {type(event).__name__}, which is not a health event")
    draft = _Draft(ledger, event, now)
    handler(draft, event)
    return draft.finish()


def step(ledger: Ledger, event: Event, now: float) -> Decision:
    """``decide`` then ``ledger.apply``; returns the applied decision."""
    decision = decide(ledger, event, now)
    ledger.apply(decision)
    return decision


# ------------------------------------------------------------------ slot events


def _resolve(d: _Draft, ev: EngineReady | Observed | RefitReport) -> SlotRecord | None:
    """The slot's record if ``ev`` is about its current, not-condemned incarnation;
    ``None`` (decision marked LATE) if it is about a replaced or dead one."""
    rec = _slot_record(d, ev)
    slot = ev.slot
    inc = ev.incarnation
    if inc == rec.incarnation:
        if rec.phase is _DEAD or rec.phase is _RETIRED:
            d.late(
                f"{_describe(ev)} from slot {slot} incarnation {inc}, which is already "
                f"{rec.phase.value} ({rec.reason}): ignored"
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


def _slot_record(d: _Draft, ev: EngineReady | Observed | RefitReport) -> SlotRecord:
    slot = ev.slot
    records = d.ledger._records
    if type(slot) is not int or not 0 <= slot < len(records):
        raise ValueError(
            f"{type(ev).__name__} names slot {slot!r}, but the fleet has slots "
            f"0..{len(records) - 1}"
        )
    return records[slot]


def _describe(ev: EngineReady | Observed | RefitReport) -> str:
    if type(ev) is Observed:
        return f"{ev.call.value} {ev.failure.value}" + (f" ({ev.detail})" if ev.detail else "")
    if type(ev) is RefitReport:
        return f"refit report ({ev.result.value}, version {ev.version})"
    return "ready"


def _on_ready(d: _Draft, ev: EngineReady) -> None:
    rec = _resolve(d, ev)
    if rec is not None:
        _ready(d, rec)


def _ready(d: _Draft, rec: SlotRecord) -> None:
    if rec.phase is not _LAUNCHING:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} reported ready while "
            f"{_state(d, rec).value}: nothing to do"
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


def _on_observed(d: _Draft, ev: Observed) -> None:
    f = ev.failure
    if f is FailureClass.EXHAUSTED or type(f) is not FailureClass:
        raise ValueError(
            f"Observed for slot {ev.slot} incarnation {ev.incarnation} has failure {f!r}; "
            "EXHAUSTED is a fleet verdict, not an observation of one shard"
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
        _condemn(d, rec, f"died during {call.value}: {ev.detail or 'ActorDiedError'}", evict=False)
    elif call is _PROBE:
        _failed_probe(d, rec, ev)
    elif call is _START:
        _start_failed(d, rec, ev)
    elif f is _F_SUSPECT or f is _F_HUNG:
        _quarantine(d, rec, ev)
    else:
        _bad_answer(d, rec, ev)


def _observed_ok(d: _Draft, rec: SlotRecord, call: CallKind) -> None:
    if call is _START:
        _ready(d, rec)
        return
    if call is _PROBE and (rec.phase is _SUSPECT or rec.phase is _HUNG):
        new = rec._replace(phase=_LIVE, since=d.now, failed_probes=0, reason="probe ok")
        d.put(rec, new)
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} answered its probe: "
            f"{_state(d, new).value} again"
        )
        return
    d.reasons.append(f"{call.value} ok on slot {rec.slot} incarnation {rec.incarnation}")


def _quarantine(d: _Draft, rec: SlotRecord, ev: Observed) -> None:
    """SUSPECT or HUNG outside probes and starts."""
    what = "unavailable" if ev.failure is _F_SUSPECT else "hung (deadline passed)"
    cause = f"{what} during {ev.call.value}" + (f": {ev.detail}" if ev.detail else "")
    if rec.phase is _LIVE:
        phase = _SUSPECT if ev.failure is _F_SUSPECT else _HUNG
        new = rec._replace(phase=phase, since=d.now, failed_probes=0, reason=cause)
        d.put(rec, new)
        d.actions.append(Probe(rec.slot, rec.incarnation, cause))
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} {cause}: quarantined, probing"
        )
    else:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} {cause} while "
            f"{_state(d, rec).value}: state unchanged"
        )
    if ev.failure is _F_HUNG and ev.call in _PAUSE_OR_RESUME and rec.phase is not _LAUNCHING:
        _abort(d, rec, ev, cause)


def _bad_answer(d: _Draft, rec: SlotRecord, ev: Observed) -> None:
    """LIED or ERROR in PAUSE, REFIT, RESUME or GENERATE."""
    what = "lied (ack not exactly True)" if ev.failure is FailureClass.LIED else "raised"
    cause = f"{ev.call.value} {what}" + (f": {ev.detail}" if ev.detail else "")
    if ev.call is _GENERATE or rec.phase is _LAUNCHING:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} {cause}: not a liveness "
            "signal, state unchanged"
        )
        return
    if rec.weight_version is not None:
        new = rec._replace(weight_version=None, reason=f"{cause}; weights unknown")
        d.put(rec, new)
    d.reasons.append(
        f"slot {rec.slot} incarnation {rec.incarnation} {cause}: never counted as "
        "success, weights unknown until a refit lands"
    )
    _abort(d, rec, ev, cause)


def _abort(d: _Draft, rec: SlotRecord, ev: Observed, cause: str) -> None:
    fleet = d.fleet_now()
    version = fleet.refit_version
    message = (
        f"{ev.call.value} of slot {rec.slot} (incarnation {rec.incarnation}) failed: "
        f"{cause}; the refit of version {version} stops and the gate stays closed"
    )
    d.actions.append(AbortRefit(rec.slot, rec.incarnation, ev.call, ev.failure, version, message))
    d.reasons.append("refit aborted")
    if version is not None and fleet.halted is None:
        d.fleet = fleet._replace(halted=message, gate_open=False)


def _failed_probe(d: _Draft, rec: SlotRecord, ev: Observed) -> None:
    cause = f"probe {ev.failure.value}" + (f": {ev.detail}" if ev.detail else "")
    if rec.phase is _LAUNCHING:
        d.reasons.append(f"slot {rec.slot} is still starting; {cause} ignored")
        return
    quarantined = rec.phase is _SUSPECT or rec.phase is _HUNG
    failed = rec.failed_probes + 1 if quarantined else 1
    threshold = d.ledger.config.unhealthy_threshold
    if failed >= threshold:
        _condemn(
            d, rec,
            f"dead after {failed} failed probe(s) (unhealthy_threshold={threshold}); "
            f"last {cause}; first: {rec.reason}" if quarantined else
            f"dead after {failed} failed probe(s) (unhealthy_threshold={threshold}); {cause}",
            evict=True,
        )
        return
    if quarantined:
        new = rec._replace(failed_probes=failed)
    else:
        phase = _HUNG if ev.failure is _F_HUNG else _SUSPECT
        new = rec._replace(phase=phase, since=d.now, failed_probes=failed, reason=cause)
    d.put(rec, new)
    d.actions.append(Probe(rec.slot, rec.incarnation, cause))
    d.reasons.append(
        f"slot {rec.slot} incarnation {rec.incarnation} {cause} "
        f"({failed} of {threshold} failed probes): probing again"
    )


def _start_failed(d: _Draft, rec: SlotRecord, ev: Observed) -> None:
    cause = f"start {ev.failure.value}" + (f": {ev.detail}" if ev.detail else "")
    if rec.phase is not _LAUNCHING:
        d.reasons.append(
            f"start outcome for slot {rec.slot} incarnation {rec.incarnation}, which is "
            f"already {_state(d, rec).value}: ignored"
        )
        return
    if ev.failure is _F_SUSPECT:
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} {cause}: still starting")
        return
    _condemn(d, rec, f"failed to start: {cause}", evict=True)


def _condemn(d: _Draft, rec: SlotRecord, cause: str, *, evict: bool) -> None:
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
    if plan.not_before <= d.now:
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} dead: {cause}")
        _restart(d, dead)
    else:
        d.reasons.append(
            f"slot {rec.slot} incarnation {rec.incarnation} dead: {cause}; {plan.reason}"
        )


def _restart(d: _Draft, dead: SlotRecord) -> None:
    attempt = dead.restarts + 1
    budget = d.ledger.policy.restart_budget
    new = SlotRecord(
        dead.slot, dead.incarnation + 1, _LAUNCHING, None, False, d.now, 0, attempt, None,
        f"restart {attempt} of {budget} after: {dead.reason}",
    )
    d.put(dead, new)
    d.actions.append(Restart(dead.slot, new.incarnation, dead.incarnation, attempt, dead.reason))
    d.reasons.append(f"slot {dead.slot}: launching incarnation {new.incarnation} ({new.reason})")


def _on_report(d: _Draft, ev: RefitReport) -> None:
    rec = _resolve(d, ev)
    if rec is None:
        return
    result = ev.result
    where = f"slot {rec.slot} incarnation {rec.incarnation}"
    if result is RefitResult.NOT_STARTED:
        d.reasons.append(f"refit of version {ev.version} moved no bytes to {where}: weights untouched")
        return
    if result is RefitResult.PARTIAL:
        reason = (
            f"partial refit of version {ev.version}: mixed weights, stale until a "
            "complete refit lands"
        )
        d.put(rec, rec._replace(weight_version=None, partial=True, reason=reason))
        d.reasons.append(f"{where}: {reason}")
        return
    if result is not RefitResult.COMPLETE:
        raise ValueError(f"RefitReport for {where} has result {result!r}, not a RefitResult")
    fleet = d.ledger._fleet
    if fleet.refit_version != ev.version or rec.phase is _LAUNCHING:
        d.late(
            f"complete refit of version {ev.version} reported for {where} while "
            f"{'not ready' if rec.phase is _LAUNCHING else f'the refit in progress is {fleet.refit_version}'}"
            ": ignored, weight stamp unchanged"
        )
        return
    new = rec._replace(
        weight_version=ev.version, partial=False, reason=f"refit of version {ev.version} landed"
    )
    d.put(rec, new)
    serves = "serves" if fleet.current_version == ev.version else "serves once it is committed"
    d.reasons.append(f"version {ev.version} landed on {where}; it {serves}")


def _state(d: _Draft, rec: SlotRecord) -> ShardState:
    return view_state(rec, d.ledger._fleet.current_version)


# ----------------------------------------------------------------- fleet events


def _check_version(name: str, version: int) -> None:
    if type(version) is not int or version < 0:
        raise ValueError(f"{name} needs a weight version that is an integer >= 0, got {version!r}")


def _on_refit_started(d: _Draft, ev: RefitStarted) -> None:
    v = ev.version
    _check_version("RefitStarted", v)
    fleet = d.ledger._fleet
    if fleet.refit_version is not None:
        if v == fleet.refit_version:
            d.reasons.append(f"refit of version {v} already in progress (retry): nothing changes")
            return
        raise ValueError(
            f"RefitStarted({v}) while the refit of version {fleet.refit_version} is in "
            f"progress; send RefitFinished({fleet.refit_version}) first"
        )
    cv = fleet.current_version
    if cv is not None and v <= cv:
        raise ValueError(f"RefitStarted({v}): weight versions must increase; current is {cv}")
    d.fleet = fleet._replace(refit_version=v, refit_started_at=d.now, gate_open=False, halted=None)
    d.reasons.append(f"refit of version {v} started; gate closed")
    ledger = d.ledger
    timeout = ledger.config.suspect_timeout_s
    overdue = sorted(ledger._by_phase[_SUSPECT] | ledger._by_phase[_HUNG])
    for slot in overdue:
        rec = ledger._records[slot]
        if d.now - rec.since >= timeout:
            _evict_overdue(d, rec, v)


def _evict_overdue(d: _Draft, rec: SlotRecord, version: int) -> None:
    state = rec.phase.value
    waited = d.now - rec.since
    timeout = d.ledger.config.suspect_timeout_s
    cause = (
        f"evicted: {state} for {waited:.3g} s during the refit of version {version} "
        f"(suspect_timeout_s={timeout:g}); {rec.reason}"
    )
    _condemn(d, rec, cause, evict=True)


def _on_committed(d: _Draft, ev: VersionCommitted) -> None:
    v = ev.version
    _check_version("VersionCommitted", v)
    ledger = d.ledger
    fleet = ledger._fleet
    if fleet.refit_version != v:
        raise ValueError(
            f"VersionCommitted({v}) but the refit in progress is {fleet.refit_version}: "
            f"send RefitStarted({v}) first"
        )
    cv = fleet.current_version
    if cv is not None and v <= cv:
        raise ValueError(f"VersionCommitted({v}): version {cv} is already committed")
    d.fleet = fleet._replace(current_version=v)
    records = ledger._records
    joined = sorted(ledger._holding.get(v, ()))
    left = sorted(ledger._holding.get(cv, ())) if cv is not None else []
    for slot in joined:
        r = records[slot]
        d.transitions.append(Transition(
            slot, r.incarnation, ShardState.STALE, ShardState.HEALTHY,
            f"holds committed version {v}",
        ))
    for slot in left:
        r = records[slot]
        d.transitions.append(Transition(
            slot, r.incarnation, ShardState.HEALTHY, ShardState.STALE,
            f"did not receive version {v}",
        ))
    d.reasons.append(
        f"version {v} committed: {len(joined)} engine(s) hold it and serve, "
        f"{len(left)} left stale on version {cv}"
    )


def _on_refit_finished(d: _Draft, ev: RefitFinished) -> None:
    v = ev.version
    _check_version("RefitFinished", v)
    ledger = d.ledger
    fleet = ledger._fleet
    if fleet.refit_version != v:
        raise ValueError(f"RefitFinished({v}) but the refit in progress is {fleet.refit_version}")
    closed = fleet._replace(refit_version=None, refit_started_at=None, halted=None, gate_open=False)
    d.fleet = closed
    if fleet.halted is not None:
        message = f"gate stays closed: {fleet.halted}"
        d.actions.append(KeepGateClosed(v, message))
        d.reasons.append(message)
        return
    if fleet.current_version != v:
        message = (
            f"gate stays closed: the refit of version {v} was not committed; weights "
            f"stay at version {fleet.current_version}"
        )
        d.actions.append(KeepGateClosed(v, message))
        d.reasons.append(message)
        return
    q = check_quorum(ledger)
    if q.ok:
        d.fleet = closed._replace(gate_open=True)
        d.actions.append(OpenGate(v, q.serving, q.needed))
        d.reasons.append(f"gate opens: {q.message}")
    else:
        d.failure = FailureClass.EXHAUSTED
        d.actions.append(StopExhausted(q.message, q.dead_slots, q.serving, q.needed))
        d.reasons.append(q.message)


def _on_tick(d: _Draft, ev: Tick) -> None:
    d.fires_timers = True
    ledger = d.ledger
    refit = ledger._fleet.refit_version
    for _due, _seq, kind, slot, incarnation, token in ledger.due_timers(d.now):
        rec = d.get(slot)
        if rec.incarnation != incarnation:
            continue
        if kind == TIMER_RESTART:
            if rec.phase is _DEAD and rec.restart_at == token:
                _restart(d, rec)
        elif refit is not None and rec.phase in QUARANTINE and rec.since == token:
            _evict_overdue(d, rec, refit)


def _check_permanent_exhaustion(d: _Draft) -> None:
    """After a retirement: stop once if quorum can never hold again."""
    ledger = d.ledger
    fleet = d.fleet_now()
    if fleet.exhausted:
        return
    records = ledger._records
    retired = len(ledger._by_phase[_RETIRED])
    for slot, new in d.changed.items():
        retired += (new.phase is _RETIRED) - (records[slot].phase is _RETIRED)
    n = len(records)
    needed = ledger.config.min_healthy_engines
    if n - retired >= needed:
        return
    gone = ledger._by_phase[_DEAD] | ledger._by_phase[_RETIRED] | set(d.changed)
    post = [d.get(s) for s in range(n)]
    dead_slots = tuple(sorted(s for s in gone if d.get(s).phase in (_DEAD, _RETIRED)))
    serving = sum(1 for r in post if view_state(r, fleet.current_version) is ShardState.HEALTHY)
    message = exhausted_message(
        serving=serving, needed=needed, num_slots=n,
        current_version=fleet.current_version, records=post, permanent=True,
    )
    d.fleet = fleet._replace(exhausted=True, gate_open=False)
    d.failure = FailureClass.EXHAUSTED
    d.actions.append(StopExhausted(message, dead_slots, serving, needed))
    d.reasons.append(message)


_HANDLERS = {
    EngineReady: _on_ready,
    Observed: _on_observed,
    RefitReport: _on_report,
    RefitStarted: _on_refit_started,
    VersionCommitted: _on_committed,
    RefitFinished: _on_refit_finished,
    Tick: _on_tick,
}
