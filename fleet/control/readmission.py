"""Carry out the health core's ``Readmit``: bring a stale engine to the committed version from a live donor.

The health core decides who is stale and when to try (``health.readmit``: level-triggered, backed off
after failures, evicted after repeated ones of the engine's own); this module only does it, one copy per
incarnation at a time:

1. pick donors: the serving engines that hold the committed version, in slot order;
2. copy the weights donor -> engine (``fleet.control.peer_copy``: layouts compared first, both ends of the
   transfer started at once, under one deadline) and compare the digests of both engines' parameters;
3. stamp the engine with the committed version (``set_weight_version``), then decide ``Readmitted``: the
   health core puts it in the serving set. The committed version does not change, no other engine pauses,
   the donor keeps serving (the copy runs between its engine steps).

A donor that fails (it died, its layout differs, it timed out) is the donor's fault: the next donor is
tried (the end record names each that failed, ``tried``), and with none left the failure is reported as not the engine's (``its_fault=False``). A failed
receive, load, digest comparison or stamp is the engine's own (``ReadmitFailed(its_fault=True)``).

A refit wins: before its gate closes it calls ``yield_to_refit``, which cancels every copy and waits for
each to end (``yielded``); the refit then includes or excludes the engine by its state, and a transfer of
the full update overwrites whatever a cut copy left. A re-admission never starts while a refit or a resize
holds the lifecycle lock. Calls to one shard run in the order they were sent, so a stamp sent before the
refit's first call lands before it. A controller that dies mid-copy leaves the engine stale: its
successor's first tick asks again.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.peer_copy import copy_weights
from rlfleet.health import Readmit, ReadmitFailed, Readmitted


class Readmissions:
    def __init__(self, parts: Parts, busy: Callable[[], bool]) -> None:
        self.p = parts
        self._busy = busy  # a refit or a resize holds the lifecycle lock
        self.running: dict[tuple[int, int], asyncio.Task] = {}
        self.ended: list[dict] = []  # each re-admission's end, for ``status`` and the benchmark

    def want(self, action: Readmit) -> None:
        """Start ``action`` unless one runs for that incarnation, the fleet stopped, or a refit or resize runs."""
        key = (action.slot, action.incarnation)
        if key in self.running or self.p.act.stopped or self._busy() or not self.p.cfg.readmit:
            return
        task = self.p.act.in_background(self._run(action))
        self.running[key] = task
        task.add_done_callback(lambda _t: self.running.pop(key, None))

    async def yield_to_refit(self) -> None:
        """A refit begins: every copy is cancelled, and has ended when this returns."""
        tasks = list(self.running.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _donors(self, a: Readmit) -> list[tuple[int, Any]]:
        ledger = self.p.slots.ledger
        handles = self.p.slots.handles
        holding = [s for s in ledger.serving_slots() if s != a.slot and s in handles]
        return [(s, handles[s][1]) for s in sorted(holding)]

    async def _run(self, a: Readmit) -> None:
        t0 = self.p.clock.now()
        handle = self.p.slots.handle_of(a.slot, a.incarnation)
        if handle is None:
            return
        donors = self._donors(a)
        self.p.log.emit(ev.Readmit(slot=a.slot, incarnation=a.incarnation, version=a.version, edge="begin",
                                   donor=", ".join(f"slot {s}" for s, _ in donors[:1]) or None))
        end: dict[str, Any] = {"slot": a.slot, "incarnation": a.incarnation, "version": a.version}
        try:
            done = None
            tried: list[str] = []
            for slot, donor in donors:
                got = await copy_weights(self.p.door, donor, handle, a.version, self.p.cfg.readmit_timeout_s)
                if got.ok:
                    done = (slot, got)
                    break
                tried.append(f"slot {slot}: {got.detail[:300]}")
                end["tried"] = list(tried)  # the end record names every donor that failed before it
                if got.its_fault:
                    return self._failed(a, t0, end, got.detail, True, f"slot {slot}")
            if done is None:
                why = "; ".join(tried) or "no engine serves the committed version"
                return self._failed(a, t0, end, f"no donor could give the weights ({why})", False, None)
            slot, got = done
            stamped = await self.p.door.call(handle, "set_weight_version", a.version, timeout=self.p.cfg.probe_timeout_s)
            if not (stamped.ok and stamped.value is True):
                return self._failed(a, t0, end, f"the stamp failed: {stamped.describe()[:200]}", True, f"slot {slot}")
            self.p.act.decide(Readmitted(a.slot, a.incarnation, a.version, f"slot {slot}"))
            end.update(outcome="readmitted", donor=f"slot {slot}", seconds=round(self.p.clock.now() - t0, 6),
                       bytes=got.bytes, digests=got.digests, donor_held_s=round(got.held_s, 6))
            self.p.log.emit(ev.Readmit(edge="end", **end))
            self.ended.append(end)
        except asyncio.CancelledError:
            end.update(outcome="yielded", seconds=round(self.p.clock.now() - t0, 6))
            self.p.log.emit(ev.Readmit(edge="end", error="a refit began: the copy yielded", **end))
            self.ended.append(end)
            raise

    def _failed(self, a: Readmit, t0: float, end: dict, detail: str, its_fault: bool, donor: str | None) -> None:
        self.p.act.decide(ReadmitFailed(a.slot, a.incarnation, detail[:500], its_fault))
        end.update(outcome="failed", donor=donor, seconds=round(self.p.clock.now() - t0, 6))
        self.p.log.emit(ev.Readmit(edge="end", error=detail[:500], **end))
        self.ended.append({**end, "error": detail[:500], "its_fault": its_fault})
