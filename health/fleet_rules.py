"""Rules for fleet events: ``RefitStarted``, ``VersionCommitted``,
``RefitFinished`` and ``Tick``, plus the permanent-exhaustion check that follows
any retirement.

Guarantee on failure: an event out of order (a commit without a refit, versions that
do not increase, a finish for another version) raises ``ValueError`` naming the
versions involved before anything is recorded.
"""

from __future__ import annotations

from rlfleet.health.decision import CloseGate, KeepGateClosed, OpenGate, StopExhausted, Transition
from rlfleet.health.draft import Draft
from rlfleet.health import readmit
from rlfleet.health.events import RefitFinished, RefitRolledBack, RefitStarted, Tick, VersionCommitted
from rlfleet.health.ledger import QUARANTINE, TIMER_RESTART, SlotRecord, view_state
from rlfleet.health.gate_rules import operator_reason
from rlfleet.health.quorum import check_quorum, exhausted_message
from rlfleet.health.slot_rules import condemn, restart
from rlfleet.health.states import FailureClass, ShardState, SlotPhase

__all__ = [
    "check_permanent_exhaustion",
    "check_quorum_between_refits",
    "on_committed",
    "on_refit_finished",
    "on_refit_started",
    "on_tick",
]

_SUSPECT = SlotPhase.SUSPECT
_HUNG = SlotPhase.HUNG
_DEAD = SlotPhase.DEAD
_RETIRED = SlotPhase.RETIRED
_HEALTHY_STATE = ShardState.HEALTHY
_STALE_STATE = ShardState.STALE


def _check_version(name: str, version: int) -> None:
    if type(version) is not int or version < 0:
        raise ValueError(f"{name} needs a weight version that is an integer >= 0, got {version!r}")


def on_refit_started(d: Draft, ev: RefitStarted) -> None:
    v = ev.version
    _check_version("RefitStarted", v)
    fleet = d.ledger._fleet
    if fleet.refit_version is not None:
        if v == fleet.refit_version:
            d.reasons.append(f"refit of version {v} already in progress (retry): nothing else changes")
            _evict_all_overdue(d, v)  # the retry is a moment to act on the eviction clock, as the start is
            return
        raise ValueError(
            f"RefitStarted({v}) while the refit of version {fleet.refit_version} is in "
            f"progress; send RefitFinished({fleet.refit_version}) first"
        )
    cv = fleet.current_version
    if cv is not None and v <= cv:
        raise ValueError(f"RefitStarted({v}): weight versions must increase; current is {cv}")
    d.fleet = fleet._replace(refit_version=v, refit_started_at=d.now, gate_open=False, halted=None, quorum_lost=False,
                             gate_reason=f"refit of version {v}")
    d.reasons.append(f"refit of version {v} started; gate closed")
    _evict_all_overdue(d, v)


def _evict_all_overdue(d: Draft, version: int) -> None:
    """Evict every shard quarantined (suspect or hung) for ``suspect_timeout_s`` or longer."""
    ledger = d.ledger
    timeout = ledger.config.suspect_timeout_s
    for slot in sorted(ledger._by_phase[_SUSPECT] | ledger._by_phase[_HUNG]):
        rec = d.get(slot)
        if rec.phase in QUARANTINE and rec.since + timeout <= d.now:  # the escalation timer's own arithmetic
            _evict_overdue(d, rec, version)


def _evict_overdue(d: Draft, rec: SlotRecord, version: int) -> None:
    state = rec.phase.value
    waited = d.now - rec.since
    timeout = d.ledger.config.suspect_timeout_s
    cause = (
        f"evicted: {state} for {waited:.3g} s during the refit of version {version} "
        f"(suspect_timeout_s={timeout:g}); {rec.reason}"
    )
    condemn(d, rec, cause, evict=True)


def on_committed(d: Draft, ev: VersionCommitted) -> None:
    v = ev.version
    _check_version("VersionCommitted", v)
    ledger = d.ledger
    fleet = ledger._fleet
    if fleet.refit_version != v:
        raise ValueError(
            f"VersionCommitted({v}) but the refit in progress is {fleet.refit_version}: "
            f"send RefitStarted({v}) first"
        )
    if fleet.halted is not None:
        raise ValueError(f"VersionCommitted({v}) after the refit was aborted: {fleet.halted}")
    cv = fleet.current_version
    if cv is not None and v <= cv:
        raise ValueError(f"VersionCommitted({v}): version {cv} is already committed")
    d.fleet = fleet._replace(current_version=v)
    records = ledger._records
    joined = sorted(ledger._holding.get(v, ()))
    left = sorted(ledger._holding.get(cv, ())) if cv is not None else []
    transitions = d.transitions
    holds = f"holds committed version {v}"
    for slot in joined:
        transitions.append(Transition(slot, records[slot].incarnation, _STALE_STATE, _HEALTHY_STATE, holds))
    missed = f"did not receive version {v}"
    for slot in left:
        transitions.append(Transition(slot, records[slot].incarnation, _HEALTHY_STATE, _STALE_STATE, missed))
    d.reasons.append(
        f"version {v} committed: {len(joined)} engine(s) hold it and serve, "
        f"{len(left)} left stale on version {cv}"
    )


def on_refit_finished(d: Draft, ev: RefitFinished) -> None:
    v = ev.version
    fleet = _close_refit(d, "RefitFinished", v)
    if fleet is None:
        return
    if fleet.current_version != v:
        message = (
            f"gate stays closed: the refit of version {v} was not committed; weights "
            f"stay at version {fleet.current_version}"
        )
        d.actions.append(KeepGateClosed(v, message))
        d.reasons.append(message)
        return
    if ev.hold_without_quorum and not check_quorum(d.ledger).ok:
        message = (f"gate stays closed: too few engines serve version {v} "
                   f"({check_quorum(d.ledger).message}); the next refit brings the others to one version")
        d.fleet = d.fleet_now()._replace(quorum_lost=True)
        d.actions.append(KeepGateClosed(v, message))
        d.reasons.append(message)
        return
    _reopen_if_quorum(d, v, "gate opens")


def on_refit_rolled_back(d: Draft, ev: RefitRolledBack) -> None:
    """Close the refit without a commit; reopen on the committed version if quorum serves it."""
    v = ev.version
    cv = d.ledger._fleet.current_version
    if cv is not None and cv >= v:
        raise ValueError(f"RefitRolledBack({v}) after version {cv} was committed: a commit cannot be rolled back")
    if _close_refit(d, "RefitRolledBack", v) is not None:
        _reopen_if_quorum(d, cv, f"refit of version {v} rolled back ({ev.reason}); gate reopens on version {cv}")


def _close_refit(d: Draft, name: str, v: int):
    """End the refit of ``v`` in the draft; the fleet state before, or None when an abort keeps the gate closed."""
    _check_version(name, v)
    fleet = d.ledger._fleet
    if fleet.refit_version != v:
        raise ValueError(f"{name}({v}) but the refit in progress is {fleet.refit_version}")
    d.fleet = fleet._replace(refit_version=None, refit_started_at=None, halted=None, gate_open=False)
    if fleet.halted is not None:
        message = f"gate stays closed: {fleet.halted}"
        d.actions.append(KeepGateClosed(v, message))
        d.reasons.append(message)
        return None
    return fleet


def _reopen_if_quorum(d: Draft, version: int | None, why: str) -> None:
    """Open on ``version`` if quorum serves it, unless the fleet stopped (``KeepGateClosed``) or the operator's
    pause holds it closed (it then opens at ``OperatorResumed``); below quorum the fleet stops, paused or not.
    ``version``: the committed one (None before any commit, when quorum cannot hold)."""
    q = check_quorum(d.ledger)
    fleet = d.fleet_now()
    if fleet.stopped is not None and q.ok:
        assert version is not None  # engines serve it: it was committed
        message = f"gate stays closed: the fleet stopped: {fleet.stopped}"
        d.actions.append(KeepGateClosed(version, message))
        d.reasons.append(f"{why}: {message}")
        return
    if q.ok and fleet.operator_pause is not None:
        d.fleet = fleet._replace(gate_reason=operator_reason(fleet.operator_pause))
        d.reasons.append(f"{why}: {q.message}; gate stays closed: {operator_reason(fleet.operator_pause)}")
        return
    if q.ok:
        assert version is not None  # engines serve it: it was committed
        d.fleet = d.fleet_now()._replace(gate_open=True)
        d.actions.append(OpenGate(version, q.serving, q.needed))
        d.reasons.append(f"{why}: {q.message}")
    else:
        d.failure = FailureClass.EXHAUSTED
        d.actions.append(StopExhausted(q.message, q.dead_slots, q.serving, q.needed))
        d.reasons.append(q.message)


def on_tick(d: Draft, ev: Tick) -> None:
    d.fires_timers = True
    ledger = d.ledger
    refit = ledger._fleet.refit_version
    for _due, _seq, kind, slot, incarnation, token in ledger.due_timers(d.now):
        rec = d.get(slot)
        if rec.incarnation != incarnation:
            continue
        if kind == TIMER_RESTART:
            if rec.phase is _DEAD and rec.restart_at == token:
                restart(d, rec)
        elif refit is not None and rec.phase in QUARANTINE and rec.since == token:
            _evict_overdue(d, rec, refit)
    readmit.on_tick(d)


def check_quorum_between_refits(d: Draft) -> None:
    """Between refits, the gate follows quorum: it closes when fewer than ``min_healthy_engines``
    serve the committed version, and reopens (only if quorum closed it) when enough serve again.

    O(slots changed by this event), so it can run after every slot event.
    """
    fleet = d.fleet_now()
    cv = fleet.current_version
    if fleet.refit_version is not None or fleet.halted is not None or fleet.exhausted or cv is None:
        return
    if fleet.operator_pause is not None or fleet.stopped is not None:  # closed by the operator or for good
        return
    if not (fleet.gate_open or fleet.quorum_lost):
        return
    ledger = d.ledger
    serving = ledger.serving_count()
    records = ledger._records
    for slot, new in d.changed.items():
        was = slot < len(records) and view_state(records[slot], cv) is ShardState.HEALTHY  # else: added by a resize
        serving += (view_state(new, cv) is ShardState.HEALTHY) - was
    needed = ledger.config.min_healthy_engines
    if fleet.gate_open and serving < needed:
        message = (
            f"below quorum between refits: {serving} engine(s) serve version {cv}, "
            f"min_healthy_engines={needed}; requests wait until restarts or a refit bring quorum back"
        )
        d.fleet = fleet._replace(gate_open=False, quorum_lost=True)
        d.actions.append(CloseGate(message, serving, needed))
        d.reasons.append(message)
    elif fleet.quorum_lost and serving >= needed:
        d.fleet = fleet._replace(gate_open=True, quorum_lost=False)
        d.actions.append(OpenGate(cv, serving, needed))
        d.reasons.append(f"quorum is back: {serving} engine(s) serve version {cv}; gate reopens")


def check_permanent_exhaustion(d: Draft) -> None:
    """After a retirement: stop once if quorum can never hold again."""
    ledger = d.ledger
    fleet = d.fleet_now()
    if fleet.exhausted:
        return
    records = ledger._records
    retired = len(ledger._by_phase[_RETIRED])
    for slot, new in d.changed.items():
        retired += (new.phase is _RETIRED) - (slot < len(records) and records[slot].phase is _RETIRED)
    n = len(records)
    needed = ledger.config.min_healthy_engines
    # Slots that can ever serve: all but the retired. A slot a resize removed is retired too, so this is
    # the target size minus the slots retired by failures: removing slots on purpose never stops the fleet.
    if n - retired >= needed:
        return
    post = [r for r in (d.get(s) for s in range(n)) if not r.removed]
    dead_slots = tuple(r.slot for r in post if r.phase in (_DEAD, _RETIRED))
    serving = sum(1 for r in post if view_state(r, fleet.current_version) is ShardState.HEALTHY)
    message = exhausted_message(
        serving=serving, needed=needed, num_slots=len(post),
        current_version=fleet.current_version, records=post, permanent=True,
    )
    d.fleet = fleet._replace(exhausted=True, gate_open=False)
    d.failure = FailureClass.EXHAUSTED
    d.actions.append(StopExhausted(message, dead_slots, serving, needed))
    d.reasons.append(message)
