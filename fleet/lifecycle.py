"""The refit lifecycle: ``sync_weights(version)`` as the eight steps of DESIGN.md.

``RefitLifecycle.run`` reads like the design: close the gate, abort requests that
are too old, reconcile membership, pause the participants, transfer (classify,
rebuild, re-pause, retry exactly once), stamp the version, resume under one
shared deadline, reopen only with quorum. Every fan-out settles every call
before any result is acted on, and every call is bounded by
``refit_timeout_s + grace``.

Guarantee on failure: the gate stays closed, the controller halts (pending
requests are returned explicitly), and ``RefitFailed``/``FleetExhausted`` names
the shards and the phase. Engines that did not receive the complete new weights
keep their old version tag (or are fenced from serving when partial).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fleet.errors import CacheInvalidationUnsupported, FleetExhausted, FleetStopped, RefitFailed
from health import (
    AbortRefit,
    CallKind,
    KeepGateClosed,
    MembershipPlan,
    RefitReport,
    RefitResult,
    RefitStarted,
    StopExhausted,
    VersionCommitted,
    plan_membership,
)

from refit.synchronizer import retry_once

if TYPE_CHECKING:
    from fleet.controller import SingleController


class _Attempt:
    """One transfer attempt's results; ``ok`` drives the one-shot retry."""

    def __init__(self, number: int, plan: MembershipPlan, results: dict) -> None:
        self.number, self.plan, self.results = number, plan, results
        self.complete = {s for s, r in results.items() if r.result is RefitResult.COMPLETE}

    @property
    def ok(self) -> bool:
        return bool(self.plan.participants) and len(self.complete) == len(self.plan.participants)


class RefitLifecycle:
    def __init__(self, ctl: SingleController) -> None:
        self.ctl = ctl
        self.running = False
        self._lock = asyncio.Lock()
        self._phases: dict[str, float] = {}
        self._inside_s = 0.0
        self._version = 0

    async def run(self, version: int, source: Any) -> dict:
        async with self._lock:
            if self.ctl.stopped:
                raise FleetStopped(f"sync_weights({version}) refused: fleet stopped: {self.ctl.stopped}")
            self.running = True
            self._phases, self._inside_s, self._version = {}, 0.0, version
            t0 = time.monotonic()
            try:
                return await self._steps(version, source, t0)
            finally:
                self.running = False

    async def _steps(self, version: int, source: Any, t0: float) -> dict:
        ctl = self.ctl
        with self._phase("close"):
            self.close_gate(version)  # 1
        with self._phase("staleness"):
            aborted = await self.abort_too_old(version)  # 2
        with self._phase("reconcile"):
            plan = self.reconcile()  # 3
        with self._phase("pause"):
            plan, paused = await self.pause_settled(plan)  # 4
        with self._phase("transfer"):
            plan, complete, attempts = await self.transfer(plan, version, source, paused)  # 5
        with self._phase("stamp"):
            await self.stamp(plan, version, complete)  # 6
        with self._phase("resume"):
            await self.resume(plan, paused, complete)  # 7
        with self._phase("reopen"):
            self.reopen(version)  # 8
        total = time.monotonic() - t0
        return {
            "version": version,
            "epoch": plan.epoch,
            "participants": [p.slot for p in plan.participants],
            "complete": sorted(complete),
            "attempts": attempts,
            "aborted_for_staleness": aborted,
            "phases_s": dict(self._phases),
            "total_s": total,
            "inside_shards_s": self._inside_s,
            "overhead_s": max(0.0, total - self._inside_s),
            "serving": list(ctl.ledger.serving_slots()),
        }

    # ------------------------------------------------------------------ the steps
    def close_gate(self, version: int) -> None:
        """Step 1: close dispatch; new requests queue in the controller, nothing is dropped."""
        self.ctl.gate.close(f"refit of version {version}")
        self.ctl.metrics.gate(False, self.ctl.gate.version)
        self.ctl.decide(RefitStarted(version))

    async def abort_too_old(self, version: int) -> int:
        """Step 2: abort in-flight requests older than ``max_staleness`` versions; the dispatcher re-queues them."""
        limit = self.ctl.cfg.max_staleness
        if limit is None:
            return 0
        calls = {}
        for slot, reqs in self.ctl.dispatcher.outstanding.items():
            old = [rid for rid, (inc, v) in reqs.items() if version - v > limit and self.ctl.handle_of(slot, inc)]
            if old:
                inc = next(iter(reqs.values()))[0]
                calls[slot] = (self.ctl.handle_of(slot, inc), "abort", (old,), {})
        if calls:
            await self._fan_out(calls)
            self.ctl.log.emit("staleness_abort", version=version, requests=sum(len(c[2][0]) for c in calls.values()))
        return sum(len(c[2][0]) for c in calls.values())

    def reconcile(self) -> MembershipPlan:
        """Step 3: settle membership from the ledger; a changed participant set is a new epoch."""
        old = self.ctl.plan
        plan = plan_membership(self.ctl.ledger, old)
        if plan.epoch != old.epoch:
            self.ctl.log.emit(
                "epoch", epoch=plan.epoch, previous=old.epoch,
                participants=[(p.slot, p.incarnation, p.rank) for p in plan.participants],
            )
        self.ctl.plan = plan
        if not plan.participants:
            self._stop_sync(f"refit of version {self._version}: no live engine to take part")
        return plan

    async def pause(self, plan: MembershipPlan) -> set[int]:
        """Step 4: pause every participant (keep in-flight requests); all pause calls settle first."""
        clear_cache = self._clear_cache(plan)
        targets = {p.slot: p for p in plan.participants}
        if clear_cache:
            await self._invalidate_without_native_pause(targets)
        outs = await self._fan_out(
            {s: (self._handle(p), "pause", (), {"mode": "keep", "clear_cache": clear_cache}) for s, p in targets.items()},
            expect_ack=True,
        )
        paused: set[int] = set()
        aborts = []
        for slot, out in outs.items():
            d = self.ctl.decide(self._observed(targets[slot], CallKind.PAUSE, out))
            aborts += [a for a in d.actions if isinstance(a, AbortRefit)]
            if out.ok:
                paused.add(slot)
        if aborts:
            await self._stop(aborts[0].message, paused)
        return paused

    async def pause_settled(self, plan: MembershipPlan) -> tuple[MembershipPlan, set[int]]:
        """Pause until the plan's participants are exactly the paused, live engines.

        A participant that died while pausing leaves the plan (a new epoch without
        it); an engine that became ready meanwhile joins it and is paused too.
        """
        paused = await self.pause(plan)
        for _ in range(3):
            fresh = self.reconcile()
            members = {p.slot for p in fresh.participants}
            if members <= paused:
                return fresh, paused & members
            paused = (paused & members) | await self.pause(fresh)
            plan = fresh
        return plan, paused

    async def transfer(self, plan: MembershipPlan, version: int, source: Any, paused: set[int]):
        """Step 5: transfer; on failure classify, rebuild without the dead, re-pause, retry exactly once."""
        current = {"plan": plan}

        async def attempt(n: int) -> _Attempt:
            if n == 2:
                previous = current["plan"]
                failed = [p for p in previous.participants if p.slot not in self._last.complete]
                self.ctl.log.emit("refit_failed_attempt", version=version, attempt=1,
                                  failed={p.slot: self._last.results[p.slot].detail[:200] for p in failed})
                await self._classify_failed(failed)
                # Re-pause every retry participant, engines that restarted meanwhile included.
                current["plan"], again = await self.pause_settled(self.reconcile())
                paused.intersection_update(again)
                paused.update(again)
            results = await self._transfer_once(current["plan"], version, source, rebuild=n > 1)
            self._last = _Attempt(n, current["plan"], results)
            return self._last

        final = await retry_once(attempt)
        return final.plan, final.complete, final.number

    async def stamp(self, plan: MembershipPlan, version: int, complete: set[int]) -> None:
        """Step 6: commit the version in the ledger and stamp it on every engine that holds it."""
        if not complete:
            return
        self.ctl.decide(VersionCommitted(version))
        parts = [p for p in plan.participants if p.slot in complete]
        outs = await self._fan_out(
            {p.slot: (self._handle(p), "set_weight_version", (version,), {}) for p in parts}, expect_ack=True
        )
        for p in parts:
            if not outs[p.slot].ok:
                self.ctl.decide(self._observed(p, CallKind.REFIT, outs[p.slot]))
        stamped = [p for p in parts if outs[p.slot].ok]
        self.ctl.log.emit("stamp", version=version, members=[[p.slot, p.incarnation] for p in stamped])

    async def resume(self, plan: MembershipPlan, paused: set[int], complete: set[int]) -> None:
        """Step 7: resume every paused participant under one shared deadline; never retries the transfer.

        Requests held on an engine that did not get the new weights completely are
        aborted first (the dispatcher re-sends them to a serving engine).
        """
        parts = [p for p in plan.participants if p.slot in paused]
        stale = {p.slot: p for p in parts if p.slot not in complete and self.ctl.dispatcher.in_flight_on(p.slot)}
        if stale:
            await self._fan_out(
                {s: (self._handle(p), "abort", (list(self.ctl.dispatcher.in_flight_on(s)),), {}) for s, p in stale.items()}
            )
        outs = await self._fan_out({p.slot: (self._handle(p), "resume", (), {}) for p in parts}, expect_ack=True)
        aborts = []
        for p in parts:
            d = self.ctl.decide(self._observed(p, CallKind.RESUME, outs[p.slot]))
            aborts += [a for a in d.actions if isinstance(a, AbortRefit)]
        if aborts:
            await self._stop(aborts[0].message, set())

    def reopen(self, version: int) -> None:
        """Step 8: reopen the gate only if quorum serves ``version``; else stop with it closed."""
        d = self.ctl.finish_refit(version)
        if self.ctl.gate.is_open:
            return
        stop = next((a for a in d.actions if isinstance(a, (StopExhausted, KeepGateClosed))), None)
        message = stop.message if stop is not None else d.reason
        self.ctl.halt(message)
        raise (FleetExhausted if isinstance(stop, StopExhausted) else RefitFailed)(message)

    # ------------------------------------------------------------------ helpers
    def _clear_cache(self, plan: MembershipPlan) -> bool:
        policy = self.ctl.cfg.kv_policy
        if policy == "recompute":
            return True
        drained = not any(self.ctl.dispatcher.in_flight_on(p.slot) for p in plan.participants)
        if policy == "keep":
            if drained:
                return True  # free: nothing in flight, so invalidate the prefix cache anyway
            if self.ctl.cfg.engine.enable_prefix_caching:
                self.ctl.warn_keep_once(
                    "kv_policy='keep' with requests in flight during a refit: later requests may reuse "
                    "prefix-cache blocks computed by the old weights (use 'recompute' or 'salt' to avoid this)"
                )
        return False

    async def _invalidate_without_native_pause(self, targets: dict) -> None:
        """A backend without native pause must confirm an equivalent cache invalidation, or the refit stops."""
        emulated = {s: p for s, p in targets.items() if not self.ctl.native_pause.get(s, True)}
        if not emulated:
            return
        outs = await self._fan_out({s: (self._handle(p), "invalidate_cache", (), {}) for s, p in emulated.items()},
                                   expect_ack=True)
        failed = sorted(s for s, o in outs.items() if not o.ok)
        if failed:
            message = (
                f"kv_policy={self.ctl.cfg.kv_policy!r} needs the KV cache cleared at pause, but slot(s) {failed} "
                f"have no native pause and did not confirm a cache invalidation "
                f"({'; '.join(outs[s].describe() for s in failed)})"
            )
            self.ctl.finish_refit(self._version)
            self.ctl.halt(message)
            raise CacheInvalidationUnsupported(message)

    async def _transfer_once(self, plan: MembershipPlan, version: int, source: Any, rebuild: bool) -> dict:
        participants = [(p, self._handle(p)) for p in plan.participants]
        t0 = time.monotonic()
        results = await self.ctl.transfer_port().transfer(
            participants, version, plan.epoch, source, rebuild=rebuild, timeout=self.ctl.cfg.lifecycle_deadline_s
        )
        self._inside_s += time.monotonic() - t0
        for p in plan.participants:
            r = results[p.slot]
            self.ctl.decide(RefitReport(p.slot, p.incarnation, version, r.result, r.detail[:300]))
        return results

    async def _classify_failed(self, failed) -> None:
        """Find out why participants failed: dead, hung, or alive (a survivor of someone else's failure)."""
        outs = await self._fan_out(
            {p.slot: (self._handle(p), "ping", (), {}) for p in failed}, timeout=self.ctl.cfg.probe_timeout_s
        )
        for p in failed:
            out = outs[p.slot]
            if not out.ok:
                await self.ctl.report_failure(p.slot, p.incarnation, out, CallKind.REFIT)

    async def _stop(self, message: str, paused: set[int]) -> None:
        """An unrecovered failure: close out the refit, halt with the gate closed, return held requests."""
        self.ctl.finish_refit(self._version)
        self.ctl.halt(message)
        live = {s: (h, "pause", (), {"mode": "abort"}) for s, (_, h) in self.ctl.handles.items()}
        await self.ctl.door.fan_out(live, timeout=self.ctl.cfg.probe_timeout_s, expect_ack=True)
        await self.ctl.dispatcher.notify_room()
        raise RefitFailed(message)

    def _stop_sync(self, message: str) -> None:
        self.ctl.finish_refit(self._version)
        self.ctl.halt(message)
        raise FleetExhausted(message)

    async def _fan_out(self, calls: dict, expect_ack: bool = False, timeout: float | None = None) -> dict:
        if not calls:
            return {}
        t0 = time.monotonic()
        outs = await self.ctl.door.fan_out(
            calls, timeout=timeout or self.ctl.cfg.lifecycle_deadline_s, expect_ack=expect_ack
        )
        self._inside_s += time.monotonic() - t0  # the shards' calls, RPC round trips included
        return outs

    def _handle(self, p):
        return self.ctl.handles[p.slot][1]

    def _observed(self, p, call: CallKind, out):
        from fleet.controller import observed

        if out.kind == "died":
            self.ctl.door.kill(self._handle(p))
        return observed(p.slot, p.incarnation, call, out)

    @contextmanager
    def _phase(self, name: str):
        t0 = time.monotonic()
        self.ctl.log.emit("phase", phase=name, edge="begin", version=self._version)
        try:
            yield
        finally:
            dt = time.monotonic() - t0
            self._phases[name] = dt
            self.ctl.metrics.phase(name, dt)
            self.ctl.log.emit("phase", phase=name, edge="end", version=self._version, seconds=round(dt, 6))
