"""``RoutingPublisher``: the controller's routing state, published to clients and told to shards.

Any change the controller makes (gate, committed version, serving set, caps, stop)
marks the state dirty; one publication then computes the new ``RoutingState`` and,
only if a client would see a difference, gives it the next epoch. Order matters and
is fixed here: a shard joining the serving set is told so (``set_route``, awaited, with the term of
its lease on what it is told: ``fleet.shard.lease``) before any client can route to it; a shard leaving
it is told without waiting (its requests are refused from then on; clients stop routing to it with the
new state), and told again until it acknowledges (bounded, logged as ``leave_notice``).
Clients follow with a long poll (``wait_newer``); nothing here sees a request. Each
publication is one ``routing`` record in the event log (its ``members`` only when they
changed).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.data.routing_state import Member, RoutingState
from rlfleet.health import CallKind
from rlfleet.fleet import records as ev


# A leave notice not acknowledged is sent again, this many times in all (``probe_interval_s`` apart).
LEAVE_NOTICE_ATTEMPTS = 10


class RoutingPublisher:
    def __init__(self, parts: Parts, holding: Callable[[], bool]) -> None:
        """``holding()``: a refit holds the gate closed now (``RefitLifecycle.holding``)."""
        self.p = parts
        self._holding = holding
        self.current = RoutingState(epoch=0, gate_open=False, version=0, reason="not started")
        self.refit_epoch = 0  # the epoch at which the last refit closed the gate
        self._told: dict[tuple[int, int], bool] = {}  # (slot, incarnation) -> told it is a member
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Condition | None = None
        self._scheduled = False
        self._dirty = True
        self._key: tuple | None = None
        self._cached: tuple = ((), ())

    def start_above(self, epoch: int) -> None:
        """A restarted controller: every epoch published from now on is above ``epoch`` (above all its
        predecessor's), so clients adopt the new states and shards raise their floors to them."""
        self.current = dataclasses.replace(self.current, epoch=max(self.current.epoch, int(epoch)))
        self._dirty = True

    def _sync(self) -> tuple[asyncio.Lock, asyncio.Condition]:
        if self._lock is None:
            self._lock, self._changed = asyncio.Lock(), asyncio.Condition()
        assert self._changed is not None  # made with the lock
        return self._lock, self._changed

    def mark_dirty(self) -> None:
        """Something clients follow may have changed: publish soon (once, however many changes).

        Not while a refit holds the gate closed: it is closed (published at once by ``close_now``), and the
        lifecycle publishes when it ends, so slots passing through ``stale`` mid-refit are never
        published as leaving and told so, only to rejoin a moment later."""
        self._dirty = True
        if self._scheduled or self._holding():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet (construction): start() publishes
        self._scheduled = True
        loop.call_soon(self._publish_soon)

    def close_now(self, reason: str) -> None:
        """The gate closed: publish that at once (closing only takes capacity away, so no shard has to
        agree first), then fence the members so work routed before it is refused. A refit fences its
        own shards (``begin_refit``)."""
        if not self.current.gate_open:
            return
        self.current = dataclasses.replace(self.current, epoch=self.current.epoch + 1, gate_open=False, reason=reason)
        self.p.log.emit(ev.Routing(epoch=self.current.epoch, gate_open=False, version=self.current.version,
                          stopped=bool(self.p.act.stopped)))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.p.act.in_background(self._closed(self.current.epoch, fence=not self._holding()))

    async def _closed(self, epoch: int, fence: bool) -> None:
        _, changed = self._sync()
        async with changed:
            changed.notify_all()
        if fence:
            live = self.p.slots.live_handles()
            await self.p.door.fan_out({s: (h, "fence", (epoch,), {}) for s, (_, h) in live.items()},
                                        timeout=self.p.cfg.probe_timeout_s)

    def _publish_soon(self) -> None:
        self._scheduled = False
        self.p.act.in_background(self.publish())

    def _members_and_caps(self) -> tuple[tuple[Member, ...], tuple[tuple[int, int], ...]]:
        """The serving set and its caps, rebuilt only when the ledger's serving set, the roles, a handle or
        a cap changed (a refit publishes twice: at 32 shards rebuilding them was a third of its own cost).
        The serving set is compared by its slots: a refit takes every slot out of it and puts them back,
        and the same members then stay the same tuple (nobody joined or left: nothing to tell the shards)."""
        serving, handles_rev, caps_rev = self.p.slots.ledger.serving_slots(), self.p.slots.revision, self.p.admission.revision
        key = self._key
        if key is None or key[0] != serving or key[3] is not self.p.slots.roles or key[1:3] != (handles_rev, caps_rev):
            members = tuple(Member(s, inc, h) for s, inc, h in self.p.slots.serving())
            caps = tuple(sorted(self.p.admission.caps([m.slot for m in members]).items()))
            self._key, self._cached = (serving, handles_rev, caps_rev, self.p.slots.roles), (members, caps)
        return self._cached

    def _view(self) -> RoutingState:
        members, caps = self._members_and_caps()
        return RoutingState(
            epoch=self.current.epoch,
            gate_open=self.p.gate.is_open and not self.p.act.stopped,
            version=self.p.gate.version,
            members=() if self.p.act.stopped else members,  # while closed: who will serve when it reopens
            caps=caps,
            stopped=self.p.act.stopped,
            reason=self.p.gate.reason,
        )

    async def publish(self) -> RoutingState:
        """Publish the controller's current view if it differs from the last one; returns the current state."""
        lock, changed = self._sync()
        async with lock:
            if not self._dirty and self.current.epoch > 0:
                return self.current
            self._dirty = False
            view = self._view()
            if view.same_view(self.current) and self.current.epoch > 0:
                return self.current
            epoch = self.current.epoch + 1
            same = view.members is self.current.members  # the cached tuple: no one joins or leaves
            members = view.members if same else await self._tell_shards(view, epoch)
            self.current = RoutingState(epoch, view.gate_open, view.version, members, view.caps, view.stopped,
                                        view.reason)
            changed_members: dict[str, Any] = {} if same else {"members": [[m.slot, m.incarnation] for m in members]}
            self.p.log.emit(ev.Routing(epoch=epoch, gate_open=view.gate_open, version=view.version,
                              stopped=bool(view.stopped), **changed_members))
        async with changed:
            changed.notify_all()
        return self.current

    async def _tell_shards(self, view: RoutingState, epoch: int) -> tuple[Member, ...]:
        """Tell joiners (awaited) and leavers (not awaited); a joiner that does not confirm is left out."""
        joining = {(m.slot, m.incarnation): m for m in view.members if not self._told.get((m.slot, m.incarnation))}
        keys = {(m.slot, m.incarnation) for m in view.members}
        leaving = [k for k, told in self._told.items() if told and k not in keys]
        for key in leaving:
            self._told[key] = False
            if self.p.slots.handle_of(*key) is not None:
                self.p.act.in_background(self._tell_leaving(key, epoch, view.version))
        for key in [k for k in self._told if self.p.slots.handle_of(*k) is None]:
            del self._told[key]  # replaced or gone: nothing more to tell it
        if not joining:
            return view.members
        outs = await self.p.door.fan_out(
            {k: (m.handle, "set_route", (epoch, True, view.version, self.p.cfg.routing_lease_s), {})
             for k, m in joining.items()},
            timeout=self.p.cfg.probe_timeout_s, expect_ack=True,
        )
        refused = set()
        for key, out in outs.items():
            if out.ok:
                self._told[key] = True
            else:
                refused.add(key)
                self.p.act.observe(key[0], key[1], CallKind.PROBE, out)
        return tuple(m for m in view.members if (m.slot, m.incarnation) not in refused)

    async def _tell_leaving(self, key: tuple[int, int], epoch: int, version: int) -> None:
        """Tell ``key`` (slot, incarnation) it left the serving set at ``epoch``, again until it acknowledges
        (up to ``LEAVE_NOTICE_ATTEMPTS``, ``probe_interval_s`` apart, each bounded by ``probe_timeout_s``);
        stops once it is replaced, gone or told it rejoined. One ``leave_notice`` record says how it ended.
        Not waited for: clients stop routing to it with the new state, and a refit fences it anyway."""
        attempts, out = 0, None
        while attempts < LEAVE_NOTICE_ATTEMPTS:
            handle = self.p.slots.handle_of(*key)
            if handle is None or self._told.get(key) is not False:
                break
            if attempts:
                await asyncio.sleep(self.p.cfg.probe_interval_s)
            attempts += 1
            out = await self.p.door.call(handle, "set_route", epoch, False, version,
                                      timeout=self.p.cfg.probe_timeout_s, expect_ack=True)
            if out.ok:
                break
        self.p.log.emit(ev.LeaveNotice(slot=key[0], incarnation=key[1], epoch=epoch, attempts=attempts,
                    acknowledged=out is not None and out.ok,
                    outcome=None if out is None or out.ok else out.describe()[:200]))

    async def fence_for_refit(self) -> int:
        """Publish the closed gate of a refit that begins; returns its epoch (shards fence below it)."""
        state = await self.publish()
        self.refit_epoch = state.epoch
        return state.epoch

    async def wait_newer(self, after_epoch: int, timeout: float) -> RoutingState:
        """The state once its epoch is past ``after_epoch``, or the current one after ``timeout`` s."""
        _, changed = self._sync()
        if self.current.epoch > after_epoch:
            return self.current
        try:
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: self.current.epoch > after_epoch), timeout)
        except asyncio.TimeoutError:
            pass
        return self.current
