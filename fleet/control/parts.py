"""What the controller's collaborators are built from: its parts, typed, and the few things they may ask it to do.

The refit lifecycle (``fleet.control.lifecycle``), re-adoption (``fleet.control.recovery``), resize
(``fleet.control.resize``), launches (``fleet.control.launch``, ``fleet.control.reconcile``) and the routing publisher
(``fleet.control.publisher``) each receive a ``Parts`` when they are built or called: the fleet's
config and name, the clock, the event log, the door (every Ray call), the slots' owner
(``fleet.control.slots``), the intent store, the gate, admission and metrics. None of them reads
the controller's own state. What only the controller does is asked through ``Actions``:
decide a health event and carry out its actions (the one place actions are carried out),
stop, run a task in the background, the admission poll and the background loops.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Coroutine, Protocol

from rlfleet.fleet.control.admission import AdmissionController
from rlfleet.fleet.cluster.door import Door
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.config.fleet import FleetConfig
from rlfleet.fleet.control.dispatch_gate import DispatchGate
from rlfleet.fleet.control.intent import IntentStore
from rlfleet.fleet.control.metrics import FleetMetrics
from rlfleet.fleet.outcome import Outcome
from rlfleet.fleet.control.slots import Slots
from rlfleet.health import CallKind, Decision


class Clock(Protocol):
    def now(self) -> float: ...


class Actions(Protocol):
    """What a collaborator asks the controller to do (``SingleController`` implements it)."""

    @property
    def stopped(self) -> str | None:
        """Why the fleet stopped, or None while it serves."""

    def decide(self, event: Any) -> Decision:
        """Apply one health event (``Slots.decide``) and carry out its actions."""

    def observe(self, slot: int, incarnation: int, call: CallKind, outcome: Outcome) -> Decision:
        """One settled call as a health decision (an unusable incarnation is killed first)."""

    def observe_all(self, call: CallKind, settled: dict[int, tuple[int, Outcome]]) -> tuple:
        """``observe`` for every settled call of one fan-out, as one decision; returns its actions."""

    def halt(self, reason: str, shutdown: bool = False) -> None:
        """Stop with the gate closed (``shutdown``: asked for, not a failure)."""

    def in_background(self, coro: Coroutine) -> asyncio.Task:
        """Run ``coro`` as a task the controller owns (cancelled at shutdown, its error logged)."""

    async def poll_admission(self) -> None:
        """Size every shard's cap from its engine's stats once."""


@dataclass
class Parts:
    cfg: FleetConfig
    name: str
    clock: Clock
    log: EventLog
    door: Door  # ``RayDoor``, the simulator's, or the unit tests' in-memory one
    slots: Slots
    intent: IntentStore
    gate: DispatchGate
    admission: AdmissionController
    metrics: FleetMetrics
    act: Actions
    readmissions: Any = None  # ``fleet.control.readmission.Readmissions``: a refit makes its copies yield
    reconciler: Any = None  # ``fleet.control.reconcile.Reconciler``: every launch, the level-triggered step
