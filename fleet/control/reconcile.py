"""Reconcile: the fleet toward its target, one level-triggered step.

The target is what the controller decided, held by the health ledger: every slot that is not retired runs the
incarnation the ledger names for it (``Ledger.raw(slot).incarnation``: the start's, a restart's, a slot a resize
added, the one a restarted controller's intent recorded) and holds the committed version; a slot a resize
removed runs nothing (``Slots.remove`` cancels its launch). What is: the handles (``Slots.handles``), the
launches under way (``Slots.launching``), the re-admissions under way (``Readmissions``). ``Reconciler`` closes
the gap:

- ``launch_missing``: each slot whose incarnation is launching (``SlotPhase.LAUNCHING``) with no launch under
  way gets one task (``fleet.control.launch.bring_up``): spawned and started or, when the slot's handle already
  is that incarnation (re-adoption found it still starting), watched until it is up. The task is registered in
  the same turn as the check, so no incarnation is launched twice. Every launch, whatever asked for it (the
  start, a restart the health core decided, a grow, re-adoption), goes through here and ends in
  ``launch.settled``.
- ``step`` (the health-timer loop, every ``TIMER_INTERVAL_S``): a health ``Tick`` when one of the ledger's
  timers is due (a restart's back-off ran out, an engine overdue in a refit) or a stale engine may be
  re-admitted at the committed version (``health.readmit.due``; the tick's ``Readmit`` actions start the copies,
  ``fleet.control.readmission``); then ``launch_missing``, so a launch that was lost is made again; then, unless
  a refit or resize holds the lifecycle lock, ``retire_removed``: an engine still held for a slot a resize
  removed (the resize was cut before its drain ended) is killed and let go.
- ``land``: the committed version landed on exactly the engines named, as one complete refit (the checkpoint
  every engine loaded at the start; the engines a restarted controller found holding the committed version);
  the gate opens only with quorum where asked.

Nothing is launched while the fleet is stopped, while a restarted controller is still re-adopting (its ledger
is not settled: ``fleet.control.recovery`` asks ``launch_missing`` itself at the end), or as a restart while
``restart_dead_engines`` is off.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Iterator

from rlfleet.fleet.control.launch import bring_up
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.resize import forget_removed
from rlfleet.health import Batch, RefitFinished, RefitReport, RefitResult, RefitStarted, SlotPhase, Tick, VersionCommitted
from rlfleet.health.readmit import due as readmit_due


class Reconciler:
    def __init__(self, p: Parts, busy: Callable[[], bool] = lambda: False) -> None:
        self.p = p
        self._busy = busy  # a refit or a resize holds the lifecycle lock (a shrink drains what it removed)
        self._held = 0  # > 0 while a restarted controller re-adopts: its ledger is not settled yet

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No launch starts inside (re-adoption rebuilds the ledger, then asks ``launch_missing`` itself)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def launch_missing(self) -> dict[int, asyncio.Task]:
        """Start a launch task for every launching slot that has none; slot -> its task (new or under way)."""
        p = self.p
        launching = p.slots.launching
        if p.act.stopped or self._held:
            return dict(launching)
        ledger = p.slots.ledger
        for slot in sorted(ledger.slots_in(SlotPhase.LAUNCHING)):
            if slot in launching:
                continue
            rec = ledger.raw(slot)
            if rec.restarts and not p.cfg.restart_dead_engines and p.slots.handle_of(slot, rec.incarnation) is None:
                continue  # a death is not relaunched: the slot stays restarting
            launching[slot] = p.act.in_background(bring_up(p, slot, rec.incarnation))
        return dict(launching)

    async def launched(self, slots) -> None:
        """Launch what is missing and wait until the launches of ``slots`` settled (each ends in ``settled``)."""
        wanted = set(slots)
        tasks = [t for s, t in self.launch_missing().items() if s in wanted]
        if tasks:
            await asyncio.wait(tasks)

    async def step(self) -> None:
        """The level-triggered step: a ``Tick`` when a timer is due or a stale engine may be re-admitted, then
        ``launch_missing``."""
        p = self.p
        now = p.clock.now()
        wake = p.slots.ledger.next_wake_at()
        if (wake is not None and now >= wake) or self._readmit_due(now):
            p.act.decide(Tick())
        self.launch_missing()
        if not self._busy():
            self.retire_removed()

    def retire_removed(self) -> None:
        """A slot a resize removed whose engine is still held (the resize was cut before its drain ended): the
        engine is killed and let go (its clients re-send what it ran)."""
        p = self.p
        for slot in sorted(p.slots.ledger.removed_slots()):
            held = p.slots.handles.get(slot)
            if held is not None:
                forget_removed(p, slot, held[0], "removed by a resize whose drain never ended: retired by the reconcile")

    def _readmit_due(self, now: float) -> bool:
        """An engine's re-admission may start (``health.readmit.due``) and none runs for it yet."""
        p = self.p
        if not p.cfg.readmit or p.act.stopped:
            return False
        return any(key not in p.readmissions.running for key in readmit_due(p.slots.ledger, now))

    def land(self, version: int, landed: dict[int, int], detail: str, hold_without_quorum: bool) -> None:
        """``version`` committed as one complete refit on exactly ``landed`` (slot -> incarnation); the gate
        opens (only with quorum when ``hold_without_quorum``)."""
        act = self.p.act
        act.decide(RefitStarted(version))
        act.decide(Batch(tuple(RefitReport(slot, inc, version, RefitResult.COMPLETE, detail)
                               for slot, inc in sorted(landed.items()))))
        act.decide(VersionCommitted(version))
        act.decide(RefitFinished(version, hold_without_quorum=hold_without_quorum))  # an OpenGate in it opens the gate
