"""``Draft``: a decision under construction.

Rule functions (``slot_rules``, ``fleet_rules``) read the ledger through a draft and
record what must change in it, never in the ledger; ``Draft.finish`` freezes the
result into a ``Decision``. Reading through the draft (``get``) sees changes made
earlier in the same decision, so one event can move a slot through several states
(hung -> dead -> restarting) and report each step as a ``Transition``.

A ``Batch`` runs several slot events through one draft: each sees the changes of the
ones before it (``get``, ``fleet_now``), as if they had been decided one by one, and
the decision stores, in order, what each of their decisions would have stored (so
the ledger's timers and indexes end exactly as after feeding them one by one).

Package-internal: controllers use ``decide``/``step``. Never raises.
"""

from __future__ import annotations

from rlfleet.health.decision import Action, Decision, Transition, gate_reason_of
from rlfleet.health.events import Event
from rlfleet.health.ledger import FleetState, Ledger, SlotRecord, view_state
from rlfleet.health.states import FailureClass, SlotPhase

__all__ = ["Draft"]

_RETIRED = SlotPhase.RETIRED


class Draft:
    """The decision under construction: reads through to the ledger, records
    changes without writing them."""

    __slots__ = (
        "ledger", "event", "now", "failure", "changed", "actions",
        "transitions", "reasons", "fleet", "fires_timers", "retired", "puts", "stored", "pending",
    )

    def __init__(self, ledger: Ledger, event: Event, now: float) -> None:
        self.ledger = ledger
        self.event = event
        self.now = now
        self.failure = FailureClass.OK
        self.changed: dict[int, SlotRecord] = {}
        self.actions: list[Action] = []
        self.transitions: list[Transition] = []
        self.reasons: list[str] = []
        self.fleet: FleetState | None = None
        self.fires_timers = False
        self.retired = False
        self.puts = 0  # records put so far (a batch checks quorum after each event that put one)
        # A batch: what applying its events one by one would store, event after event (``end_event``).
        self.stored: list[SlotRecord] | None = None
        self.pending: dict[int, SlotRecord] = {}

    def get(self, slot: int) -> SlotRecord:
        rec = self.changed.get(slot)
        return rec if rec is not None else self.ledger._records[slot]

    def fleet_now(self) -> FleetState:
        return self.fleet if self.fleet is not None else self.ledger._fleet

    def put(self, old: SlotRecord, new: SlotRecord) -> None:
        self.changed[new.slot] = new
        self.puts += 1
        if self.stored is not None:
            self.pending[new.slot] = new
        cv = self.ledger._fleet.current_version
        before = view_state(old, cv)
        after = view_state(new, cv)
        if before is not after or old.incarnation != new.incarnation:
            self.transitions.append(
                Transition(new.slot, new.incarnation, before, after, new.reason)
            )
        if new.phase is _RETIRED:
            self.retired = True

    def begin_batch(self) -> None:
        self.stored = []

    def end_event(self) -> None:
        """One event of a batch is decided: what it changed is stored next, as its own decision
        would have stored it (slots in the order it first changed them, each at its last value)."""
        if self.pending:
            assert self.stored is not None  # ``put`` fills ``pending`` only in a batch
            self.stored.extend(self.pending.values())
            self.pending.clear()

    def late(self, reason: str) -> None:
        self.failure = FailureClass.LATE
        self.reasons.append(reason)

    def finish(self) -> Decision:
        reason = gate_reason_of(self.actions)
        if reason is not None:
            self.fleet = self.fleet_now()._replace(gate_reason=reason)
        return Decision(
            self.event, self.now, self.failure, tuple(self.actions),
            tuple(self.transitions), "; ".join(self.reasons) or "nothing to do",
            self.ledger._serial,
            tuple(self.changed.values()) if self.stored is None else tuple(self.stored),
            self.fleet,
            self.fires_timers,
        )
