"""rlfleet's health core: the pure decision logic behind every recovery.

Given what the controller observed about its engines (deaths, unavailability,
deadlines, lies, probe results, refit outcomes) and the time, this package decides
what the fleet's state is and what to do next; the controller only carries the
decisions out. It imports nothing from Ray or vLLM and reads no clock of its own,
so every rule is testable with plain Python and a ``FakeClock``.

Driving it (the controller's side)::

    ledger = Ledger(HealthConfig(num_engines=4, min_healthy_engines=2))
    # launch every slot at ledger.record(slot).incarnation, then for each:
    step(ledger, EngineReady(slot, incarnation), clock.now())
    # every observed call outcome:
    d = step(ledger, observe(slot, incarnation, CallKind.PAUSE, outcome), clock.now())
    for action in d.actions: carry_out(action)       # Probe, Evict, Restart, ...
    log(d.reason)
    # timers (restart backoff, eviction of frozen shards): at ledger.next_wake_at()
    step(ledger, Tick(), clock.now())
    # a refit: RefitStarted(v), plan_membership(ledger, last_plan), RefitReport per
    # participant, VersionCommitted(v), resume outcomes, RefitFinished(v) -> the
    # decision holds OpenGate, KeepGateClosed or StopExhausted.

Modules: ``states`` (enums), ``config`` (HealthConfig), ``clock``, ``events``,
``decision`` (actions, Decision), ``classify``, ``ledger``, ``core`` (decide), ``quorum``,
``membership``, ``restart``.
"""

from __future__ import annotations

from health.classify import (
    classify_ack,
    classify_exception,
    classify_kind,
    classify_observation,
    classify_outcome,
    describe_outcome,
    exception_names,
    is_late,
    observe,
    refit_result,
)
from health.clock import Clock, FakeClock, MonotonicClock
from health.config import HealthConfig
from health.core import decide, step
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
    FleetEvent,
    Observed,
    RefitFinished,
    RefitReport,
    RefitStarted,
    SlotEvent,
    Tick,
    VersionCommitted,
)
from health.ledger import FleetState, Ledger, SlotRecord, SlotStatus, view_state
from health.membership import TRAINER_RANK, MembershipPlan, Participant, plan_membership
from health.quorum import QuorumDecision, check_quorum
from health.restart import RestartPlan, RestartPolicy
from health.states import CallKind, FailureClass, RefitResult, ShardState, SlotPhase

__all__ = [
    "AbortRefit",
    "Action",
    "CallKind",
    "Clock",
    "Decision",
    "EngineReady",
    "Event",
    "Evict",
    "FailureClass",
    "FakeClock",
    "FleetEvent",
    "FleetState",
    "HealthConfig",
    "KeepGateClosed",
    "Ledger",
    "MembershipPlan",
    "MonotonicClock",
    "Observed",
    "OpenGate",
    "Participant",
    "Probe",
    "QuorumDecision",
    "RefitFinished",
    "RefitReport",
    "RefitResult",
    "RefitStarted",
    "Restart",
    "RestartPlan",
    "RestartPolicy",
    "Retire",
    "ShardState",
    "SlotEvent",
    "SlotPhase",
    "SlotRecord",
    "SlotStatus",
    "StopExhausted",
    "TRAINER_RANK",
    "Tick",
    "Transition",
    "VersionCommitted",
    "check_quorum",
    "classify_ack",
    "classify_exception",
    "classify_kind",
    "classify_observation",
    "classify_outcome",
    "decide",
    "describe_outcome",
    "exception_names",
    "is_late",
    "observe",
    "plan_membership",
    "refit_result",
    "step",
    "view_state",
]
