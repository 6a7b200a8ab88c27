"""Rules for the gate's other deciders' events: the operator's pause and resume (``OperatorPaused``,
``OperatorResumed``) and the fleet's stop (``Halted``), the gate's reason for
every gate action a decision carries is worded by ``health.decision.gate_reason_of``.

The health core is the one place the gate is decided: the ledger's ``gate_open`` is the gate, and its
``gate_reason`` says why. The operator's pause is a state of the ledger, not a veto applied on top of it:
while it holds, no rule opens the gate (``fleet_rules._reopen_if_quorum``, ``check_quorum_between_refits``),
and ``OperatorResumed`` opens it exactly where a refit's end or quorum coming back would have.

Guarantee on failure: an unknown pause mode raises ``ValueError`` naming it, before anything is recorded.
"""

from __future__ import annotations

from rlfleet.health.decision import CloseGate, OpenGate
from rlfleet.health.draft import Draft
from rlfleet.health.events import Halted, OperatorPaused, OperatorResumed
from rlfleet.health.quorum import check_quorum

__all__ = ["PAUSE_MODES", "on_halted", "on_operator_paused", "on_operator_resumed",
           "operator_reason"]

PAUSE_MODES = ("abort", "wait", "keep")


def operator_reason(mode: str) -> str:
    return f"paused by the operator (mode {mode}): requests wait until resume"


def on_operator_paused(d: Draft, ev: OperatorPaused) -> None:
    if ev.mode not in PAUSE_MODES:
        raise ValueError(f"OperatorPaused: mode must be one of {PAUSE_MODES}, got {ev.mode!r}")
    fleet = d.ledger._fleet
    reason = operator_reason(ev.mode)
    if fleet.refit_version is not None or fleet.stopped is not None:
        # the refit's (or the stop's) reason stands until it ends; the pause holds from then on
        d.fleet = fleet._replace(operator_pause=ev.mode, gate_open=False)
        d.reasons.append(f"{reason}; the gate is closed already ({fleet.gate_reason})")
        return
    q = check_quorum(d.ledger)
    d.fleet = fleet._replace(operator_pause=ev.mode, gate_open=False, gate_reason=reason)
    if fleet.gate_open:
        d.actions.append(CloseGate(reason, q.serving, q.needed))
    d.reasons.append(reason)


def on_operator_resumed(d: Draft, ev: OperatorResumed) -> None:
    fleet = d.ledger._fleet
    was = fleet.operator_pause
    fleet = fleet._replace(operator_pause=None)
    d.fleet = fleet
    head = "resumed by the operator" if was is not None else "resume without a pause"
    if fleet.stopped is not None:
        d.reasons.append(f"{head}; gate stays closed: the fleet stopped: {fleet.stopped}")
    elif fleet.refit_version is not None:
        d.reasons.append(f"{head}; the gate opens at the end of the refit of version {fleet.refit_version}")
    elif fleet.exhausted or fleet.current_version is None or fleet.gate_open:
        d.reasons.append(f"{head}; gate {'open' if fleet.gate_open else 'stays closed: ' + fleet.gate_reason}")
    else:
        q = check_quorum(d.ledger)
        if q.ok:
            d.fleet = fleet._replace(gate_open=True, quorum_lost=False)
            d.actions.append(OpenGate(fleet.current_version, q.serving, q.needed))
            d.reasons.append(f"{head}: {q.message}; gate opens")
        else:  # quorum coming back opens it (``check_quorum_between_refits``)
            message = (f"{head}; gate stays closed: below quorum: {q.serving} engine(s) serve version "
                       f"{fleet.current_version}, min_healthy_engines={q.needed}")
            d.fleet = fleet._replace(quorum_lost=True, gate_reason=message)
            d.reasons.append(message)


def on_halted(d: Draft, ev: Halted) -> None:
    fleet = d.ledger._fleet
    if not isinstance(ev.reason, str) or not ev.reason:
        raise ValueError(f"Halted needs a reason (a non-empty string), got {ev.reason!r}")
    reason = fleet.stopped or ev.reason  # the first stop's reason is the one that stands
    d.fleet = fleet._replace(stopped=reason, gate_open=False, gate_reason=reason)
    d.reasons.append(f"fleet stopped: {reason}" if fleet.stopped is None else f"stopped already: {reason}")
