"""Launching an engine: spawn one incarnation of a slot, wait for Ray to place it, start it; bounded.

Every launch goes through here (``bring_up``, run by ``fleet.control.reconcile``): the fleet's ``start``, a
restart, a slot a resize added, and a start a dead controller began (watched, not launched again).
``launch`` never raises for a failed launch (only cancellation passes through): a
``spawn_shard`` that raises, a ``start`` that fails, and a ``start`` that does not answer
within the watchdog (``watchdog_s``: the start's own bound, ``engine.start_timeout_s`` +
``START_MARGIN_S``, plus ``WATCHDOG_GRACE_S`` in case the door's bound itself breaks) all come
back as an ``Outcome`` naming what happened. Waiting for Ray to *place* a restarted actor
(no node has room: a node was lost) is not bounded (``wait_placed``): the
slot stays restarting and the fleet serves on quorum; the watchdog starts once the actor exists.

``failed`` turns a launch that did not end ready into a failed start: a ``launch`` record
naming the slot, incarnation, outcome, error and bound; the incarnation is killed (only it);
and one health decision condemns it as dead, so the slot's restart budget is spent as for
a death: it is launched again after its backoff, or retired once the budget is spent.

Guarantee on failure: a slot is never left ``restarting`` (or ``starting``) by a launch that
raised or hung; the error names the slot, incarnation and the bound it broke.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfleet.fleet.outcome import ERROR, TIMED_OUT, Outcome
from rlfleet.fleet.control.parts import Parts
from rlfleet.health import Batch, CallKind, CheckpointLoaded, EngineReady, Evict, FailureClass, Observed
from rlfleet.fleet import records as ev

PLACEMENT_POLL_S = 1.0
WATCH_POLL_S = 0.5  # how often a start a dead controller began is asked how far it got  # how often a restart that Ray cannot place yet asks again
PLACEMENT_NOTE_AFTER_S = 5.0  # Ray takes a moment to start any actor's process: pending longer is worth a record
START_MARGIN_S = 30.0  # the start call's bound past engine.start_timeout_s (the shard's own start has that bound)
WATCHDOG_GRACE_S = 15.0  # the watchdog cuts a launch this long after the start call's own bound


class LaunchError(RuntimeError):
    """A launch of one incarnation of a slot failed before the engine could answer (``spawn_shard`` raised)."""


def start_bound_s(cfg: Any) -> float:
    """The deadline of the ``start`` call of a launch."""
    return cfg.engine.start_timeout_s + START_MARGIN_S


def watchdog_s(cfg: Any) -> float:
    """The watchdog's bound on a launch once its actor exists (spawn and start)."""
    return start_bound_s(cfg) + WATCHDOG_GRACE_S


async def launch(p: Parts, slot: int, incarnation: int, *, wait_placement: bool = False) -> Outcome:
    """Spawn ``incarnation`` of ``slot`` and start it. Returns the start's outcome (``value``: what the shard
    said of itself), or an ``error``/``timed_out`` outcome for a spawn that raised or a start the watchdog cut."""
    try:
        handle = p.slots.spawn(slot, incarnation)
    except Exception as exc:  # noqa: BLE001 - a spawn that raises is a failed launch, never a stuck slot
        return Outcome(ERROR, error=LaunchError(
            f"spawn of slot {slot} incarnation {incarnation} raised {type(exc).__name__}: {exc}"))
    if wait_placement:
        await wait_placed(p, slot, incarnation, handle)
    bound = watchdog_s(p.cfg)
    t0 = p.clock.now()
    try:
        async with asyncio.timeout(bound):  # on this task: no extra task, no extra loop turn for a prompt answer
            return await p.door.call(handle, "start", timeout=start_bound_s(p.cfg))
    except TimeoutError:
        return Outcome(TIMED_OUT, error=TimeoutError(
            f"launch of slot {slot} incarnation {incarnation}: start did not answer within the watchdog's "
            f"{bound:g} s (engine.start_timeout_s={p.cfg.engine.start_timeout_s:g} + {bound - p.cfg.engine.start_timeout_s:g})"),
            elapsed_s=p.clock.now() - t0)
    except Exception as exc:  # noqa: BLE001 - the door never raises for a shard's failure; if it does, it is one
        return Outcome(ERROR, error=exc, elapsed_s=p.clock.now() - t0)


async def wait_placed(p: Parts, slot: int, incarnation: int, handle: Any) -> None:
    """Wait, without bound, while Ray cannot place a restarted shard (no node has room: a node was lost).
    The slot stays restarting and the fleet serves on quorum; the start's own deadline begins once
    the actor exists. Ends when the slot moved on (killed, replaced) or the fleet stopped."""
    waited, t0 = False, p.clock.now()
    while p.door.actor_state(handle) in ("PENDING_CREATION", "DEPENDENCIES_UNREADY") and not p.act.stopped \
            and p.slots.handle_of(slot, incarnation) is handle:
        if not waited and p.clock.now() - t0 >= PLACEMENT_NOTE_AFTER_S:
            waited = True
            p.log.emit(ev.Placement(slot=slot, incarnation=incarnation, edge="waiting",
                       reason="no node has room for it yet: the slot stays restarting"))
        await asyncio.sleep(PLACEMENT_POLL_S)
    if waited:
        p.log.emit(ev.Placement(slot=slot, incarnation=incarnation, edge="placed"))


async def bring_up(p: Parts, slot: int, incarnation: int) -> None:
    """One launch of ``incarnation`` of ``slot``, whatever asked for it (``fleet.control.reconcile`` runs each as
    a task), ended in ``settled``. When the slot's handle already is that incarnation (a restarted controller
    found it still starting, or a launch of it was lost) it is watched until it is up (``watch_start``); otherwise it is spawned and started
    (``launch``). A restart (the ledger counts ``restarts`` for the slot) first kills the previous incarnation
    and writes the ``restart`` records; it waits for Ray to place the actor without bound (``wait_placed``)."""
    attempt = p.slots.ledger.raw(slot).restarts
    found = p.slots.handle_of(slot, incarnation)
    try:
        if found is not None:
            out = await watch_start(p, slot, incarnation, found)
            if out is None:
                return  # replaced meanwhile: the slot's next launch settles it
            if attempt:  # the end of the restart the predecessor began
                p.log.emit(ev.Restart(slot=slot, incarnation=incarnation, edge="end", outcome=out.kind, adopted=True))
            what = "watched start"
        elif attempt:
            old = p.slots.handles.get(slot)
            if old is not None:
                p.door.kill(old[1])
            p.log.emit(ev.Restart(slot=slot, incarnation=incarnation, edge="begin", attempt=attempt))
            p.admission.forget(slot)
            out = await launch(p, slot, incarnation, wait_placement=True)
            p.log.emit(ev.Restart(slot=slot, incarnation=incarnation, edge="end", outcome=out.kind))
            what = f"restart {attempt}"
        else:
            out = await launch(p, slot, incarnation)
            what = "grow" if slot >= p.cfg.total_engines else "start"
    finally:
        if p.slots.launching.get(slot) is asyncio.current_task():
            del p.slots.launching[slot]
    settled(p, {slot: (incarnation, out)}, what)


async def watch_start(p: Parts, slot: int, incarnation: int, handle: Any) -> Outcome | None:
    """A shard whose launch is not this task's (a dead controller, or a launch that was lost, spawned it): its
    outcome once its engine is up, failed, or past the start bound; None when the slot was given another actor
    meanwhile. One still ``new`` never got its ``start`` (calls queued in a process that died are lost): it is
    started here."""
    bound = start_bound_s(p.cfg)
    deadline = p.clock.now() + bound
    while True:
        out = await p.door.call(handle, "describe", timeout=p.cfg.probe_timeout_s)
        state = out.value.state if out.ok else None  # a ``Description``
        if p.slots.handle_of(slot, incarnation) is not handle:
            return None
        if state == "new":
            p.log.emit(ev.Adopt(slot=slot, incarnation=incarnation, starting=True,
                       reason="its start call was lost (it died with the predecessor, or its launch ended): started again"))
            started = await p.door.call(handle, "start", timeout=bound)
            if started.ok:
                return started
            if p.clock.now() < deadline:
                continue  # someone else's start won the race: watch it
        if state == "ready":
            return out
        if state not in ("new", "starting") or p.clock.now() >= deadline:
            why = out.describe() if not out.ok else f"its engine is {state!r} after the start bound ({bound:g} s)"
            return Outcome(ERROR, error=RuntimeError(f"re-adopted while starting: {why[:300]}"))
        await asyncio.sleep(WATCH_POLL_S)


def settled(p: Parts, launched: dict[int, tuple[int, Outcome]], what: str) -> list[int]:
    """Launches that ended (slot -> (incarnation, outcome)), as one place says it for every launch (``bring_up``): each ready engine is noted (its native pause, its node) and decided ready, all in one decision, then its
    checkpoint load (it serves at once only while version 0 is committed; later it is stale and re-admitted at the
    committed version, ``health.readmit``); each failed one is condemned (``failed``). Returns the ready slots."""
    ready = [slot for slot, (_, out) in launched.items() if out.ok]
    for slot in ready:
        inc, out = launched[slot]
        p.slots.note_started(slot, inc, out.value)
    for slot, (inc, out) in launched.items():
        if not out.ok:
            failed(p, slot, inc, out, what)
    if ready:
        p.act.decide(Batch(tuple(EngineReady(s, launched[s][0]) for s in ready)))
        p.act.decide(Batch(tuple(CheckpointLoaded(s, launched[s][0]) for s in ready)))
    return ready


def record(p: Parts, slot: int, incarnation: int, out: Outcome, what: str) -> None:
    """One ``launch`` record: the slot, incarnation, what launched it, outcome, and the error if any."""
    row: dict[str, Any] = {"slot": slot, "incarnation": incarnation, "what": what, "outcome": out.kind}
    if not out.ok:
        row.update(error=out.describe()[:500], bound_s=watchdog_s(p.cfg))
    p.log.emit(ev.Launch(**row))


def failed(p: Parts, slot: int, incarnation: int, out: Outcome, what: str) -> None:
    """A launch of ``incarnation`` of ``slot`` that did not end ready: recorded, killed, condemned as dead (its
    restart budget is spent as for a death: restarted after its backoff, or retired)."""
    record(p, slot, incarnation, out, what)
    detail = f"{what} failed: {out.describe()[:300]}"
    d = p.act.decide(Observed(slot, incarnation, CallKind.START, FailureClass.DEAD, detail))
    if not any(isinstance(a, Evict) for a in d.actions):  # the slot moved on meanwhile: still kill only this one
        p.slots.kill(slot, incarnation, detail[:200])
