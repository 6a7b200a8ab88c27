"""Events: what the controller tells the decision core it observed or did.

Every event is a frozen dataclass. A *slot event* (``EngineReady``, ``Observed``,
``RefitReport``) names the slot and the incarnation it is about; the core compares
that incarnation with the ledger's, so an event from a replaced incarnation is
"late" and changes nothing. A *fleet event* (``RefitStarted``, ``VersionCommitted``,
``RefitFinished``, ``Tick``) is about the fleet as a whole and names no incarnation.
A ``Batch`` carries several slot events observed together (one fan-out's results).

Events carry no timestamps: the time is the ``now`` passed to ``decide`` with them.
Construction does no validation (events are built on the hot path); ``decide``
validates each one against the ledger and raises ``ValueError`` naming the slot,
incarnation and value when an event is malformed, leaving the ledger unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from rlfleet.health.states import CallKind, FailureClass, RefitResult

if TYPE_CHECKING:
    from rlfleet.health.resize import CheckpointLoaded, SlotRemoved, SlotsAdded
    from rlfleet.health.readmit import ReadmitFailed, Readmitted

__all__ = [
    "Batch",
    "EngineReady",
    "Event",
    "FleetEvent",
    "Halted",
    "Observed",
    "OperatorPaused",
    "OperatorResumed",
    "RefitFinished",
    "RefitRolledBack",
    "RefitReport",
    "RefitStarted",
    "SlotEvent",
    "Tick",
    "VersionCommitted",
]


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The incarnation launched by a ``Restart`` action (or the first one) is loaded
    and answering. It becomes ``STALE``: it serves only after a refit lands on it."""

    slot: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Observed:
    """The outcome of one call to one shard, already classified.

    ``failure`` comes from the outcome kind through ``health.classify.classify_kind``
    (``FailureClass.HUNG`` for a call that missed its deadline). ``detail`` is a
    short human description of what was seen, carried into reasons and error
    messages. ``fleet.outcome.observed()`` builds one from a settled call.
    """

    slot: int
    incarnation: int
    call: CallKind
    failure: FailureClass
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RefitReport:
    """What the weight transfer of ``version`` did to one participant.

    Send one per participant after each transfer attempt. ``result`` must reflect
    bytes actually moved (``health.classify.refit_result``): ``PARTIAL`` only when
    some, not all, bytes reached this participant.
    """

    slot: int
    incarnation: int
    version: int
    result: RefitResult
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RefitStarted:
    """Step 1 of ``sync_weights(version)``: the gate is closed and a refit of
    ``version`` begins. Suspect or hung shards are now on the eviction clock.
    Re-sending it for the same version (the one retry) is a no-op."""

    version: int


@dataclass(frozen=True, slots=True)
class VersionCommitted:
    """Step 6: ``version`` is stamped as the current weights. From now on only
    incarnations that received a COMPLETE refit of it may serve."""

    version: int


@dataclass(frozen=True, slots=True)
class RefitFinished:
    """Step 8: the refit of ``version`` is over (resumes settled, or stopped). The
    decision says whether the gate may reopen.

    ``hold_without_quorum``: too few engines serving ``version`` keeps the gate closed
    (``KeepGateClosed``, reopened by quorum between refits or by the next refit)
    instead of stopping the fleet. A restarted controller re-adopting engines on mixed
    versions finishes its re-adoption this way: the next ``sync_weights`` fixes it."""

    version: int
    hold_without_quorum: bool = False


@dataclass(frozen=True, slots=True)
class RefitRolledBack:
    """The refit of ``version`` was abandoned before any engine's weights changed
    (the update was refused, or the caller's mistake surfaced inside the lifecycle):
    nothing is committed, and the decision says whether the gate may reopen on the
    committed version. Never after ``VersionCommitted``."""

    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed. Fires due timers: restarts whose backoff ran out, and evictions
    of shards suspect or hung for ``suspect_timeout_s`` during a refit. Send one at
    (or after) ``Ledger.next_wake_at()``; extra ticks are harmless."""


@dataclass(frozen=True, slots=True)
class OperatorPaused:
    """The operator paused the fleet (vLLM's ``/pause``; ``mode``: ``abort``, ``wait`` or ``keep``): the gate
    closes and stays closed through refits and quorum changes until ``OperatorResumed``. Send it only once the
    pause is stored (the intent): a pause that was not stored does not hold."""

    mode: str


@dataclass(frozen=True, slots=True)
class OperatorResumed:
    """The operator ended its pause: the gate opens where the health core would have it open (no refit in
    progress, not stopped, quorum serves the committed version); during a refit, at the refit's end."""


@dataclass(frozen=True, slots=True)
class Halted:
    """The fleet stopped (an unrecovered failure, a shutdown): the gate closes for good with ``reason``."""

    reason: str


# A resize's events (``health.resize``) by name: that module imports this one.
SlotEvent = Union[EngineReady, Observed, RefitReport, "SlotRemoved", "CheckpointLoaded", "Readmitted", "ReadmitFailed"]
FleetEvent = Union[RefitStarted, VersionCommitted, RefitFinished, RefitRolledBack, Tick, "SlotsAdded", OperatorPaused,
                   OperatorResumed, Halted]


@dataclass(frozen=True, slots=True)
class Batch:
    """Several slot events seen at once (the settled calls of one fan-out), decided as one.

    ``decide`` applies ``events`` in order exactly as a sequence of single events
    would be, at one ``now``, reading each slot through the changes of the events
    before it, and returns one ``Decision`` carrying every transition and action
    in that order. A fan-out to n shards thus costs one decision, one ledger write
    and one log line, not n. All or nothing: an event the ledger refuses
    (``ValueError``/``TypeError``) refuses the whole batch, before anything changes.
    """

    events: tuple[SlotEvent, ...]


Event = Union[SlotEvent, FleetEvent, Batch]
