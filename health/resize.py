"""Elastic size, the pure part: which slots a resize adds or removes, and what that does to the ledger.

A fleet's *target size* is its slots minus those a resize removed (``Ledger.target_size``;
slots that failed for good still count: they are the fleet's, lost). ``plan_resize(ledger, n)``
says what ``resize(n)`` must do; it counts the slots retired by failures as missing, so a resize
to ``n`` removes them and adds fresh slots until ``n`` are not retired (a retired slot is never
relaunched under its own number: its restart budget said no; the operator's resize is what asks
for new engines). Three events carry it out through ``decide`` like any other:

- ``SlotsAdded(count)`` (fleet event): ``count`` new slots are appended, ``STARTING`` at the
  ledger's first incarnation. Launch each, then ``EngineReady``: ``STALE`` until a refit of
  the committed version lands on it.
- ``CheckpointLoaded(slot, incarnation)`` (slot event): the engine loaded the checkpoint, which
  is version 0. While version 0 is the committed version (no refit ever committed) and no refit
  runs, that load is a complete refit of version 0 (what ``start`` counts too): the slot serves.
  Otherwise nothing changes: it is stale until the next refit lands on it.
- ``SlotRemoved(slot, incarnation, reason)`` (slot event): the slot is ``RETIRED`` with
  ``removed`` set, whatever its state: out of the serving set, out of refits, never restarted,
  not a failure (the fleet stops only when its *target size* minus the slots retired by
  failures falls below ``min_healthy_engines``, which a resize validated against ``n`` never
  causes). An incarnation that may still have an actor gets a ``Drain`` action: let its
  in-flight requests finish, then shut it down.

Both changes are refused during a refit (resize between refits), and a removal that would take
the target size below ``min_healthy_engines`` is refused. Each event is O(1) (``SlotsAdded``:
O(count)); ``plan_resize`` is O(slots log slots), once per resize.

Guarantee on failure: ``plan_resize`` and ``decide`` raise ``ValueError`` (naming ``n``,
``min_healthy_engines``, the slot or the refit) before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.health.decision import Transition
from rlfleet.health.draft import Draft
from rlfleet.health.readmit import land_committed
from rlfleet.health.ledger import Ledger, SlotRecord, view_state
from rlfleet.health.slot_rules import _resolve
from rlfleet.health.states import ShardState, SlotPhase

__all__ = ["CheckpointLoaded", "Drain", "ResizePlan", "SlotRemoved", "SlotsAdded", "check_size", "plan_resize"]

CHECKPOINT_VERSION = 0  # what an engine holds right after it loaded the model from disk
_LAUNCHING = SlotPhase.LAUNCHING
_LIVE = SlotPhase.LIVE
_RETIRED = SlotPhase.RETIRED
_STARTING = ShardState.STARTING
# Which slots a shrink removes first: those that serve nothing (retired by failure, dead, (re)starting,
# quarantined, stale), then serving ones; within a rank, the highest slot numbers.
_REMOVE_FIRST = {ShardState.RETIRED: 0, ShardState.DEAD: 1, ShardState.RESTARTING: 2, ShardState.STARTING: 2,
                 ShardState.SUSPECT: 3, ShardState.HUNG: 3, ShardState.STALE: 4, ShardState.HEALTHY: 5}
_HAS_ACTOR = frozenset({SlotPhase.LAUNCHING, SlotPhase.LIVE, SlotPhase.SUSPECT, SlotPhase.HUNG})


@dataclass(frozen=True, slots=True)
class SlotsAdded:
    """A resize grows the fleet by ``count`` slots (appended after the last one, ``STARTING``)."""

    count: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SlotRemoved:
    """A resize removes ``incarnation`` of ``slot`` for good (retired on purpose, not a failure)."""

    slot: int
    incarnation: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CheckpointLoaded:
    """``incarnation`` of ``slot`` is ready with the checkpoint loaded from disk (version 0), and no
    transfer has touched it."""

    slot: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Drain:
    """``incarnation`` of ``slot`` was removed by a resize and may still run requests: it is out of the
    serving set already; tell its shard so, let its in-flight requests finish (bounded; what is left is
    aborted and re-sent by its clients), then shut it down and kill it."""

    slot: int
    incarnation: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResizePlan:
    """``resize(target)`` of a fleet whose target size is ``current``: add ``add`` slots, or remove
    ``remove`` (slot, incarnation) pairs, or neither (``unchanged``)."""

    current: int
    target: int
    add: int = 0
    remove: tuple[tuple[int, int], ...] = ()

    @property
    def unchanged(self) -> bool:
        return not self.add and not self.remove


def check_size(n: object, min_healthy_engines: int) -> int:
    """``n`` as a fleet size: an integer >= 1 and >= ``min_healthy_engines``; else ``ValueError`` naming both."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"resize: n must be an integer >= 1 engines, got {n!r}")
    if n < min_healthy_engines:
        raise ValueError(f"resize: n={n} is below min_healthy_engines={min_healthy_engines}: the fleet could "
                         f"never reopen its gate; pick n >= {min_healthy_engines}")
    return n


def plan_resize(ledger: Ledger, n: object) -> ResizePlan:
    """What ``resize(n)`` does to ``ledger``'s fleet (``check_size`` first). Slots retired by failures
    (restart budget spent) count as missing: when ``n`` is at least the slots not retired, every retired
    slot is removed and enough new slots are added to have ``n`` (so ``resize`` to the size the fleet has
    replaces them; with none retired and ``n`` equal to the target size, the plan is ``unchanged``). A
    shrink below that removes the slots that serve least (``_REMOVE_FIRST``: the retired first), highest
    slot numbers first among equals, so it takes serving engines away only when it must and never drops
    the serving count below ``n``."""
    n = check_size(n, ledger.config.min_healthy_engines)
    current = ledger.target_size
    kept = [ledger.raw(s) for s in range(ledger.num_slots) if not ledger.raw(s).removed]
    failed = tuple((r.slot, r.incarnation) for r in kept if r.phase is _RETIRED)  # retired by failures: missing
    if n >= current - len(failed):  # grow to n live slots: the failed ones go for good, fresh ones take their place
        return ResizePlan(current, n, add=n - (current - len(failed)), remove=failed)
    cv = ledger.current_version
    order = sorted(kept, key=lambda r: (_REMOVE_FIRST[view_state(r, cv)], -r.slot))
    return ResizePlan(current, n, remove=tuple((r.slot, r.incarnation) for r in order[: current - n]))


# ------------------------------------------------------------------------------ rules (health.core)
def _refuse_during_refit(d: Draft, what: str) -> None:
    refit = d.fleet_now().refit_version
    if refit is not None:
        raise ValueError(f"{what} during the refit of version {refit}: a resize runs between refits")


def on_slots_added(d: Draft, ev: SlotsAdded) -> None:
    count = ev.count
    if type(count) is not int or count < 1:
        raise ValueError(f"SlotsAdded needs a count that is an integer >= 1, got {count!r}")
    _refuse_during_refit(d, f"SlotsAdded({count})")
    ledger = d.ledger
    first, inc = ledger.num_slots, ledger.first_incarnation
    reason = "added by a resize" + (f" ({ev.reason})" if ev.reason else "")
    for slot in range(first, first + count):
        d.changed[slot] = SlotRecord(slot, inc, _LAUNCHING, None, False, d.now, 0, 0, None, reason)
        d.puts += 1
        d.transitions.append(Transition(slot, inc, _STARTING, _STARTING, reason))
    d.reasons.append(f"slots {first}..{first + count - 1} added, starting at incarnation {inc}; "
                     f"target size {ledger.target_size} -> {ledger.target_size + count}")


def on_slot_removed(d: Draft, ev: SlotRemoved) -> None:
    records = d.ledger._records
    slot, inc = ev.slot, ev.incarnation
    if type(slot) is not int or not 0 <= slot < len(records):
        raise ValueError(f"SlotRemoved names slot {slot!r}, but the fleet has slots 0..{len(records) - 1}")
    _refuse_during_refit(d, f"SlotRemoved(slot {slot})")
    rec = d.get(slot)
    if inc != rec.incarnation:
        if type(inc) is int and inc < rec.incarnation:
            d.late(f"removal of slot {slot} incarnation {inc}: the slot is on incarnation {rec.incarnation}: ignored")
            return
        raise ValueError(f"SlotRemoved names slot {slot} incarnation {inc!r}, which the ledger never issued "
                         f"(current incarnation {rec.incarnation})")
    if rec.removed:
        d.late(f"slot {slot} incarnation {inc} was already removed by a resize: nothing to do")
        return
    target = d.ledger.target_size - sum(1 for s, r in d.changed.items() if r.removed and not records[s].removed)
    needed = d.ledger.config.min_healthy_engines
    if target - 1 < needed:
        raise ValueError(f"SlotRemoved(slot {slot}): the target size would fall to {target - 1}, below "
                         f"min_healthy_engines={needed}")
    was = view_state(rec, d.ledger._fleet.current_version).value
    reason = f"removed by a resize (was {was})" + (f": {ev.reason}" if ev.reason else "")
    new = rec._replace(phase=_RETIRED, weight_version=None, partial=False, since=d.now, failed_probes=0,
                       restart_at=None, reason=reason, removed=True)
    d.put(rec, new)
    if rec.phase in _HAS_ACTOR:
        d.actions.append(Drain(slot, inc, reason))
    d.reasons.append(f"slot {slot} incarnation {inc} {reason}; target size {target} -> {target - 1}")


def on_checkpoint_loaded(d: Draft, ev: CheckpointLoaded) -> None:
    rec = _resolve(d, ev)
    if rec is None:
        return
    if rec.phase is _LIVE and (rec.weight_version is not None or rec.partial):
        d.reasons.append(f"slot {rec.slot} incarnation {rec.incarnation} loaded the checkpoint (version "
                         f"{CHECKPOINT_VERSION}), but a refit already wrote into its weights: nothing changes")
        return
    land_committed(d, rec, CHECKPOINT_VERSION, "loaded the checkpoint")
