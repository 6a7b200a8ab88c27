"""Decisions: what the core tells the controller to do, and why.

``decide(ledger, event, now)`` returns one ``Decision``. The controller carries out
``decision.actions`` in order, logs ``decision.reason`` (and, if it likes, each
``Transition``), and applies the decision to the ledger. It never changes a shard's
state on its own: every state change is a ``Transition`` inside some decision.

Actions are frozen dataclasses naming the slot and the incarnation they are about,
so an action can be carried out against exactly the actor it was decided for:

==================  =========================================================
``Probe``           at ``not_before``, call the shard's health check; report
                    ``Observed(call=PROBE)``
``Evict``           kill that incarnation's actor (it is already dead in the ledger)
``Restart``         launch ``incarnation`` in ``slot``; report ``EngineReady``
``Retire``          the slot will never be restarted; release its resources
``AbortRefit``      stop the refit now; the gate stays closed
``OpenGate``        reopen dispatch: quorum holds on the committed version
``KeepGateClosed``  the refit ended without a usable commit; gate stays closed
``StopExhausted``   below quorum: stop loudly with the gate closed
==================  =========================================================

The last four fields of ``Decision`` (``basis``, ``records``, ``fleet``,
``fires_timers``) are the exact change ``Ledger.apply`` makes; controllers need not
read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Union

from rlfleet.health.states import CallKind, FailureClass, ShardState

if TYPE_CHECKING:
    from rlfleet.health.events import Event
    from rlfleet.health.ledger import FleetState, SlotRecord
    from rlfleet.health.resize import Drain

__all__ = [
    "AbortRefit",
    "Action",
    "CloseGate",
    "Decision",
    "Evict",
    "gate_reason_of",
    "KeepGateClosed",
    "OpenGate",
    "Probe",
    "Restart",
    "Retire",
    "StopExhausted",
    "Transition",
]


@dataclass(frozen=True, slots=True)
class Probe:
    """At or after ``not_before``, check whether ``incarnation`` of ``slot`` is alive
    (bounded by a deadline) and report ``Observed(slot, incarnation, CallKind.PROBE,
    ...)``. Every probe, the first of a quarantine too, is due ``probe_interval_s`` after
    the failure that called for it: a killed process fails at once, and back-to-back
    probes would condemn it before the cluster could say its node was lost."""

    slot: int
    incarnation: int
    not_before: float
    reason: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Kill ``incarnation`` of ``slot`` (through the Ray door). The ledger already counts it
    dead; killing fences it so a frozen or unreachable engine cannot come back."""

    slot: int
    incarnation: int
    reason: str


@dataclass(frozen=True, slots=True)
class Restart:
    """Launch a new engine in ``slot`` tagged ``incarnation`` (replacing
    ``previous_incarnation``). Its backoff already ran out. Report ``EngineReady``
    when it answers, or ``Observed(call=START, ...)`` if the launch fails."""

    slot: int
    incarnation: int
    previous_incarnation: int
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class Retire:
    """``slot`` (last ``incarnation``) is dead with its restart budget spent; it will
    never be restarted. Release its resources."""

    slot: int
    incarnation: int
    reason: str


@dataclass(frozen=True, slots=True)
class AbortRefit:
    """A lifecycle call failed in a way that forbids continuing (a hung pause or
    resume, a lie, an error): stop the refit now; the gate stays closed."""

    slot: int
    incarnation: int
    call: CallKind
    failure: FailureClass
    version: int | None
    message: str


@dataclass(frozen=True, slots=True)
class OpenGate:
    """Reopen dispatch: ``serving`` engines (>= ``needed``) serve ``version``."""

    version: int
    serving: int
    needed: int


@dataclass(frozen=True, slots=True)
class CloseGate:
    """Between refits, fewer than ``needed`` engines serve the committed version: close dispatch
    (requests wait, they do not fail) until restarts or a refit bring quorum back."""

    message: str
    serving: int
    needed: int


@dataclass(frozen=True, slots=True)
class KeepGateClosed:
    """The refit of ``version`` ended aborted or uncommitted: keep the gate closed
    and surface ``message``."""

    version: int
    message: str


@dataclass(frozen=True, slots=True)
class StopExhausted:
    """The fleet is below quorum: stop with the gate closed. ``message`` names every
    dead or retired slot (``dead_slots``) and why it died."""

    message: str
    dead_slots: tuple[int, ...]
    serving: int
    needed: int


# ``Drain`` (a resize's, ``health.resize``) by name: that module imports this one.
@dataclass(frozen=True, slots=True)
class Readmit:
    """Bring ``incarnation`` of ``slot`` (up, stale) to the committed ``version`` from a live donor, outside a
    refit (``health.readmit``): copy, prove by digests, stamp; report ``Readmitted`` or ``ReadmitFailed``.
    Emitted on every tick while the slot stays stale: run at most one per incarnation."""

    slot: int
    incarnation: int
    version: int
    reason: str


Action = Union[Probe, Evict, Restart, Retire, AbortRefit, OpenGate, CloseGate, KeepGateClosed, StopExhausted, "Drain",
               Readmit]


class Transition(NamedTuple):
    """One slot changed state. ``incarnation`` is the slot's incarnation after the
    change (a restart moves a slot to a new incarnation). Immutable."""

    slot: int
    incarnation: int
    before: ShardState
    after: ShardState
    reason: str


class Decision(NamedTuple):
    """The verdict on one event at one time.

    ``failure``: how the event was classified (``OK`` when nothing went wrong,
    ``LATE`` when it was ignored, ``EXHAUSTED`` when the fleet fell below quorum).
    ``actions``: what the controller must do, in order. ``transitions``: every state
    change this decision makes. ``reason``: one line for the event log.

    Immutable like the actions; a ``NamedTuple`` rather than a frozen dataclass
    because one is built per event and costs a fifth as much (read fields by name).
    """

    event: Event
    now: float
    failure: FailureClass
    actions: tuple[Action, ...]
    transitions: tuple[Transition, ...]
    reason: str
    basis: int
    records: tuple[SlotRecord, ...]
    fleet: FleetState | None
    fires_timers: bool

    @property
    def ignored(self) -> bool:
        """True when the event was late (or otherwise void) and changes nothing."""
        return self.failure is FailureClass.LATE

    @property
    def changes_ledger(self) -> bool:
        """True when applying this decision changes slot records or fleet state."""
        return bool(self.records) or self.fleet is not None


def gate_reason_of(actions: "list[Action] | tuple[Action, ...]") -> str | None:
    """Why the gate is as the last gate action among ``actions`` leaves it (None: no gate action)."""
    for a in reversed(actions):
        if isinstance(a, OpenGate):
            return f"{a.serving} engine(s) serve version {a.version}"
        if isinstance(a, (CloseGate, KeepGateClosed, StopExhausted)):
            return a.message
    return None
