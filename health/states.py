"""The vocabulary of the health core: shard states, slot phases, failure classes,
refit results and the kinds of call an observation comes from.

This module owns names only; it holds no state and performs no checks, so it cannot
fail. Every enum's value is a short lower-case string, stable across releases, so
that event logs and ``Ledger.to_dict()`` snapshots stay readable and diffable.
"""

from __future__ import annotations

import enum

__all__ = ["CallKind", "FailureClass", "RefitResult", "ShardState", "SlotPhase"]


class ShardState(enum.Enum):
    """What a slot is doing, as the controller and the event log see it.

    Only ``HEALTHY`` receives traffic. ``HEALTHY`` and ``STALE`` slots join refits.
    """

    __hash__ = object.__hash__

    STARTING = "starting"
    """The slot's first incarnation was launched and has not reported ready."""
    RESTARTING = "restarting"
    """A replacement incarnation was launched and has not reported ready."""
    HEALTHY = "healthy"
    """Live, and a refit of the current weight version landed on this incarnation."""
    STALE = "stale"
    """Live, but not on the current weights (new, partial or old): joins refits, no traffic."""
    SUSPECT = "suspect"
    """Unreachable or misbehaving: quarantined, no traffic, probed until alive or dead."""
    HUNG = "hung"
    """A call to it passed its deadline: quarantined, no traffic, probed."""
    DEAD = "dead"
    """This incarnation is dead; a restart is scheduled after a backoff."""
    RETIRED = "retired"
    """Dead with its restart budget spent: the slot is never restarted."""


class SlotPhase(enum.Enum):
    """The phase the ledger stores for a slot.

    ``ShardState`` is derived from it: ``LAUNCHING`` reads as ``STARTING`` or
    ``RESTARTING`` (first start or not) and ``LIVE`` reads as ``HEALTHY`` or
    ``STALE`` (on the current weight version or not). Storing the phase rather than
    the state is what lets a version commit cost O(changed slots), not O(fleet).
    """

    __hash__ = object.__hash__

    LAUNCHING = "launching"
    LIVE = "live"
    SUSPECT = "suspect"
    HUNG = "hung"
    DEAD = "dead"
    RETIRED = "retired"


class FailureClass(enum.Enum):
    """How an observation of one shard is classified (DESIGN.md, failure classes)."""

    __hash__ = object.__hash__

    OK = "ok"
    """The call succeeded: an ack that is exactly ``True``, or a normal result."""
    DEAD = "dead"
    """Confirmed death (``ActorDiedError``): the incarnation is dead at once."""
    SUSPECT = "suspect"
    """Unavailable (``ActorUnavailableError``): quarantine and probe, never dead on its own."""
    HUNG = "hung"
    """A deadline passed (``GetTimeoutError``, ``TimeoutError``)."""
    LIED = "lied"
    """An ack that is not exactly ``True``: never counted as success."""
    ERROR = "error"
    """The call raised an application error (the actor answered, the step failed).
    Treated like ``LIED``: never counted as success."""
    LATE = "late"
    """About an incarnation that has been replaced or condemned: ignored."""
    EXHAUSTED = "exhausted"
    """The fleet is below quorum. A fleet verdict, never an observation of one shard."""


class RefitResult(enum.Enum):
    """What one weight transfer did to one participant."""

    __hash__ = object.__hash__

    NOT_STARTED = "not_started"
    """No bytes moved to it: its weights are untouched."""
    PARTIAL = "partial"
    """Some bytes moved, not all: it holds mixed weights and must not serve."""
    COMPLETE = "complete"
    """Every byte of the version landed on it."""


class CallKind(enum.Enum):
    """Which call an observation is about; the same failure means different things
    in different calls (a hung pause stops the refit, a hung probe is one failed probe)."""

    __hash__ = object.__hash__

    START = "start"
    """Launching an incarnation, up to its first ready."""
    PROBE = "probe"
    """A liveness probe the ledger asked for."""
    PAUSE = "pause"
    """Pausing generation before a weight transfer."""
    REFIT = "refit"
    """The weight transfer itself."""
    STAMP = "stamp"
    """Tagging an engine with the version it received (``set_weight_version``). A stamp nobody
    acknowledged leaves that engine's version unknown: it serves nothing until a refit lands on it again."""
    RESUME = "resume"
    """Resuming generation after a weight transfer."""
    GENERATE = "generate"
    """Ordinary traffic."""
