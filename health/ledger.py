"""The shard ledger: one record per slot, plus the fleet-wide weight version, refit
window and gate. ``decide`` (health.core) reads it; ``Ledger.apply`` changes it.

Design (why a mutable ledger of immutable records)
--------------------------------------------------
``decide(ledger, event, now)`` is pure: it reads the ledger and returns a
``Decision`` that carries the *new* immutable ``SlotRecord`` of every slot it
changes (usually one) and, if needed, the new ``FleetState``. ``Ledger.apply``
stores them in place. So:

- an event costs O(1) (plus O(k log k) for the k timers a ``Tick`` fires, and
  O(changed slots) for a version commit); the 1,024-slot ledger is never copied;
- a decision that raises leaves the ledger untouched, because nothing is written
  until ``apply``, and ``apply`` of a valid decision cannot fail half-way;
- ``apply`` refuses a decision made against an older ledger state (``basis``), so
  a decision can neither be applied twice nor applied out of order.

A fully persistent structure would give snapshots for free but costs a path copy
per event; the event log already records every decision, so it buys nothing here.

Derived state
-------------
A record stores a ``SlotPhase``; ``ShardState`` is derived. A ``LIVE`` record is
``HEALTHY`` iff its ``weight_version`` is the committed current version, else
``STALE``. The ledger indexes live records by weight version, so the serving set is
one dictionary lookup and committing a version touches only the slots whose state
changes. Consequence (an invariant by construction): a shard serves only on the
current weight version.

Guarantee on failure: every method either completes or raises before writing.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Protocol, cast

from rlfleet.health.config import HealthConfig
from rlfleet.health.states import ShardState, SlotPhase

__all__ = ["FleetState", "Ledger", "SlotRecord", "SlotStatus", "view_state"]

_LAUNCHING = SlotPhase.LAUNCHING
_LIVE = SlotPhase.LIVE
_SUSPECT = SlotPhase.SUSPECT
_HUNG = SlotPhase.HUNG
_DEAD = SlotPhase.DEAD
_RETIRED = SlotPhase.RETIRED
QUARANTINE = frozenset({_SUSPECT, _HUNG})

TIMER_RESTART = 0
TIMER_ESCALATE = 1

_FIXED_STATE = {
    _SUSPECT: ShardState.SUSPECT,
    _HUNG: ShardState.HUNG,
    _DEAD: ShardState.DEAD,
    _RETIRED: ShardState.RETIRED,
}


class SlotRecord(NamedTuple):
    """What the ledger knows about one slot (immutable; replaced, never edited).

    - ``incarnation``: id of the engine now in the slot; only ever increases.
    - ``phase``: stored lifecycle phase (see ``view_state`` for the public state).
    - ``weight_version``: version of the last COMPLETE refit that landed on *this*
      incarnation; ``None`` when unknown, partial, or never refitted.
    - ``partial``: the last refit moved some bytes but not all to it.
    - ``since``: when the slot entered its phase (for suspect/hung: the quarantine
      start, which is what ``suspect_timeout_s`` is measured from).
    - ``failed_probes``: failed probes in the current quarantine.
    - ``restarts``: restarts this slot has used from its budget.
    - ``restart_at``: for ``DEAD``, when the restart is due.
    - ``reason``: why the slot is in its phase (for dead/retired: why it died).
    - ``removed``: retired on purpose by a resize (``health.resize``), not by a failure: it no
      longer counts in the fleet's target size.
    - ``stamp_failures``: refits in a row whose stamp this incarnation refused or failed (an error or a
      lie); it is evicted at ``STAMP_FAILURES_TO_EVICT`` (``health.slot_rules``); an acknowledged stamp clears it.
    - ``readmit_failures``, ``readmit_after``: re-admissions in a row that failed by the engine's own fault,
      and when the next may start (``health.readmit``); ``readmit_tries``: failures in a row whoever's fault (the
      back-off doubles with them); a landed re-admission clears all three.
    """

    slot: int
    incarnation: int
    phase: SlotPhase
    weight_version: int | None
    partial: bool
    since: float
    failed_probes: int
    restarts: int
    restart_at: float | None
    reason: str
    removed: bool = False
    stamp_failures: int = 0
    readmit_failures: int = 0
    readmit_after: float = 0.0
    readmit_tries: int = 0


class FleetState(NamedTuple):
    """Fleet-wide state: the committed weight version, the refit in progress (if any)
    with its start time and abort reason, the gate, and whether the fleet has been
    declared permanently exhausted."""

    current_version: int | None
    refit_version: int | None
    refit_started_at: float | None
    gate_open: bool
    halted: str | None
    exhausted: bool
    quorum_lost: bool = False  # the gate closed between refits because fewer than min_healthy_engines serve
    operator_pause: str | None = None  # the operator's pause mode while it holds (``OperatorPaused``)
    stopped: str | None = None  # why the fleet stopped (``Halted``): the gate never opens again
    gate_reason: str = "not yet opened"  # why the gate is as it is: the last decision that opened or closed it


def view_state(record: SlotRecord, current_version: int | None) -> ShardState:
    """The public state of ``record`` when ``current_version`` is committed."""
    phase = record.phase
    if phase is _LIVE:
        wv = record.weight_version
        if wv is not None and wv == current_version:
            return ShardState.HEALTHY
        return ShardState.STALE
    if phase is _LAUNCHING:
        return ShardState.STARTING if record.restarts == 0 else ShardState.RESTARTING
    return _FIXED_STATE[phase]


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """A snapshot of one slot for status pages and the event log."""

    slot: int
    incarnation: int
    state: ShardState
    weight_version: int | None
    partial: bool
    since: float
    failed_probes: int
    restarts: int
    restart_at: float | None
    reason: str
    removed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (enum values as strings)."""
        return {
            "slot": self.slot,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "weight_version": self.weight_version,
            "partial": self.partial,
            "since": self.since,
            "failed_probes": self.failed_probes,
            "restarts": self.restarts,
            "restart_at": self.restart_at,
            "reason": self.reason,
            "removed": self.removed,
        }


class Changes(Protocol):
    """What ``Ledger.apply`` reads of a decision (``health.decision.Decision``, which imports this module's
    records): the ledger state it was made against, its clock, and the records it changes."""

    @property
    def basis(self) -> int: ...
    @property
    def event(self) -> object: ...
    @property
    def fires_timers(self) -> bool: ...
    @property
    def now(self) -> float: ...
    @property
    def records(self) -> tuple[SlotRecord, ...]: ...
    @property
    def fleet(self) -> FleetState | None: ...


class Ledger:
    """Mutable holder of the slot records; see the module docstring.

    A new ledger has every slot ``STARTING`` at ``first_incarnation``, no committed
    version, no refit in progress and the gate closed: launch every slot's first
    incarnation, report ``EngineReady``, then run a first refit so engines serve.

    One owner (the controller actor) feeds it; it is not thread-safe.
    """

    def __init__(
        self, config: HealthConfig, *, now: float = 0.0, first_incarnation: int = 1,
        adopted: Mapping[int, tuple[int, int]] | None = None,
        removed: Mapping[int, int] | None = None,
    ) -> None:
        """``adopted`` (a restarted controller's ledger): slot -> (incarnation, restarts spent) as its
        predecessor recorded them; those slots launch at that incarnation with that budget spent.
        ``removed``: slot -> last incarnation of the slots a resize removed (retired for good, out of
        the target size)."""
        if not isinstance(config, HealthConfig):
            raise TypeError(f"Ledger needs a HealthConfig, got {type(config).__name__}")
        if type(first_incarnation) is not int or first_incarnation < 0:
            raise ValueError(
                f"first_incarnation must be an integer >= 0, got {first_incarnation!r}"
            )
        self.config = config
        self.policy = config.restart_policy
        n = config.num_engines
        self._records: list[SlotRecord] = [
            SlotRecord(s, first_incarnation, _LAUNCHING, None, False, now, 0, 0, None, "launched")
            for s in range(n)
        ]
        for slot, (inc, restarts) in (adopted or {}).items():
            if not (0 <= slot < n) or type(inc) is not int or inc < 0 or type(restarts) is not int or restarts < 0:
                raise ValueError(f"adopted slot {slot!r}: incarnation {inc!r} and restarts {restarts!r} must be "
                                 f"integers >= 0 for a slot in 0..{n - 1}")
            self._records[slot] = SlotRecord(slot, inc, _LAUNCHING, None, False, now, 0, restarts, None,
                                             "adopted by a restarted controller")
        for slot, inc in (removed or {}).items():
            if not (0 <= slot < n) or slot in (adopted or {}) or type(inc) is not int or inc < 0:
                raise ValueError(f"removed slot {slot!r} (incarnation {inc!r}) must be a slot in 0..{n - 1} "
                                 "that is not also adopted, with an incarnation >= 0")
            self._records[slot] = SlotRecord(slot, inc, _RETIRED, None, False, now, 0, 0, None,
                                             "removed by a resize", True)
        self.first_incarnation = first_incarnation  # what a slot added by a resize starts at
        self._by_phase: dict[SlotPhase, set[int]] = {p: set() for p in SlotPhase}
        for r in self._records:
            self._by_phase[r.phase].add(r.slot)
        self._removed: set[int] = {r.slot for r in self._records if r.removed}
        self._holding: dict[int, set[int]] = {}
        # Sorted views, rebuilt on first read after a change to what they list (None: stale).
        self._live_sorted: tuple[int, ...] | None = None
        self._serving_sorted: tuple[int, ...] | None = None
        self._fleet = FleetState(None, None, None, False, None, False)
        self._timers: list[tuple[float, int, int, int, int, float]] = []
        self._seq = itertools.count()
        self._serial = 0
        self._now = float(now)

    # ----------------------------------------------------------------- queries

    @property
    def num_slots(self) -> int:
        return len(self._records)

    @property
    def target_size(self) -> int:
        """Slots the fleet is meant to have: every slot but those a resize removed (failed and retired
        slots count: they are the fleet's, lost). O(1)."""
        return len(self._records) - len(self._removed)

    def removed_slots(self) -> frozenset[int]:
        """The slots a resize removed (a copy)."""
        return frozenset(self._removed)

    @property
    def now(self) -> float:
        """Time of the last applied decision (``decide`` refuses an earlier ``now``)."""
        return self._now

    @property
    def serial(self) -> int:
        """Number of decisions applied; a decision is valid only against this value."""
        return self._serial

    @property
    def fleet(self) -> FleetState:
        return self._fleet

    @property
    def current_version(self) -> int | None:
        """The committed weight version (``None`` before the first commit)."""
        return self._fleet.current_version

    @property
    def refit_version(self) -> int | None:
        """The version being refitted, or ``None`` outside a refit."""
        return self._fleet.refit_version

    @property
    def gate_open(self) -> bool:
        return self._fleet.gate_open

    @property
    def gate_reason(self) -> str:
        """Why the gate is open or closed: the health core's own words for its last gate decision."""
        return self._fleet.gate_reason

    @property
    def operator_pause(self) -> str | None:
        """The operator's pause mode while it holds, else None."""
        return self._fleet.operator_pause

    @property
    def stopped(self) -> str | None:
        """Why the fleet stopped, or None while it runs."""
        return self._fleet.stopped

    @property
    def exhausted(self) -> bool:
        """True once too many slots retired for quorum ever to hold again."""
        return self._fleet.exhausted

    def raw(self, slot: int) -> SlotRecord:
        """The stored record of ``slot`` (0 <= slot < num_slots)."""
        return self._records[self._check_slot(slot)]

    def state(self, slot: int) -> ShardState:
        """Public state of ``slot``."""
        return view_state(self._records[self._check_slot(slot)], self._fleet.current_version)

    def record(self, slot: int) -> SlotStatus:
        """Snapshot of ``slot``."""
        r = self._records[self._check_slot(slot)]
        return SlotStatus(
            r.slot, r.incarnation, view_state(r, self._fleet.current_version),
            r.weight_version, r.partial, r.since, r.failed_probes, r.restarts,
            r.restart_at, r.reason, r.removed,
        )

    def records(self) -> tuple[SlotStatus, ...]:
        """Snapshots of every slot, by slot number."""
        return tuple(self.record(s) for s in range(len(self._records)))

    def serving_count(self) -> int:
        """Number of HEALTHY slots: live and on the committed version. O(1)."""
        cv = self._fleet.current_version
        if cv is None:
            return 0
        return len(self._holding.get(cv, ()))

    def serving_slots(self) -> tuple[int, ...]:
        """The slots that may receive traffic, ascending. O(1) until the serving set changes."""
        cached = self._serving_sorted
        if cached is None:
            cv = self._fleet.current_version
            cached = self._serving_sorted = tuple(sorted(self._holding.get(cv, ()))) if cv is not None else ()
        return cached

    def live_slots(self) -> tuple[int, ...]:
        """The slots whose phase is ``LIVE`` (HEALTHY or STALE: they take part in refits), ascending.
        O(1) until a slot enters or leaves ``LIVE``."""
        cached = self._live_sorted
        if cached is None:
            cached = self._live_sorted = tuple(sorted(self._by_phase[_LIVE]))
        return cached

    def state_counts(self) -> dict[ShardState, int]:
        """How many slots are in each public state (every state listed, zeros included).

        From the indexes, not the records: O(1) plus the slots launching (starting vs
        restarting is read from their records)."""
        live = len(self._by_phase[_LIVE])
        healthy = self.serving_count()
        records = self._records
        launching = self._by_phase[_LAUNCHING]
        restarting = sum(1 for s in launching if records[s].restarts != 0)
        return {
            ShardState.STARTING: len(launching) - restarting,
            ShardState.RESTARTING: restarting,
            ShardState.HEALTHY: healthy,
            ShardState.STALE: live - healthy,
            ShardState.SUSPECT: len(self._by_phase[_SUSPECT]),
            ShardState.HUNG: len(self._by_phase[_HUNG]),
            ShardState.DEAD: len(self._by_phase[_DEAD]),
            ShardState.RETIRED: len(self._by_phase[_RETIRED]),
        }

    def slots_in(self, phase: SlotPhase) -> frozenset[int]:
        """Slots whose stored phase is ``phase`` (a copy)."""
        return frozenset(self._by_phase[phase])

    def phase_count(self, phase: SlotPhase) -> int:
        return len(self._by_phase[phase])

    def holding(self, version: int) -> frozenset[int]:
        """Live slots on which a complete refit of ``version`` landed (a copy)."""
        return frozenset(self._holding.get(version, ()))

    def next_wake_at(self) -> float | None:
        """Earliest pending timer (restart backoff, eviction deadline), or ``None``.
        Feed a ``Tick`` at or after it; it may be a timer that no longer matters."""
        return self._timers[0][0] if self._timers else None

    def due_timers(self, now: float) -> list[tuple[float, int, int, int, int, float]]:
        """Timers due at ``now``, in firing order, without removing them.

        Entries are ``(due, seq, kind, slot, incarnation, token)``. The due entries
        of a binary heap form a subtree at its root, so this visits only them.
        """
        heap = self._timers
        out = []
        stack = [0] if heap and heap[0][0] <= now else []
        size = len(heap)
        while stack:
            i = stack.pop()
            out.append(heap[i])
            for child in (2 * i + 1, 2 * i + 2):
                if child < size and heap[child][0] <= now:
                    stack.append(child)
        out.sort()
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready snapshot of the fleet and every slot (for status and logs)."""
        f = self._fleet
        return {
            "current_version": f.current_version,
            "refit_version": f.refit_version,
            "refit_started_at": f.refit_started_at,
            "gate_open": f.gate_open,
            "gate_reason": f.gate_reason,
            "operator_pause": f.operator_pause,
            "stopped": f.stopped,
            "halted": f.halted,
            "exhausted": f.exhausted,
            "serving": self.serving_count(),
            "target_size": self.target_size,
            "slots": [s.to_dict() for s in self.records()],
        }

    # ------------------------------------------------------------------ change

    def apply(self, decision: Changes) -> None:
        """Store the changes of ``decision`` (made by ``decide`` on this ledger).

        Raises ``ValueError`` (and changes nothing) when the decision was made
        against another ledger state: applied twice, out of order, or elsewhere.
        """
        if decision.basis != self._serial:
            raise ValueError(
                f"decision about {type(decision.event).__name__} was made against ledger "
                f"state {decision.basis}, but the ledger is at {self._serial}: "
                "decide again on the current ledger"
            )
        if decision.fires_timers:
            heap = self._timers
            while heap and heap[0][0] <= decision.now:
                heapq.heappop(heap)
        for record in decision.records:
            self._store(record)
        if decision.fleet is not None:
            if decision.fleet.current_version != self._fleet.current_version:
                self._serving_sorted = None
            self._fleet = decision.fleet
        self._now = decision.now
        self._serial += 1

    def _store(self, new: SlotRecord) -> None:
        slot = new.slot
        if slot == len(self._records):  # a slot a resize added (``health.resize``): appended, launching
            self._records.append(new)
            self._by_phase[new.phase].add(slot)
            return
        old = self._records[slot]
        self._records[slot] = new
        if new.removed != old.removed:
            (self._removed.add if new.removed else self._removed.discard)(slot)
        if old.phase is not new.phase:
            self._by_phase[old.phase].discard(slot)
            self._by_phase[new.phase].add(slot)
            if old.phase is _LIVE or new.phase is _LIVE:
                self._live_sorted = None
        old_hold = old.weight_version if old.phase is _LIVE else None
        new_hold = new.weight_version if new.phase is _LIVE else None
        if old_hold != new_hold:
            self._serving_sorted = None
            if old_hold is not None:
                holders = self._holding[old_hold]
                holders.discard(slot)
                if not holders:
                    del self._holding[old_hold]
            if new_hold is not None:
                self._holding.setdefault(new_hold, set()).add(slot)
        same_incarnation = old.incarnation == new.incarnation
        if new.phase in QUARANTINE and not (same_incarnation and old.phase in QUARANTINE):
            self._push(new.since + self.config.suspect_timeout_s, TIMER_ESCALATE, new, new.since)
        if new.phase is _DEAD and not (same_incarnation and old.phase is _DEAD):
            restart_at = cast(float, new.restart_at)  # a DEAD record has one (``slot_rules.condemn``)
            self._push(restart_at, TIMER_RESTART, new, restart_at)

    def _push(self, due: float, kind: int, record: SlotRecord, token: float) -> None:
        entry = (due, next(self._seq), kind, record.slot, record.incarnation, token)
        heapq.heappush(self._timers, entry)

    def _check_slot(self, slot: int) -> int:
        if type(slot) is not int or not 0 <= slot < len(self._records):
            raise ValueError(
                f"slot {slot!r} does not exist: the fleet has slots 0..{len(self._records) - 1}"
            )
        return slot

    def __repr__(self) -> str:
        return (
            f"Ledger(slots={len(self._records)}, serving={self.serving_count()}, "
            f"version={self._fleet.current_version}, refit={self._fleet.refit_version}, "
            f"gate_open={self._fleet.gate_open})"
        )
