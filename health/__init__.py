"""rlfleet's health core: the pure decision logic behind every recovery.

Given what the controller observed about its engines (deaths, unavailability,
deadlines, lies, probe results, refit outcomes) and the time, this package decides
what the fleet's state is and what to do next; the controller only carries the
decisions out. It imports nothing from Ray or vLLM and reads no clock of its own
(time is always the ``now`` argument), so every rule runs in plain Python with a
``FakeClock``.

One loop: ``decision = step(ledger, event, clock.now())``; carry out
``decision.actions`` in order; log ``decision.reason``. (``step`` is ``decide``, a
pure function, followed by ``ledger.apply``.) What to feed, and when:

=====================================  =============================================
when                                   event  ->  actions to expect
=====================================  =============================================
start-up: launch each slot at          ``EngineReady(slot, inc)`` -> none (STALE)
``ledger.record(slot).incarnation``
every settled call to a shard          ``observe(slot, inc, CallKind.X, outcome)``
(exception or returned value; a        -> ``Probe`` (suspect/hung), ``Evict``,
``TimeoutError`` for a missed          ``Restart``, ``Retire``, ``AbortRefit``,
deadline)                              ``StopExhausted``
``Probe`` action due (``not_before``)  its outcome as ``CallKind.PROBE``
``Restart`` action                     launch ``action.incarnation``; then
                                       ``EngineReady`` or ``CallKind.START`` failure
at ``ledger.next_wake_at()``           ``Tick()`` -> due ``Restart``; ``Evict`` of
                                       shards frozen past ``suspect_timeout_s``
                                       during a refit
sync_weights step 1 (gate closed)      ``RefitStarted(v)`` -> ``Evict`` of overdue
step 3                                 ``plan_membership(ledger, last_plan)``
step 5, per participant and attempt    ``RefitReport(slot, inc, v, refit_result(...))``
the settled calls of one fan-out       ``Batch((ev1, ev2, ...))``: one decision for
                                       all of them, as if fed one by one
step 6                                 ``VersionCommitted(v)`` (not after an abort)
step 8                                 ``RefitFinished(v)`` -> exactly one of
                                       ``OpenGate``, ``KeepGateClosed``,
                                       ``StopExhausted``
=====================================  =============================================

Guarantees: only ``HEALTHY`` slots (``ledger.serving_slots()``) may get traffic,
and they are exactly the live incarnations on which a COMPLETE refit of the
committed version landed; an incarnation that died never serves again; events
from replaced incarnations change nothing; ``decide`` raises (``ValueError``
naming slot/incarnation/version/time) before anything changes.

Modules: ``states`` (enums), ``config`` (``HealthConfig``), ``clock``, ``events``,
``decision`` (actions, ``Decision``), ``classify``, ``ledger``, ``core``
(``decide``, ``step``) with ``draft``, ``slot_rules`` and ``fleet_rules``,
``quorum``, ``membership``, ``restart``, ``resize`` (elastic size), ``progress`` (liveness as progress:
a shard's engine holding work and making none is stalled), ``testing`` (builders for tests).
"""

from __future__ import annotations

from rlfleet.health.classify import classify_kind, is_late, refit_result
from rlfleet.health.clock import Clock, FakeClock, MonotonicClock
from rlfleet.health.config import HealthConfig
from rlfleet.health.core import decide, step
from rlfleet.health.decision import (
    AbortRefit,
    Action,
    CloseGate,
    Decision,
    Evict,
    KeepGateClosed,
    OpenGate,
    Probe,
    Readmit,
    Restart,
    Retire,
    StopExhausted,
    Transition,
)
from rlfleet.health.events import (
    Batch,
    EngineReady,
    Event,
    FleetEvent,
    Halted,
    Observed,
    OperatorPaused,
    OperatorResumed,
    RefitFinished,
    RefitRolledBack,
    RefitReport,
    RefitStarted,
    SlotEvent,
    Tick,
    VersionCommitted,
)
from rlfleet.health.ledger import FleetState, Ledger, SlotRecord, SlotStatus, view_state
from rlfleet.health.membership import TRAINER_RANK, MembershipPlan, Participant, plan_membership
from rlfleet.health.quorum import QuorumDecision, check_quorum
from rlfleet.health.readmit import ReadmitFailed, Readmitted
from rlfleet.health.resize import CheckpointLoaded, Drain, ResizePlan, SlotRemoved, SlotsAdded, check_size, plan_resize
from rlfleet.health.restart import RestartPlan, RestartPolicy
from rlfleet.health.states import CallKind, FailureClass, RefitResult, ShardState, SlotPhase

__all__ = [
    "AbortRefit",
    "Action",
    "Batch",
    "CloseGate",
    "Readmit",
    "ReadmitFailed",
    "Readmitted",
    "CallKind",
    "CheckpointLoaded",
    "Clock",
    "Decision",
    "EngineReady",
    "Event",
    "Drain",
    "Evict",
    "FailureClass",
    "FakeClock",
    "FleetEvent",
    "FleetState",
    "Halted",
    "HealthConfig",
    "KeepGateClosed",
    "Ledger",
    "MembershipPlan",
    "MonotonicClock",
    "Observed",
    "OperatorPaused",
    "OperatorResumed",
    "OpenGate",
    "Participant",
    "Probe",
    "QuorumDecision",
    "RefitFinished",
    "RefitRolledBack",
    "RefitReport",
    "RefitResult",
    "RefitStarted",
    "ResizePlan",
    "Restart",
    "RestartPlan",
    "RestartPolicy",
    "Retire",
    "ShardState",
    "SlotEvent",
    "SlotPhase",
    "SlotRecord",
    "SlotRemoved",
    "SlotsAdded",
    "SlotStatus",
    "StopExhausted",
    "TRAINER_RANK",
    "Tick",
    "Transition",
    "VersionCommitted",
    "check_size",
    "check_quorum",
    "classify_kind",
    "decide",
    "is_late",
    "plan_resize",
    "plan_membership",
    "refit_result",
    "step",
    "view_state",
]
