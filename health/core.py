"""The decision core: ``decide(ledger, event, now) -> Decision``.

``decide`` is a pure function: it reads the ledger and returns what must change
(new slot records, new fleet state), what the controller must do (actions) and why
(reason). ``Ledger.apply(decision)`` makes the change; ``step`` does both. Why a
mutable ledger of immutable records rather than a copied or persistent one: see
``health.ledger`` (O(1) per event on a 1,024-slot fleet, nothing copied, and a
failed decision cannot leave a half-applied ledger).

Transition rules (DESIGN.md failure classes; "quarantine" = SUSPECT or HUNG):

- any event naming an incarnation older than the slot's, or a dead/retired one:
  LATE, ignored, nothing changes; a newer one was never issued: ``ValueError``.
- ``EngineReady`` / START ok: STARTING|RESTARTING -> STALE (no weights yet).
- DEAD (``ActorDiedError``) in any call: the incarnation is dead at once.
- SUSPECT (unavailable) or HUNG (deadline) outside probes: HEALTHY|STALE ->
  quarantine, ``Probe``. Never dead on its own. A hung PAUSE or RESUME also
  ``AbortRefit`` (gate stays closed); a hung REFIT takes the recovery path.
- LIED / ERROR in PAUSE, REFIT or RESUME: the weight stamp is dropped (STALE) and
  ``AbortRefit``. In STAMP (after the commit): STALE, the refit goes on with the others;
  the second failed stamp in a row evicts it (``Evict``, dead). In GENERATE: not a
  liveness signal, nothing changes.
- probe ok: quarantine -> HEALTHY if still on the current version, else STALE.
  Probe failed (unavailable, hung, lie, error): one failed probe, next ``Probe``
  not before ``probe_interval_s``; at ``unhealthy_threshold`` failed probes -> dead
  with ``Evict``.
- START failed (hung, lie, error): ``Evict``, dead. START unavailable: keep waiting.
- dead -> ``RestartPolicy``: within budget, DEAD until the backoff runs out, then
  (on a ``Tick``) RESTARTING at incarnation + 1 with ``Restart``; immediately when
  the backoff is zero. Budget spent -> RETIRED with ``Retire``.
- ``RefitReport``: COMPLETE of the refit in progress (not aborted) stamps the
  version on that incarnation; PARTIAL drops the stamp (mixed weights: STALE,
  rejoins the next refit, whose complete transfer overwrites every weight);
  NOT_STARTED changes nothing.
- ``RefitStarted``: gate closed; quarantined shards already past
  ``suspect_timeout_s`` are evicted; during the refit a ``Tick`` evicts the rest
  when their time runs out.
- ``VersionCommitted`` (refused after an abort): holders of that version become
  HEALTHY, every other live slot STALE.
- ``RefitFinished``: ``OpenGate`` iff the refit was committed, not aborted, and
  quorum holds; ``KeepGateClosed`` if aborted/uncommitted; ``StopExhausted`` (naming
  every dead slot) below quorum.
- ``RefitRolledBack`` (before any commit): the refit closes without one; ``OpenGate``
  on the committed version iff quorum serves it (and nothing aborted the refit).
- between refits, after any slot change: ``CloseGate`` when fewer than
  ``min_healthy_engines`` serve the committed version (requests wait); ``OpenGate``
  once enough serve again (only when quorum closed it).
- whenever retirements leave fewer than ``min_healthy_engines`` slots that could
  ever serve: ``StopExhausted`` (once).
- resize (``health.resize``): ``SlotsAdded`` appends STARTING slots; ``CheckpointLoaded``
  lands version 0 on a ready slot while 0 is committed; ``SlotRemoved`` retires a slot on
  purpose (``Drain`` while it may still run requests), not counted as a failure.
- re-admission (``health.readmit``): between refits a ``Tick`` asks ``Readmit`` for every live slot
  that does not hold the committed version (>= 1) while another does; ``Readmitted`` stamps the
  committed version on it outside a refit (it serves); ``ReadmitFailed`` backs off, and evicts at
  ``READMIT_FAILURES_TO_EVICT`` failures of its own in a row.
- the operator and the stop (``health.gate_rules``): ``OperatorPaused`` closes the gate and holds it
  closed through refits and quorum changes; ``OperatorResumed`` opens it where the rules above would
  (at a refit's end during one); ``Halted`` closes it for good. The ledger's ``gate_open`` is the gate.
- ``Batch(events)``: the slot events in order, each read through the changes of
  the ones before it, with the two checks above after each, as if fed one by one;
  one decision (one ``now``, one ledger write) for all of them.

Guarantee on failure: ``decide`` raises ``ValueError`` (naming the slot,
incarnation, version or time at fault) or ``TypeError`` for a non-event, before the
ledger could change; ``decide`` itself never changes the ledger.
"""

from __future__ import annotations

from typing import Any, Callable

from rlfleet.health import fleet_rules, gate_rules, readmit, resize, slot_rules
from rlfleet.health.decision import Decision
from rlfleet.health.draft import Draft
from rlfleet.health.events import (
    Batch,
    EngineReady,
    Event,
    Halted,
    Observed,
    OperatorPaused,
    OperatorResumed,
    RefitFinished,
    RefitReport,
    RefitRolledBack,
    RefitStarted,
    Tick,
    VersionCommitted,
)
from rlfleet.health.ledger import Ledger
from rlfleet.health.states import FailureClass

__all__ = ["decide", "step"]

_OK = FailureClass.OK
_LATE = FailureClass.LATE
_EXHAUSTED = FailureClass.EXHAUSTED

# Each takes the draft and an event of its key's type.
_SLOT_HANDLERS: dict[type, Callable[[Draft, Any], None]] = {
    EngineReady: slot_rules.on_ready,
    Observed: slot_rules.on_observed,
    RefitReport: slot_rules.on_report,
    resize.SlotRemoved: resize.on_slot_removed,
    resize.CheckpointLoaded: resize.on_checkpoint_loaded,
    readmit.Readmitted: readmit.on_readmitted,
    readmit.ReadmitFailed: readmit.on_readmit_failed,
}

_HANDLERS: dict[type, Callable[[Draft, Any], None]] = {
    **_SLOT_HANDLERS,
    RefitStarted: fleet_rules.on_refit_started,
    VersionCommitted: fleet_rules.on_committed,
    RefitFinished: fleet_rules.on_refit_finished,
    RefitRolledBack: fleet_rules.on_refit_rolled_back,
    Tick: fleet_rules.on_tick,
    resize.SlotsAdded: resize.on_slots_added,
    OperatorPaused: gate_rules.on_operator_paused,
    OperatorResumed: gate_rules.on_operator_resumed,
    Halted: gate_rules.on_halted,
}


def decide(ledger: Ledger, event: Event, now: float) -> Decision:
    """Decide what ``event``, observed at ``now``, means for the fleet.

    Preconditions: ``now`` is not earlier than ``ledger.now`` (a monotonic clock);
    slot events name an existing slot and an incarnation the ledger issued.
    Returns a ``Decision``; the ledger is not modified (see ``Ledger.apply``).
    """
    if not now >= ledger._now:  # also rejects NaN
        raise ValueError(
            f"decide got now={now!r}, earlier than the ledger's last time "
            f"{ledger._now!r}: feed it a monotonic clock"
        )
    draft = Draft(ledger, event, now)
    if type(event) is Batch:
        _decide_batch(draft, event)
        return draft.finish()
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"decide got a {type(event).__name__}, which is not a health event")
    handler(draft, event)
    if draft.retired:
        fleet_rules.check_permanent_exhaustion(draft)
    if draft.changed:
        fleet_rules.check_quorum_between_refits(draft)
    return draft.finish()


def _decide_batch(draft: Draft, batch: Batch) -> None:
    """Each slot event of ``batch`` in order, in one draft, with the checks ``decide`` makes after
    a single event made after each one; the decision's ``failure`` sums theirs up (``_batch_failure``)."""
    events = batch.events
    if type(events) is not tuple:
        raise TypeError(f"Batch.events must be a tuple of slot events, got {type(events).__name__}")
    failures = []
    draft.begin_batch()
    if events and slot_rules.land_all(draft, events):
        return  # every event OK, nothing retired, no quorum check during a refit
    for ev in events:
        handler = _SLOT_HANDLERS.get(type(ev))
        if handler is None:
            raise TypeError(
                "a Batch holds slot events (EngineReady, Observed, RefitReport, SlotRemoved, CheckpointLoaded), "
                f"got {type(ev).__name__}"
            )
        draft.failure = _OK
        puts = draft.puts
        handler(draft, ev)
        if draft.retired:
            fleet_rules.check_permanent_exhaustion(draft)
        if draft.puts != puts:
            fleet_rules.check_quorum_between_refits(draft)
        draft.end_event()
        failures.append(draft.failure)
    draft.failure = _batch_failure(failures)


def _batch_failure(failures: list[FailureClass]) -> FailureClass:
    """EXHAUSTED if any event left the fleet exhausted; else the first failure that is neither OK
    nor LATE; else LATE if every event was late; else OK (an empty batch too)."""
    if _EXHAUSTED in failures:
        return _EXHAUSTED
    for f in failures:
        if f is not _OK and f is not _LATE:
            return f
    if failures and all(f is _LATE for f in failures):
        return _LATE
    return _OK


def step(ledger: Ledger, event: Event, now: float) -> Decision:
    """``decide`` then ``ledger.apply``; returns the applied decision."""
    decision = decide(ledger, event, now)
    ledger.apply(decision)
    return decision
