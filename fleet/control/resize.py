"""Elastic size on the controller: ``SingleController.resize(n)`` grows or shrinks the fleet to ``n``
serving engines (``num_engines``; warm spares, if any, stay on top of it).

What changes is decided by the health core (``health.resize``: ``plan_resize``, ``SlotsAdded``,
``SlotRemoved``, ``CheckpointLoaded``); this module carries it out, holding the refit
lifecycle's lock for the whole resize, so a resize and a refit never interleave (each waits for
the other).

Slots retired by failures (restart budget spent) count as missing: a resize to ``n`` at or above the
slots not retired first removes them for good (``retired`` in the summary; they hold no engine), then
grows by as many fresh slots as ``n`` needs, so ``resize(n)`` to the size the fleet has brings a fleet
whose slots were retired back to ``n`` engines. The monitor never does this on its own: a retirement is
the restart budget's verdict (an engine that keeps dying, for whatever reason, is not relaunched
forever); the operator's resize is the request for new engines.

Grow (``n`` above the slots not retired): the new slots are stored in the intent before their
actors exist (a restarted controller finds them by name), spawned and started under the
start bound (a start that fails is a dead engine: restarted within its budget). A started
engine is stale: it serves once a refit lands on it, i.e. after the trainer's next
``sync_weights``; while the committed version is 0 (the checkpoint every engine loads from
disk) it serves at once, as the engines of ``start`` do. ``resize`` returns when the new
engines have started (or failed to), not when they serve.

Shrink (``n`` below): the slots that serve least go first (``plan_resize``). They are stored
in the intent as removed, retired in the ledger (out of the serving set, out of refits,
never restarted; not a failure) and the routing state is published at once. Each removed
engine is then drained (``Drain``): told it is no longer a member (it refuses new work, which
its clients route elsewhere), its in-flight requests (unless it is paused, when they cannot finish: they are
aborted and re-sent at once) are left to finish for up to the drain
bound (``request_timeout_s`` unless given), whatever is still running then is aborted (the
clients re-send it: nothing is lost), and the engine is shut down and killed.

Every resize writes a ``resize`` record at its beginning and end (sizes, slots added and
removed, and per removed slot what its drain saw: in flight and admitted at removal,
admitted at the end, finished, aborted). ``resize(n)`` to the size the fleet has changes
nothing, so re-sending it to a restarted controller is safe.

Guarantee on failure: ``n`` is checked before anything changes (``ConfigError`` naming ``n``
and ``min_healthy_engines``); a stopped fleet refuses (``FleetStopped``). After that a
resize always ends with the target size recorded in the intent and the ledger; engines that
fail to start are handled as any dead engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Iterable

from rlfleet.fleet.errors import ConfigError, FleetStopped
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.publisher import RoutingPublisher
from rlfleet.health import (
    Batch,
    Drain,
    Ledger,
    ShardState,
    SlotRemoved,
    SlotsAdded,
    check_size,
    plan_resize,
)
from rlfleet.fleet import records as ev
from rlfleet.fleet.wire import Counters, Left

DRAIN_POLL_S = 0.05  # how often a draining shard's in-flight count is read


def check_target(n: Any, min_healthy_engines: int) -> int:
    """``n`` as a new serving size, or ``ConfigError`` naming ``n`` and ``min_healthy_engines``."""
    try:
        return check_size(n, min_healthy_engines)
    except ValueError as exc:
        raise ConfigError("n", f"{exc}; nothing changed, the fleet keeps serving", n) from None


def drain_bound(drain_timeout_s: Any, request_timeout_s: float) -> float:
    """How long a removed engine's in-flight requests may take to finish: ``drain_timeout_s``, else
    ``request_timeout_s``; ``ConfigError`` for anything but a number >= 0 or None."""
    if drain_timeout_s is None:
        return float(request_timeout_s)
    if isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, (int, float)) or not drain_timeout_s >= 0:
        raise ConfigError("drain_timeout_s", "must be a number of seconds >= 0 or None (request_timeout_s)",
                          drain_timeout_s)
    return float(drain_timeout_s)


async def resize(p: Parts, publisher: RoutingPublisher, refits: asyncio.Lock, n: Any, drain_timeout_s: Any = None) -> dict:
    """Grow or shrink the fleet to ``n`` serving engines (module docstring); returns a summary. ``refits``:
    the lock every refit holds (``RefitLifecycle.lock``): a refit and a resize never interleave."""
    n = check_target(n, p.cfg.min_healthy_engines)
    bound = drain_bound(drain_timeout_s, p.cfg.request_timeout_s)
    async with refits:  # a refit running now ends first; the next one waits for this resize
        if p.act.stopped:
            raise FleetStopped(f"resize({n}) refused: fleet stopped: {p.act.stopped}")
        spares = p.cfg.spare_engines
        plan = plan_resize(p.slots.ledger, n + spares)
        size_from = plan.current - spares
        t0 = p.clock.now()
        if plan.unchanged:
            return _summary(p, publisher, size_from, n, [], {}, t0)
        p.log.emit(ev.Resize(edge="begin", size_from=size_from, size_to=n, add=plan.add,
                     remove=[s for s, _ in plan.remove]))
        p.slots.size = n  # the serving size follows at once
        retired = [s for s, _ in plan.remove if p.slots.ledger.state(s) is ShardState.RETIRED]
        added, drained = [], {}
        if plan.remove:  # a grow removes only slots retired by failures (no engine to drain): first
            drained = await _shrink(p, publisher, plan.remove, n, bound)
        if plan.add:
            added = await _grow(p, plan.add, n)
        await publisher.publish()
        summary = _summary(p, publisher, size_from, n, added, drained, t0, retired)
        p.log.emit(ev.Resize(edge="end", **{k: v for k, v in summary.items() if k != "routing_epoch"}))
        return summary


def _summary(p: Parts, publisher: RoutingPublisher, size_from: int, n: int, added: list, drained: dict, t0: float, retired: Iterable[int] = ()) -> dict:
    return {"size_from": size_from, "size_to": n, "added": added, "removed": sorted(drained), "retired": sorted(retired),
            "drained": {str(s): row for s, row in sorted(drained.items())}, "serving": sorted(m.slot for m in publisher.current.members),
            "seconds": round(p.clock.now() - t0, 3), "routing_epoch": publisher.current.epoch}


# ------------------------------------------------------------------------------ grow
async def _grow(p: Parts, count: int, n: int) -> list[int]:
    """Add ``count`` slots, spawn and start their engines; returns the new slots."""
    first = p.slots.ledger.num_slots
    p.act.decide(SlotsAdded(count, f"resize to {n} engines"))
    new = list(range(first, first + count))
    await p.reconciler.launched(new)  # each stored in the intent before its actor exists; bounded; a failed
    # launch is dead, restarted
    await p.act.poll_admission()  # caps sized from the new engines before clients route to them
    return new


# ------------------------------------------------------------------------------ shrink
async def _shrink(p: Parts, publisher: RoutingPublisher, remove: tuple[tuple[int, int], ...], n: int, bound: float) -> dict[int, dict]:
    """Retire ``remove`` (slot, incarnation) for good, drain what still runs there, shut it down."""
    removed = dict(remove)
    p.slots.remove(removed)  # stored first: a successor fences them, never serves them
    before = publisher.current.epoch
    d = p.act.decide(Batch(tuple(SlotRemoved(s, inc, f"resize to {n} engines") for s, inc in remove)))
    drains = [a for a in d.actions if isinstance(a, Drain)]
    await publisher.publish()  # out of the serving set (each leaver is told) before the drain begins
    epoch = publisher.current.epoch
    rows = await asyncio.gather(*(_drain(p, a, before, epoch, bound) for a in drains))
    out = {a.slot: row for a, row in zip(drains, rows)}
    for slot, inc in remove:
        out.setdefault(slot, {"incarnation": inc, "drained": False, "note": "no engine left to drain"})
        forget_removed(p, slot, inc, "removed by a resize")
    return out


async def _drain(p: Parts, action: Drain, before: int, epoch: int, bound: float) -> dict:
    """Tell the shard it left the serving set (the publisher told it already if it was a member), wait
    (bounded) until its in-flight requests finished, abort what is left (the clients re-send it), shut it
    down. Returns what the drain saw: what the shard held and had admitted as it left the serving set (its
    own note, taken at that instant, at an epoch after ``before``; else at the first read), and after."""
    slot, inc = action.slot, action.incarnation
    handle = p.slots.handle_of(slot, inc)
    row: dict[str, Any] = {"incarnation": inc, "drained": False}
    if handle is None:
        return {**row, "note": "no engine left to drain"}
    probe = p.cfg.probe_timeout_s
    told = await p.door.call(handle, "set_route", epoch, False, p.gate.version, timeout=probe, expect_ack=True)
    first = await p.door.call(handle, "counters", timeout=probe)
    t0, last, aborted = p.clock.now(), first, 0
    # a paused engine (the operator's ``keep`` pause) finishes nothing: waiting for it would hold the lifecycle's
    # lock for the whole bound, so its requests are aborted at once and re-sent (they run after the resume)
    while last.ok and last.value.in_flight and not last.value.paused and p.clock.now() - t0 < bound:
        await asyncio.sleep(DRAIN_POLL_S)
        last = await p.door.call(handle, "counters", timeout=probe)
    if last.ok and last.value.paused:
        row["paused"] = True
    if last.ok and last.value.in_flight:  # the bound passed (or it is paused): aborted and re-sent
        out = await p.door.call(handle, "abort_in_flight", timeout=probe)
        aborted = out.value if out.ok else last.value.in_flight
        last = await p.door.call(handle, "counters", timeout=probe)
    if first.ok and last.ok:
        c0: Counters = first.value
        c1: Counters = last.value
        # the instant it left, if it was serving (its own note, at an epoch after ``before``); else the first read
        at: Left | Counters = c0.left if c0.left is not None and c0.left.epoch > before else c0
        row.update(drained=not c1.in_flight, in_flight_at_removal=at.in_flight, finished=at.in_flight - aborted,
                   aborted=aborted, admitted_at_removal=at.admitted, admitted_at_end=c1.admitted,
                   refused_after_removal=sum(c1.refused.values()) - sum(c0.refused.values()))
    else:
        row["note"] = f"its counters could not be read: {(first if not first.ok else last).describe()[:200]}"
    row["told"] = told.kind
    row["drain_s"] = round(p.clock.now() - t0, 3)
    shut = await p.door.call(handle, "shutdown", timeout=p.cfg.engine.call_timeout_s + 5)
    row["shutdown"] = shut.kind
    return row


def forget_removed(p: Parts, slot: int, incarnation: int, reason: str) -> None:
    """The removed engine's actor is killed (if still the slot's) and the controller lets go of the slot."""
    p.slots.forget(slot, incarnation, reason)
    p.admission.forget(slot)


# ------------------------------------------------------------------------------ re-adoption (fleet.control.recovery)
def adopted_ledger(p: Parts, intent: Any) -> tuple[Ledger, int]:
    """The ledger a restarted controller rebuilds from ``intent`` (every slot the fleet ever had, grown ones
    too, the removed ones retired for good) and the serving size it had (the target size less the spares)."""
    slots = set(intent.slots) | set(intent.removed)
    total = max(slots) + 1 if slots else p.cfg.total_engines
    config = dataclasses.replace(p.cfg.health_config(), num_engines=total)
    ledger = Ledger(config, now=p.clock.now(), adopted=intent.slots, removed=intent.removed)
    serving = ledger.target_size - p.cfg.spare_engines
    return ledger, serving if serving >= p.cfg.min_healthy_engines else p.slots.size


def fence_removed(p: Parts, intent: Any) -> list[list[int]]:
    """Kill any actor left of a slot a resize removed (the predecessor died before it was shut down:
    its clients re-send what it ran). Returns [slot, incarnation] of each one killed."""
    fenced = []
    for slot, inc in sorted(intent.removed.items()):
        for other in (inc - 1, inc, inc + 1):
            if p.slots.fence_by_name(slot, other, inc, "a slot a resize removed: killed"):
                fenced.append([slot, other])
    return fenced
