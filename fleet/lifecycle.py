"""The refit lifecycle: ``sync_weights(version)`` as the eight steps of DESIGN.md.

Under ``stage_ahead`` a step 0 comes first, with the gate open: the update moves into
every live engine's staging area while the fleet serves (``stage_ahead``); step 5 is
then only the apply of what each paused engine staged. A failure while staging never
closes the gate: the refit is refused (``RefitRefused``, ``RefitNotStaged``) and the
fleet serves what it had.

``RefitLifecycle.run`` reads like the design: close the gate, abort requests that
are too old, reconcile membership, pause the participants, transfer (classify,
rebuild, re-pause, retry exactly once), stamp the version, resume under one
shared deadline, reopen only with quorum. Every fan-out settles every call
before any result is acted on, and every call is bounded by
``refit_timeout_s + grace``.

Guarantee on failure: arguments are checked before anything changes (a version
that does not increase, a source that is not a sender: refused, nothing touched).
After that, a refit ends in exactly one of three ways: committed and reopened;
rolled back (nothing reached any engine: paused engines resumed on the committed
version, gate reopened on it, the caller's error raised); or stopped (``_end``:
gate closed, held requests returned, ``RefitFailed``/``FleetExhausted`` naming the
shards and the phase). Never engines paused with the gate closed and the fleet
"not stopped". Engines that did not receive the complete new weights keep their
old version tag (or are fenced from serving when partial).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import Any

from fleet.intent import CLOSING, COMMITTED, RefitIntent
from fleet.errors import CacheInvalidationUnsupported, FleetExhausted, FleetStopped, RefitFailed, RefitNotStaged, RefitRefused
from fleet.outcome import OK
from fleet.weights import TransferResult
from health import (
    AbortRefit,
    Batch,
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

PHASES = ("close", "staleness", "reconcile", "pause", "transfer", "stamp", "resume", "reopen")


class _RollBack(Exception):
    """Raised inside a step when nothing reached any engine and the refit must not go on
    (e.g. the update itself was refused); ``run`` rolls back and raises ``error`` to the caller."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _EndRefit(Exception):
    """Raised inside a step to end the refit without reopening; ``RefitLifecycle.run`` handles it in one place."""

    def __init__(self, error: type[FleetStopped], message: str) -> None:
        super().__init__(message)
        self.error, self.message = error, message


class RefitLifecycle:
    """The refit of one version at a time, for the controller ``ctl`` (a ``SingleController``).

    Reads from the controller its door, ledger, handles, dispatcher, gate, log and
    clock; decides nothing about health itself (``ctl.observe``/``ctl.decide`` do).
    """

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl
        self.running = False
        self.holding = False  # the refit holds the gate closed (from ``close`` on); while it stages, the fleet serves
        self.phase: str | None = None  # the step running now (``stage`` or one of ``PHASES``)
        self._lock = asyncio.Lock()
        self._phases: dict[str, float] = {}
        self._inside_s = 0.0
        self._inside_cpu_s = 0.0  # this thread's CPU time during those calls (its own share of them)
        self._version = 0
        self._finished = False
        self._moving = False  # the transfer began: engines may hold bytes of the new version
        self._held: dict[tuple[int, int], Any] = {}  # (slot, incarnation) -> handle a pause was sent to by this refit
        self._busy: dict[int, int] = {}  # slot -> requests in flight when the refit fenced it

    @property
    def lock(self) -> asyncio.Lock:
        """Held for the whole of a refit; a resize (``fleet.resize``) holds it too, so the two never interleave."""
        return self._lock

    async def run(self, version: int, source: Any) -> dict:
        """The eight steps. One refit at a time: a second call waits, then is checked against
        the version the first committed. Ends committed, rolled back or stopped (module docstring)."""
        async with self._lock:
            if self.ctl.stopped:
                raise FleetStopped(f"sync_weights({version!r}) refused: fleet stopped: {self.ctl.stopped}")
            self.ctl.check_refit(version, source)  # raises before any state changes
            self.running = True
            self._phases, self._inside_s, self._inside_cpu_s, self._version = {}, 0.0, 0.0, version
            self._finished, self._moving, self._held, self._busy = False, False, {}, {}
            t0, cpu0 = self.ctl.clock.now(), time.thread_time()
            try:
                return await self._steps(version, source, t0, cpu0)
            except _EndRefit as end:
                await self._end(end.error, end.message)
            except _RollBack as back:
                await self._roll_back(f"{type(back.error).__name__}: {back.error}")
                raise back.error from None
            except Exception as exc:  # noqa: BLE001 - an unexpected error still ends the refit in one of the two ways
                what = f"{type(exc).__name__}: {exc}"
                if self._moving:
                    await self._end(RefitFailed, f"refit of version {version} failed during the transfer or after: {what}", exc)
                await self._roll_back(what)
                raise
            finally:
                if self.holding:
                    self.ctl.admission.refit_finished(self.ctl.clock.now())
                self.running = self.holding = False
                if self.ctl.intent.current is not None and self.ctl.intent.current.refit is not None \
                        and self.ctl.intent.current.refit.phase != COMMITTED:
                    # ended without a commit; a committed refit's record stays until the next one begins (a
                    # successor re-stamps its engines, and a re-sent call for it returns its summary)
                    self.ctl.intent.update(refit=None, membership_epoch=self.ctl.plan.epoch)
            raise AssertionError("unreachable: every failure path raises")

    async def _steps(self, version: int, source: Any, t0: float, cpu0: float) -> dict:
        ctl = self.ctl
        staged = None
        if ctl.cfg.stage_ahead:
            with self._phase("stage"):
                staged = await self.stage_ahead(version, source)  # 0: the bytes move while the fleet serves
        with self._phase("close"):
            epoch = await self.close_gate(version)  # 1
        with self._phase("staleness"):
            aborted = await self.fence_and_abort_too_old(version, epoch)  # 2
        with self._phase("reconcile"):
            plan = self.reconcile()  # 3
        with self._phase("pause"):
            plan, paused = await self.pause_settled(plan)  # 4
        with self._phase("transfer"):
            self._moving = True
            if staged is None:
                plan, paused, complete, attempts = await self.transfer(plan, version, source, paused)  # 5
            else:
                complete, attempts = await self.apply_staged(plan, version, paused, staged), 1  # 5: the apply only
        with self._phase("stamp"):
            await self.stamp(plan, version, complete)  # 6
        with self._phase("resume"):
            await self.resume(plan, paused, complete)  # 7
        with self._phase("reopen"):
            await self.reopen(version)  # 8
        total = self.ctl.clock.now() - t0
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
            # the controller's own CPU outside the shards' calls: what ``overhead_s`` is made of, less the waits
            # (the intent's store, the OS scheduling this process), which depend on the machine more than on rlfleet
            "controller_cpu_s": max(0.0, time.thread_time() - cpu0 - self._inside_cpu_s),
            "serving": ctl.serving_slots(),  # spares hold the version too, but serve nothing
            "routing_epoch": ctl.publisher.current.epoch,  # clients routing on it (or later) see this refit
        }

    # ------------------------------------------------------------------ the steps
    async def stage_ahead(self, version: int, source: Any) -> set[tuple[int, int]]:
        """Step 0, under ``stage_ahead``: with the gate open and every engine serving, move the update into
        the staging area of every live engine; on failure classify the failed (a ping), reconcile, and stage
        once more on a rebuilt group, all within one phase deadline. Returns the (slot, incarnation) that
        hold the whole update. Nothing live changed, so every way out of here rolls back with the gate
        never closed: an update that does not fit (``RefitRefused``), fewer than ``min_healthy_engines``
        staged (``RefitNotStaged``, naming each engine and why)."""
        deadline = self.ctl.clock.now() + self.ctl.cfg.lifecycle_deadline_s
        results: dict = {}
        for attempt in (1, 2):
            plan = self.reconcile()
            results = await self._bounded_transfer(
                plan, deadline, lambda parts, left: self.ctl.transfer_port().stage(parts, version, plan.epoch, source, timeout=left))
            self._refuse_if_the_update_does_not_fit(results)
            staged = {(p.slot, p.incarnation) for p in plan.participants if results[p.slot].staged}
            if len(staged) == len(plan.participants):
                break
            failed = [p for p in plan.participants if (p.slot, p.incarnation) not in staged]
            self.ctl.log.emit("refit_failed_attempt", version=version, attempt=attempt, phase="stage",
                              failed={p.slot: results[p.slot].detail[:200] for p in failed})
            await self._classify_failed(failed)
            if self.ctl.clock.now() >= deadline:
                break
        self.ctl.log.emit("staged", version=version, epoch=plan.epoch, attempts=attempt,
                          members=sorted([s, i] for s, i in staged))
        if len(staged) < self.ctl.cfg.min_healthy_engines:
            why = "; ".join(f"slot {p.slot} (incarnation {p.incarnation}): {results[p.slot].detail[:200]}"
                            for p in plan.participants if (p.slot, p.incarnation) not in staged)
            raise _RollBack(RefitNotStaged(
                f"refit of version {version}: {len(staged)} engine(s) staged the update after {attempt} attempt(s), "
                f"fewer than min_healthy_engines ({self.ctl.cfg.min_healthy_engines}); failed: {why or 'no live engine'}. "
                f"The gate never closed; the fleet keeps serving {self.ctl.serves()}"))
        return staged

    async def close_gate(self, version: int) -> int:
        """Step 1: close dispatch and publish it; clients hold new requests, nothing is dropped.
        Returns the routing epoch of the closed gate."""
        self.holding = True
        self.ctl.admission.refit_started()  # the engines pause (and may reset their cache): not load signals
        self.ctl.intent.update(refit=RefitIntent(version, CLOSING))  # stored before anything changes
        self.ctl.gate.close(f"refit of version {version}")
        self.ctl.decide(RefitStarted(version))
        return await self.ctl.publisher.fence_for_refit()

    async def fence_and_abort_too_old(self, version: int, epoch: int) -> int:
        """Step 2: every shard (live or not) refuses work routed before ``epoch`` from now on; the live ones abort the
        in-flight requests whose version policy ``version`` would break (``max_staleness``, ``latest``);
        their clients re-send them. Returns how many were aborted."""
        args, kw = (epoch, version), {}
        live = self.ctl.live_handles()
        # every other engine (quarantined, starting) is fenced too, bounded like a probe: one that never heard
        # it left the serving set must not admit work routed before this refit
        others = {(s, i): h for s, (i, h) in self.ctl.handles.items() if s not in live}
        outs, fenced = await asyncio.gather(
            self._fan_out({s: (h, "begin_refit", args, kw) for s, (_, h) in live.items()}),
            self._fan_out({key: (h, "fence", (epoch,), kw) for key, h in others.items()},
                          timeout=self.ctl.cfg.probe_timeout_s))
        unfenced = sorted([s, i, o.kind] for (s, i), o in fenced.items() if not o.ok)
        if unfenced:  # it answers nothing, so it admits nothing either; its leave notice is still being retried
            self.ctl.log.emit("fence_failed", version=version, epoch=epoch, engines=unfenced)
        aborted, busy = 0, {}
        for s, o in outs.items():
            if o.kind == OK:  # ``o.ok``, without a property call per shard
                aborted += int(o.value.get("aborted", 0))
                if o.value.get("in_flight"):
                    busy[s] = int(o.value["in_flight"])
        self._busy = busy  # only the shards with requests in flight: an idle fleet's refit looks at none
        if aborted:
            self.ctl.log.emit("staleness_abort", version=version, requests=aborted)
        return aborted

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
            raise _EndRefit(FleetExhausted, f"refit of version {self._version}: no live engine to take part")
        return plan

    async def pause(self, plan: MembershipPlan) -> set[int]:
        """Step 4: pause every participant (keep in-flight requests); all pause calls settle first."""
        targets = {p.slot: p for p in plan.participants}
        clear = self._clear_cache(targets)
        await self._invalidate_without_native_pause({s: p for s, p in targets.items() if clear[s]})
        handles = self.ctl.handles
        idle = self.ctl.cfg.kv_policy == "keep"  # under keep a shard idle at its pause clears anyway (free)
        args, kw = (), {True: {"mode": "keep", "clear_cache": True},
                        False: {"mode": "keep", "clear_cache": False, **({"clear_if_idle": True} if idle else {})}}
        outs = await self._fan_out(
            {s: (handles[s][1], "pause", args, kw[clear[s]]) for s in targets}, expect_ack=True,
        )
        failed = {s: (targets[s].incarnation, out) for s, out in outs.items() if out.kind != OK}
        acts = self.ctl.observe_all(CallKind.PAUSE, failed)  # an ok pause is not fed (``observe_all``)
        aborts = [a for a in acts if isinstance(a, AbortRefit)]
        paused = {s for s in outs if s not in failed}
        held = self._held
        for slot in outs:  # every engine a pause was sent to: one whose ack was lost may have paused all the same
            held[(slot, targets[slot].incarnation)] = handles[slot][1]
        if aborts:
            raise _EndRefit(RefitFailed, aborts[0].message)
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
        """Step 5: transfer; on failure classify, rebuild without the dead, re-pause, retry exactly once.

        Returns the plan of the last attempt, the engines paused for it, the slots that
        hold the complete new weights, and the number of attempts (1 or 2).
        """
        results: dict = {}
        complete: set[int] = set()
        deadline = self.ctl.clock.now() + self.ctl.cfg.lifecycle_deadline_s  # one bound for the phase, retry included
        for attempt in (1, 2):
            if attempt == 2:
                plan, paused = await self._prepare_retry(plan, version, results, complete)
                if self.ctl.clock.now() >= deadline:
                    self.ctl.log.emit("refit_retry_skipped", version=version, reason="the transfer phase's deadline passed")
                    break
            results = await self._transfer_once(plan, version, source, rebuild=attempt > 1, deadline=deadline)
            self._refuse_if_the_update_does_not_fit(results)
            complete = {s for s, r in results.items() if r.result is RefitResult.COMPLETE}
            if plan.participants and len(complete) == len(plan.participants):
                break
        return plan, paused, complete, attempt

    def _refuse_if_the_update_does_not_fit(self, results: dict) -> None:
        """An update that does not fit the model is the trainer's fault, not the engines': no retry,
        no engine marked, roll back (the engines refused it before any byte moved)."""
        refused = sorted({r.refused for r in results.values() if r.refused})
        if refused and not any(r.bytes_moved for r in results.values()):
            self._moving = False
            raise _RollBack(RefitRefused(
                f"weight update for version {self._version} refused: {'; '.join(refused)[:1500]}; "
                f"the fleet keeps serving {self.ctl.serves()}"
            ))

    async def _prepare_retry(self, plan: MembershipPlan, version: int, results: dict, complete: set[int]):
        """Before the one retry: classify the failed participants, rebuild membership, re-pause every
        retry participant (engines restarted meanwhile included)."""
        failed = [p for p in plan.participants if p.slot not in complete]
        self.ctl.log.emit("refit_failed_attempt", version=version, attempt=1,
                          failed={p.slot: results[p.slot].detail[:200] for p in failed})
        await self._classify_failed(failed)
        return await self.pause_settled(self.reconcile())

    async def stamp(self, plan: MembershipPlan, version: int, complete: set[int]) -> None:
        """Step 6: commit the version in the ledger and stamp it on every engine that holds it. An engine whose
        stamp is not acknowledged (unavailable, timed out, raised, lied) holds an unknown version from then on:
        out of routing (a probe that finds it alive brings it back stale) until a refit lands on it again."""
        if not complete:
            return
        parts = [p for p in plan.participants if p.slot in complete]
        members = tuple((p.slot, p.incarnation) for p in parts)
        # stored before the commit acts: a successor stamps exactly these engines and serves the version
        self.ctl.intent.update(committed=version, membership_epoch=plan.epoch, refit=RefitIntent(
            version, COMMITTED, members))
        self.ctl.decide(VersionCommitted(version))
        handles, args, kw = self.ctl.handles, (version,), {}
        outs = await self._fan_out(
            {p.slot: (handles[p.slot][1], "set_weight_version", args, kw) for p in parts}, expect_ack=True
        )
        failed = [p for p in parts if outs[p.slot].kind != OK]
        for p in failed:  # its tag is unknown: it serves nothing until a refit lands on it again (``CallKind.STAMP``)
            self.ctl.observe(p.slot, p.incarnation, CallKind.STAMP, outs[p.slot])
        if failed:
            members = tuple((p.slot, p.incarnation) for p in parts if outs[p.slot].kind == OK)
            # a successor re-adopting the fleet serves an unacknowledged engine only if its own tag says so
            self.ctl.intent.update(refit=RefitIntent(version, COMMITTED, members))
        self.ctl.log.emit("stamp", version=version, members=members,
                          failed=[[p.slot, p.incarnation, outs[p.slot].describe()[:200]] for p in failed])

    async def resume(self, plan: MembershipPlan, paused: set[int], complete: set[int]) -> None:
        """Step 7: resume every paused participant, and every other engine this refit sent a pause to (its ack
        lost, or it left the plan since) that is still the same incarnation, under one shared deadline; never
        retries the transfer.

        Requests held on an engine that did not get the new weights completely are
        aborted first (the dispatcher re-sends them to a serving engine).
        """
        parts = [p for p in plan.participants if p.slot in paused]
        handles, args, kw = self.ctl.handles, (), {}
        stale = [p for p in parts if p.slot in self._busy and p.slot not in complete]
        others = self._paused_outside({p.slot for p in parts})
        aborts = {p.slot: (handles[p.slot][1], "abort_in_flight", args, kw) for p in stale}
        aborts.update({key: (h, "abort_in_flight", args, kw) for key, h in others.items()})
        if aborts:
            await self._fan_out(aborts)
        calls = {p.slot: (handles[p.slot][1], "resume", args, kw) for p in parts}
        calls.update({key: (h, "resume", args, kw) for key, h in others.items()})
        outs = await self._fan_out(calls, expect_ack=True)
        self._note_resumed_outside({key: outs[key] for key in others})
        acts = self.ctl.observe_all(  # an ok resume is not fed (``observe_all``)
            CallKind.RESUME, {p.slot: (p.incarnation, outs[p.slot]) for p in parts if outs[p.slot].kind != OK})
        aborts = [a for a in acts if isinstance(a, AbortRefit)]
        if aborts:
            raise _EndRefit(RefitFailed, aborts[0].message)

    async def reopen(self, version: int) -> None:
        """Step 8: reopen the gate only if quorum serves ``version``; else stop with it closed."""
        d = self.ctl.finish_refit(version)
        self._finished = True
        if self.ctl.gate.is_open:
            await self.ctl.publisher.publish()  # out to clients before sync_weights returns
            return
        stop = next((a for a in d.actions if isinstance(a, (StopExhausted, KeepGateClosed))), None)
        message = stop.message if stop is not None else d.reason
        raise _EndRefit(FleetExhausted if isinstance(stop, StopExhausted) else RefitFailed, message)

    # ------------------------------------------------------------------ helpers
    def _paused_outside(self, resuming: set[int]) -> dict[tuple[int, int], Any]:
        """(slot, incarnation) -> handle of each engine this refit sent a pause to that is not resumed with the
        participants (its pause ack was lost, or it left the plan later) and is still the slot's incarnation:
        it may be paused, holding requests; resume must reach it too."""
        return {key: h for key, h in self._held.items() if key[0] not in resuming and self.ctl.handle_of(*key) is h}

    def _note_resumed_outside(self, outs: dict) -> None:
        """Log the resumes of engines outside the refit; one that does not answer counts as a failed probe
        (it is quarantined already, or found so): still paused, it serves nothing, and the next refit resumes it."""
        if not outs:
            return
        self.ctl.log.emit("resume_outside_refit", version=self._version,
                          engines=[[s, i, o.kind] for (s, i), o in sorted(outs.items())])
        failed = {s: (i, o) for (s, i), o in outs.items() if not o.ok}
        if failed:
            self.ctl.observe_all(CallKind.PROBE, failed)

    def _clear_cache(self, slots) -> dict[int, bool]:
        """slot -> whether pausing it clears its KV cache; under ``keep``, decided per shard (an idle
        shard invalidates its prefix cache even while another one is busy). A shard busy at refit start is
        paused with ``clear_if_idle``: it clears all the same if it holds nothing by the time it pauses."""
        policy = self.ctl.cfg.kv_policy
        if policy == "recompute":
            return dict.fromkeys(slots, True)
        if policy != "keep":
            return dict.fromkeys(slots, False)
        clear = dict.fromkeys(slots, True)  # free: nothing in flight, so invalidate the prefix cache anyway
        busy = [s for s in self._busy if s in clear]
        for s in busy:
            clear[s] = False
        if busy and self.ctl.cfg.engine.enable_prefix_caching:
            self.ctl.warn_keep_once(
                "kv_policy='keep' with requests in flight during a refit: later requests may reuse "
                "prefix-cache blocks computed by the old weights (use 'recompute' or 'salt' to avoid this)"
            )
        return clear

    async def _invalidate_without_native_pause(self, targets: dict) -> None:
        """A backend without native pause must confirm an equivalent cache invalidation, or the refit stops."""
        native = self.ctl.native_pause
        if False not in native.values():  # every engine pauses natively (the common case: no per-shard look)
            return
        emulated = {s: p for s, p in targets.items() if not native.get(s, True)}
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
            raise _EndRefit(CacheInvalidationUnsupported, message)

    async def _transfer_once(self, plan: MembershipPlan, version: int, source: Any, rebuild: bool, deadline: float) -> dict:
        """One transfer attempt, cut off at the phase's ``deadline``: whoever had not finished
        then holds unknown weights (PARTIAL: never serves them, rejoins the next refit)."""
        results = await self._bounded_transfer(plan, deadline, lambda parts, left: self.ctl.transfer_port().transfer(
            parts, version, plan.epoch, source, rebuild=rebuild, timeout=left))
        self._report(plan.participants, version, results)
        return results

    async def apply_staged(self, plan: MembershipPlan, version: int, paused: set[int], staged: set[tuple[int, int]]) -> set[int]:
        """Step 5 under ``stage_ahead``: apply the staged update on the paused participants that staged it
        (the same incarnation); the others did not get it (``NOT_STARTED``: stale until the next refit).
        Returns the slots that hold the complete new weights. No retry: an apply that failed left its
        engine's weights unknown."""
        deadline = self.ctl.clock.now() + self.ctl.cfg.lifecycle_deadline_s
        ready = MembershipPlan(plan.epoch, tuple(p for p in plan.participants
                                                 if p.slot in paused and (p.slot, p.incarnation) in staged))
        results = await self._bounded_transfer(ready, deadline, lambda parts, left: self.ctl.transfer_port().apply_staged(
            parts, version, timeout=left)) if ready.participants else {}
        for p in plan.participants:
            results.setdefault(p.slot, TransferResult(RefitResult.NOT_STARTED, "[stage] did not stage this update"))
        self._report(plan.participants, version, results)
        return {s for s, r in results.items() if r.result is RefitResult.COMPLETE}

    async def _bounded_transfer(self, plan: MembershipPlan, deadline: float, call) -> dict:
        """``call(participants, seconds_left)`` on the port, cut off at ``deadline``: whoever had not
        finished then holds unknown weights (PARTIAL)."""
        handles = self.ctl.handles
        participants = [(p, handles[p.slot][1]) for p in plan.participants]
        with self._inside_shards():
            left = max(0.0, deadline - self.ctl.clock.now())
            try:
                return await asyncio.wait_for(call(participants, left), left)
            except asyncio.TimeoutError:
                bound = self.ctl.cfg.lifecycle_deadline_s
                return {p.slot: TransferResult(
                    RefitResult.PARTIAL, f"{self.phase} cut off at the phase deadline ({bound:.1f} s); weights unknown"
                ) for p in plan.participants}

    def _report(self, participants, version: int, results: dict) -> None:
        """What each participant holds after the transfer step, as one health decision."""
        self.ctl.decide(Batch(tuple(
            RefitReport(p.slot, p.incarnation, version, results[p.slot].result, results[p.slot].detail[:300])
            for p in participants
        )))

    async def _classify_failed(self, failed) -> None:
        """Find out why participants failed: dead, hung, or alive (a survivor of someone else's failure)."""
        outs = await self._fan_out(
            {p.slot: (self._handle(p), "ping", (), {}) for p in failed}, timeout=self.ctl.cfg.probe_timeout_s
        )
        for p in failed:
            out = outs[p.slot]
            if not out.ok:
                self.ctl.observe(p.slot, p.incarnation, CallKind.REFIT, out)

    async def _end(self, error: type[FleetStopped], message: str, cause: BaseException | None = None) -> None:
        """The one way a refit ends without reopening: halt with the gate closed (it never opens on
        the way), close the refit in the ledger, return held requests at once, raise ``error``."""
        self.ctl.halt(message)
        if not self._finished and self.holding:  # a refit that never closed the gate never began in the ledger
            self.ctl.finish_refit(self._version)
            self._finished = True
        live = {s: (h, "pause", (), {"mode": "abort"}) for s, (_, h) in self.ctl.handles.items()}
        await self.ctl.door.fan_out(live, timeout=self.ctl.cfg.probe_timeout_s, expect_ack=True)
        await self.ctl.publisher.publish()  # clients learn the fleet stopped and return what they hold
        raise error(message) from cause

    async def _roll_back(self, reason: str) -> None:
        """The refit ends before any engine's weights changed: resume what it paused (on the committed
        version), close the refit without a commit, reopen the gate on the committed version if quorum serves it."""
        held = {key: h for key, h in self._held.items() if self.ctl.handle_of(*key) is h}
        outs = await self._fan_out({key: (h, "resume", (), {}) for key, h in held.items()}, expect_ack=True)
        for (slot, inc), out in outs.items():
            self.ctl.observe(slot, inc, CallKind.RESUME, out)
        self.ctl.log.emit("refit_rolled_back", version=self._version, reason=reason[:300],
                          resumed=sorted(slot for (slot, _), o in outs.items() if o.ok), gate_closed=self.holding)
        if self.holding:  # a refit refused while it staged never closed the gate nor began in the ledger
            self.ctl.roll_back_refit(self._version, reason)
        self._finished = True
        await self.ctl.publisher.publish()

    async def _fan_out(self, calls: dict, expect_ack: bool = False, timeout: float | None = None) -> dict:
        if not calls:
            return {}
        with self._inside_shards():
            return await self.ctl.door.fan_out(
                calls, timeout=timeout or self.ctl.cfg.lifecycle_deadline_s, expect_ack=expect_ack
            )

    @contextmanager
    def _inside_shards(self):
        """Time spent on the shards' calls (RPC round trips included), wall and this thread's CPU: what
        ``overhead_s`` and ``controller_cpu_s`` leave out."""
        t0, cpu0 = self.ctl.clock.now(), time.thread_time()
        try:
            yield
        finally:
            self._inside_s += self.ctl.clock.now() - t0
            self._inside_cpu_s += time.thread_time() - cpu0

    def _handle(self, p):
        return self.ctl.handles[p.slot][1]


    @contextmanager
    def _phase(self, name: str):
        t0 = self.ctl.clock.now()
        self.ctl.log.emit("phase", phase=name, edge="begin", version=self._version)
        self.phase = name
        self.ctl.crash_point(name)
        try:
            yield
        finally:
            self.phase = None
            dt = self.ctl.clock.now() - t0
            self._phases[name] = dt
            self.ctl.metrics.phase(name, dt)
            self.ctl.log.emit("phase", phase=name, edge="end", version=self._version, seconds=round(dt, 6))
