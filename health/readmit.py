"""Re-admission: an engine that is up but stale brought to the committed version outside a refit.

An engine that restarted after a death, a grown one and a fresh spare start on the checkpoint: stale
while the fleet has committed a later version. Instead of waiting for the trainer's next refit, the
controller copies the committed weights into it from a live donor (a healthy peer, or a committed copy
such as the RL surface's relay), proves the copy equal by digests, stamps it, and only then reports it.
The committed version does not change; no other engine pauses; the gate stays as it is.

What the health core decides here (pure, no I/O; the controller carries the actions out):

- ``on_tick`` (called from ``fleet_rules.on_tick``): level-triggered. Between refits, while the fleet
  serves a committed version ``cv >= 1`` with at least one healthy engine (a donor), every live slot
  that does not hold ``cv`` and whose back-off has run out gets a ``Readmit(slot, incarnation, cv)``
  action. It is emitted again on later ticks while the slot stays stale: the controller runs at most
  one re-admission per incarnation and ignores the repeats. Version 0 is the checkpoint, which a
  restarted engine loads by itself (``CheckpointLoaded``).
- ``Readmitted(slot, incarnation, version, source)`` (slot event): the incarnation holds ``version``,
  proven. If ``version`` is the committed one, no refit runs and the slot is live, it is stamped
  (healthy: it serves, and may bring quorum back); otherwise nothing changes (a refit that began
  meanwhile includes or excludes it by its state, and a later tick asks again). ``CheckpointLoaded``
  is the same rule for version 0 (``land_committed``).
- ``ReadmitFailed(slot, incarnation, detail, its_fault)``: a re-admission that did not land. A failure
  that is the engine's own (``its_fault``: its receive or load failed, its digests differ) counts; at
  ``READMIT_FAILURES_TO_EVICT`` in a row it is evicted (a fresh incarnation tries again). Either way the
  next try waits ``READMIT_BACKOFF_S`` doubled per failure in a row, whoever's (at most
  ``READMIT_BACKOFF_CAP_S``): a slot that keeps failing, or whose donors keep failing, is never retried every
  tick. A donor's failure does not count toward the engine's eviction.

Guarantee on failure: an event about an older or condemned incarnation is LATE and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.health.decision import Readmit
from rlfleet.health.draft import Draft
from rlfleet.health.ledger import Ledger, SlotRecord, view_state
from rlfleet.health.states import ShardState, SlotPhase

__all__ = ["READMIT_BACKOFF_CAP_S", "READMIT_BACKOFF_S", "READMIT_FAILURES_TO_EVICT", "ReadmitFailed",
           "Readmitted", "due", "land_committed", "on_readmit_failed", "on_readmitted", "on_tick"]

READMIT_FAILURES_TO_EVICT = 3
READMIT_BACKOFF_S = 2.0
READMIT_BACKOFF_CAP_S = 60.0
_LIVE = SlotPhase.LIVE


@dataclass(frozen=True, slots=True)
class Readmitted:
    """The incarnation holds ``version`` whole, proven (digests equal to ``source``'s)."""

    slot: int
    incarnation: int
    version: int
    source: str = ""


@dataclass(frozen=True, slots=True)
class ReadmitFailed:
    """A re-admission of the incarnation did not land; ``its_fault``: the engine's own receive, load or digest."""

    slot: int
    incarnation: int
    detail: str
    its_fault: bool = True


def due(ledger: Ledger, now: float) -> list[tuple[int, int]]:
    """(slot, incarnation) of every engine whose re-admission may start at ``now``: between refits, while
    version ``cv >= 1`` is committed and some engine holds it, each live, stale, not removed slot whose
    back-off ran out. The one statement of the rule: ``on_tick`` acts on it, and the controller asks it
    when to tick."""
    fleet = ledger.fleet
    cv = fleet.current_version
    if cv is None or cv < 1 or fleet.refit_version is not None or fleet.halted is not None or fleet.exhausted \
            or fleet.stopped is not None:
        return []
    holding = ledger.holding(cv)
    if not holding:
        return []  # no engine holds the committed weights: nothing to copy them from
    out = []
    for slot in sorted(ledger.slots_in(_LIVE) - holding):
        rec = ledger.raw(slot)
        if not rec.removed and rec.readmit_after <= now and view_state(rec, cv) is ShardState.STALE:
            out.append((slot, rec.incarnation))
    return out


def on_tick(d: Draft) -> None:
    """A ``Readmit`` for each engine ``due`` (a slot a timer of this same tick changed is left to the next)."""
    cv = d.ledger.current_version
    for slot, inc in due(d.ledger, d.now):  # due() is empty unless a version is committed
        if cv is not None and slot not in d.changed:
            d.actions.append(Readmit(slot, inc, cv, f"stale while version {cv} is committed"))


def on_readmitted(d: Draft, ev: Readmitted) -> None:
    rec = _current(d, ev)
    if rec is not None:
        land_committed(d, rec, ev.version, f"re-admitted from {ev.source or 'a donor'}")


def land_committed(d: Draft, rec: SlotRecord, version: int, how: str) -> None:
    """``rec`` holds ``version`` outside a refit: stamped (it serves) when ``version`` is the committed one,
    no refit runs and the slot is live; else nothing changes, with the reason."""
    fleet = d.fleet_now()
    where = f"slot {rec.slot} incarnation {rec.incarnation}"
    if rec.phase is not _LIVE:
        why = "it is not live"
    elif fleet.current_version != version:
        why = f"the committed version is {fleet.current_version}, not {version}"
    elif fleet.refit_version is not None:
        why = f"the refit of version {fleet.refit_version} is in progress"
    elif rec.weight_version == version:
        why = "it already holds it"
    else:
        why = None
    if why is not None:
        d.reasons.append(f"{where} {how} with version {version}, but {why}: nothing changes")
        return
    reason = f"{how}: holds the committed version {version}"
    d.put(rec, rec._replace(weight_version=version, partial=False, readmit_failures=0, readmit_after=0.0,
                            readmit_tries=0, reason=reason))
    d.reasons.append(f"{where} {reason}; it serves")


def on_readmit_failed(d: Draft, ev: ReadmitFailed) -> None:
    rec = _current(d, ev)
    if rec is None:
        return
    from rlfleet.health.slot_rules import condemn

    failures = rec.readmit_failures + (1 if ev.its_fault else 0)
    where = f"slot {rec.slot} incarnation {rec.incarnation}"
    if failures >= READMIT_FAILURES_TO_EVICT:
        condemn(d, rec, f"re-admission failed {failures} times in a row: {ev.detail}; evicted", evict=True)
        return
    tries = rec.readmit_tries + 1  # a donor's failure does not count toward eviction, but backs off all the same
    backoff = min(READMIT_BACKOFF_S * 2 ** (tries - 1), READMIT_BACKOFF_CAP_S)
    d.put(rec, rec._replace(readmit_failures=failures, readmit_tries=tries, readmit_after=d.now + backoff,
                            reason=f"re-admission failed: {ev.detail}"))
    whose = "its own" if ev.its_fault else "the donor's, not counted"
    d.reasons.append(f"{where} re-admission failed ({whose}): {ev.detail}; next try in {backoff:g} s "
                     f"({failures} of {READMIT_FAILURES_TO_EVICT} failures before eviction)")


def _current(d: Draft, ev) -> SlotRecord | None:
    from rlfleet.health.slot_rules import _resolve

    return _resolve(d, ev)
