"""The refit lifecycle: ``sync_weights(version)`` as the steps of DESIGN.md, in seven phases.

Under ``stage_ahead`` a step 0 comes first, with the gate open: the update moves into
every live engine's staging area while the fleet serves (``stage_ahead``); the transfer
is then only the apply of what each paused engine staged. A failure while staging never
closes the gate: the refit is refused (``RefitRefused``, ``RefitNotStaged``) and the
fleet serves what it had.

``RefitLifecycle.run`` reads like the design: close the gate, reconcile membership,
pause the participants (in the same call each aborts its requests too old for the new
version), transfer (classify, rebuild, re-pause, retry exactly once, only the engines
that failed, all within the phase's one deadline), commit the version, resume (in the
same call each engine is stamped first) under one shared deadline, reopen only with
quorum. An engine costs three control calls a refit: ``begin_refit`` with its pause,
its transfer, ``end_refit``; the order inside each call never varies, so fusing them
loses no decision point. The weight sender plans the update (its ``prepare``: the
manifest, which depends only on what it holds) while the gate closes and the engines
pause (``TransferPort.plan_ahead``); the first transfer attempt takes that plan. Every
fan-out settles every call before any result is acted on, and every call is bounded by
``refit_timeout_s + grace``.

Guarantee on failure: arguments are checked before anything changes (a version
that does not increase, a source that is not a sender: refused, nothing touched).
After that, a refit ends in exactly one of three ways: committed and reopened;
rolled back (nothing reached any engine's live weights, e.g. the update was refused
or the weight sender failed: paused engines resumed on the committed version, gate
reopened on it, the caller's error raised: ``RefitRefused``, ``RefitSourceFailed``,
``RefitNotDelivered``); or stopped (``_end``:
gate closed, held requests returned, ``RefitFailed``/``FleetExhausted`` naming the
shards and the phase). Never engines paused with the gate closed and the fleet
"not stopped". Engines that did not receive the complete new weights keep their
old version tag (or are fenced from serving when partial).
"""

from __future__ import annotations

import asyncio
import time
import warnings
from contextlib import contextmanager
from typing import AbstractSet, Any, Callable, Hashable

from fleet.errors import (
    CacheInvalidationUnsupported, FleetExhausted, FleetStopped, RefitArgumentError, RefitFailed, RefitNotDelivered,
    RefitNotStaged, RefitRefused, RefitSourceFailed,
)
from fleet.outcome import BAD_ACK, ERROR, OK, Outcome
from fleet.control.parts import Parts
from fleet.control.publisher import RoutingPublisher
from fleet.control.transfer_port import TransferResult, healthy_attempt_s
from health import (
    AbortRefit,
    Batch,
    CallKind,
    Decision,
    KeepGateClosed,
    MembershipPlan,
    RefitFinished,
    RefitReport,
    RefitResult,
    RefitRolledBack,
    RefitStarted,
    StopExhausted,
    VersionCommitted,
    plan_membership,
)
from health.faultplan import REFIT_PHASES
from fleet import records as ev
from fleet.wire import BeginRefit, EndRefit

PHASES = REFIT_PHASES  # close, reconcile, pause, transfer, commit, resume, reopen (``health.faultplan``)


class _RollBack(Exception):
    """Raised inside a step when nothing reached any engine and the refit must not go on
    (e.g. the update itself was refused); ``run`` rolls back and raises ``error`` to the caller."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _PhaseOver(Exception):
    """Raised by a fan-out asked to start after its phase's deadline (``RefitLifecycle._within``)."""


class _EndRefit(Exception):
    """Raised inside a step to end the refit without reopening; ``RefitLifecycle.run`` handles it in one place."""

    def __init__(self, error: type[FleetStopped], message: str) -> None:
        super().__init__(message)
        self.error, self.message = error, message


class RefitLifecycle:
    """The refit of one version at a time, built from the controller's parts (``fleet.control.parts``): the slots, the
    door, the gate, the intent store, the clock and the log; the routing publisher; the weight transport
    (``transfer``: built from ``refit`` on first use unless one is injected); and ``crash_point`` (fault
    injection: the controller's process may kill itself as a phase begins). Decides nothing about health
    itself: every outcome goes to ``parts.act`` (observe/decide), which carries out the health core's actions.
    """

    def __init__(self, parts: Parts, publisher: RoutingPublisher, transfer: Any = None,
                 crash_point: Callable[[str], None] = lambda point: None) -> None:
        self.p = parts
        self.publisher = publisher
        self._transfer = transfer
        self._crash_point = crash_point
        self._keep_warned = False
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
        self._aborted = 0  # requests the refit aborted as too old for their version policy
        self._fence_epoch = -1  # the routing epoch the refit closed the gate at: shards refuse work routed before it
        self._deadline: float | None = None  # inside ``_within``: the deadline every fan-out ends by
        self._retry_skipped: str | None = None  # why the transfer's retry did not run (None: it ran or was not needed)

    @property
    def lock(self) -> asyncio.Lock:
        """Held for the whole of a refit; a resize (``fleet.control.resize``) holds it too, so the two never interleave."""
        return self._lock

    @property
    def held_at_fence(self) -> dict[int, int]:
        """The last refit's shards that held requests when it fenced them: slot -> requests in flight (kept across
        its pause and resumed on the new weights)."""
        return dict(self._busy)

    def check(self, version: Any, source: Any, stage_ahead: Any = None) -> None:
        """Refuse a refit the caller got wrong, before anything changes; the error names the argument."""
        if stage_ahead is not None and not isinstance(stage_ahead, bool):
            raise RefitArgumentError(
                f"sync_weights: stage_ahead must be True, False or None (the fleet's setting), got {stage_ahead!r} "
                f"({type(stage_ahead).__name__}); nothing changed, the fleet serves {self.p.slots.serves()}"
            )
        if isinstance(version, bool) or not isinstance(version, int):
            raise RefitArgumentError(
                f"sync_weights: version must be an integer weight version, got {version!r} "
                f"({type(version).__name__}); nothing changed, the fleet serves {self.p.slots.serves()}"
            )
        committed = self.p.slots.ledger.current_version
        if committed is not None and version <= committed:
            raise RefitRefused(
                f"sync_weights: version {version} is not greater than the committed version {committed}; "
                f"refused, nothing changed, the fleet serves {self.p.slots.serves()}"
            )
        self.transfer_port().check_source(source)
        if source is not None and self.p.door.actor_state(source) == "DEAD":  # Ray's GCS: the sender is gone for good
            raise RefitSourceFailed(
                f"sync_weights({version}): the weight sender {source!r} is dead (Ray reports its actor DEAD); "
                f"refused before the gate closed, nothing changed, the fleet serves version {self.p.gate.version}; "
                f"send version {version} again from a live sender"
            )


    def transfer_port(self):
        """The weight transport; built from ``refit`` on first use unless one was injected."""
        if self._transfer is None:
            from fleet.control.transfer_port import RefitTransferPort

            self._transfer = RefitTransferPort(self.p.cfg, self.p.door)
        return self._transfer

    def _finish(self, version: int) -> Decision:
        """Step 7: close the refit in the ledger; its decision opens the gate (or says why not)."""
        return self.p.act.decide(RefitFinished(version))

    def _rolled_back(self, version: int, reason: str) -> Decision:
        """Close a refit that changed no engine; the gate reopens on the committed version if quorum serves it."""
        return self.p.act.decide(RefitRolledBack(version, reason))

    def _warn_once(self, message: str) -> None:
        if not self._keep_warned:
            self._keep_warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self.p.log.emit(ev.FleetWarning(message=message))

    async def run(self, version: int, source: Any, stage_ahead: bool | None = None) -> dict:
        """The steps. One refit at a time: a second call waits, then is checked against
        the version the first committed. Ends committed, rolled back or stopped (module docstring).
        ``stage_ahead``: this refit stages its update first (step 0) or not; None: the fleet's setting."""
        async with self._lock:
            if self.p.act.stopped:
                raise FleetStopped(f"sync_weights({version!r}) refused: fleet stopped: {self.p.act.stopped}")
            self.check(version, source, stage_ahead)  # raises before any state changes
            self.running = True
            self._phases, self._inside_s, self._inside_cpu_s, self._version = {}, 0.0, 0.0, version
            self._finished, self._moving, self._held, self._busy, self._aborted = False, False, {}, {}, 0
            self._retry_skipped = None
            t0, cpu0 = self.p.clock.now(), time.thread_time()
            try:
                staging = self.p.cfg.stage_ahead if stage_ahead is None else stage_ahead
                return await self._steps(version, source, t0, cpu0, staging)
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
                    self.p.admission.refit_finished(self.p.clock.now())
                self.running = self.holding = False
                # ended without a commit? a committed refit's record stays until the next one begins (a
                # successor re-stamps its engines, and a re-sent call for it returns its summary)
                self.p.intent.refit_ended_uncommitted(self.p.slots.plan.epoch)
            raise AssertionError("unreachable: every failure path raises")

    async def _steps(self, version: int, source: Any, t0: float, cpu0: float, staging: bool) -> dict:
        staged = ahead = None
        if staging:
            with self._phase("stage"):
                staged = await self.stage_ahead(version, source)  # 0: the bytes move while the fleet serves
        else:  # the sender plans the update while the gate closes and the engines pause
            ahead = self.transfer_port().plan_ahead(source)
        with self._phase("close"):
            epoch = await self.close_gate(version)  # 1
        with self._phase("reconcile"):
            plan = self.reconcile()  # 2
        with self._phase("pause"):
            self._fence_epoch = epoch
            plan, paused = await self.pause_settled(plan)  # 3: fence, abort the too old, pause
        aborted = self._aborted
        if aborted:
            self.p.log.emit(ev.StalenessAbort(version=version, requests=aborted))
        with self._phase("transfer"):
            self._moving = True
            if staged is None:
                plan, paused, complete, attempts = await self.transfer(plan, version, source, paused, ahead)  # 4
            else:
                complete, attempts = await self.apply_staged(plan, version, paused, staged), 1  # 4: the apply only
        with self._phase("commit"):
            self.commit(plan, version, complete)  # 5
        with self._phase("resume"):
            await self.resume(plan, version, paused, complete)  # 6: stamp, abort the unstamped, resume
        with self._phase("reopen"):
            await self.reopen(version)  # 7
        total = self.p.clock.now() - t0
        return {
            "version": version,
            "epoch": plan.epoch,
            "participants": [p.slot for p in plan.participants],
            "complete": sorted(complete),
            "attempts": attempts,  # transfer attempts that ran (1 when the retry was skipped or not needed)
            "retry_skipped": self._retry_skipped,
            "aborted_for_staleness": aborted,
            "phases_s": dict(self._phases),
            "total_s": total,
            "inside_shards_s": self._inside_s,
            "overhead_s": max(0.0, total - self._inside_s),
            # the controller's own CPU outside the shards' calls: what ``overhead_s`` is made of, less the waits
            # (the intent's store, the OS scheduling this process), which depend on the machine more than on rlfleet
            "controller_cpu_s": max(0.0, time.thread_time() - cpu0 - self._inside_cpu_s),
            "serving": self.p.slots.serving_slots(),  # spares hold the version too, but serve nothing
            "gate_open": self.p.gate.is_open,  # reopened only with quorum (``reopen``); else why not
            "gate_reason": None if self.p.gate.is_open else self.p.gate.reason,
            "routing_epoch": self.publisher.current.epoch,  # clients routing on it (or later) see this refit
        }

    # ------------------------------------------------------------------ the steps
    async def stage_ahead(self, version: int, source: Any) -> set[tuple[int, int]]:
        """Step 0, under ``stage_ahead``: with the gate open and every engine serving, move the update into
        the staging area of every live engine; on failure classify the failed (a ping), reconcile, and stage
        once more on a rebuilt group, all within one phase deadline. Returns the (slot, incarnation) that
        hold the whole update. Nothing live changed, so every way out of here rolls back with the gate
        never closed: an update that does not fit (``RefitRefused``), fewer than ``min_healthy_engines``
        staged (``RefitNotStaged``, naming each engine and why)."""
        deadline = self.p.clock.now() + self.p.cfg.lifecycle_deadline_s
        results: dict = {}
        for attempt in (1, 2):
            plan = self.reconcile()
            results = await self._bounded_transfer(
                plan, deadline, lambda parts, left: self.transfer_port().stage(parts, version, plan.epoch, source, timeout=left))
            self._refuse_if_the_update_does_not_fit(results)
            staged = {(p.slot, p.incarnation) for p in plan.participants if results[p.slot].staged}
            if len(staged) == len(plan.participants):
                break
            failed = [p for p in plan.participants if (p.slot, p.incarnation) not in staged]
            self.p.log.emit(ev.RefitFailedAttempt(version=version, attempt=attempt, phase="stage",
                            failed={p.slot: results[p.slot].detail[:200] for p in failed}))
            await self._classify_failed(failed)
            if self.p.clock.now() >= deadline:
                break
        self.p.log.emit(ev.Staged(version=version, epoch=plan.epoch, attempts=attempt,
                          members=sorted([s, i] for s, i in staged)))
        if len(staged) < self.p.cfg.min_healthy_engines:
            why = "; ".join(f"slot {p.slot} (incarnation {p.incarnation}): {results[p.slot].detail[:200]}"
                            for p in plan.participants if (p.slot, p.incarnation) not in staged)
            raise _RollBack(RefitNotStaged(
                f"refit of version {version}: {len(staged)} engine(s) staged the update after {attempt} attempt(s), "
                f"fewer than min_healthy_engines ({self.p.cfg.min_healthy_engines}); failed: {why or 'no live engine'}. "
                f"The gate never closed; the fleet keeps serving {self.p.slots.serves()}"))
        return staged

    async def close_gate(self, version: int) -> int:
        """Step 1: close dispatch and publish it; clients hold new requests, nothing is dropped.
        Returns the routing epoch of the closed gate."""
        self.p.intent.refit_begun(version)  # stored before anything changes: if it raises, nothing did
        self.holding = True
        self.p.admission.refit_started()  # the engines pause (and may reset their cache): not load signals
        self.p.act.decide(RefitStarted(version))  # the health core closes the gate
        return await self.publisher.fence_for_refit()

    def reconcile(self) -> MembershipPlan:
        """Step 3: settle membership from the ledger; a changed participant set is a new epoch."""
        old = self.p.slots.plan
        plan = plan_membership(self.p.slots.ledger, old)
        if plan.epoch != old.epoch:
            self.p.log.emit(ev.Epoch(epoch=plan.epoch, previous=old.epoch,
                                     participants=[(p.slot, p.incarnation, p.rank) for p in plan.participants]))
        self.p.slots.plan = plan
        if not plan.participants:
            raise _EndRefit(FleetExhausted, f"refit of version {self._version}: no live engine to take part")
        return plan

    async def pause(self, plan: MembershipPlan, skip: AbstractSet[int] = frozenset(), fence_others: bool = False) -> set[int]:
        """Step 3, one call per participant (``begin_refit`` with its pause): refuse work routed before the
        gate closed (``_fence_epoch``), abort the in-flight requests whose version policy the refit's version would break
        (their clients re-send them), then pause, keeping the rest in flight. With ``fence_others`` (the refit's
        first pause) every other engine (quarantined, starting) is fenced too, bounded like a probe: one that
        never heard it left the serving set must not admit work routed before this refit; a later pause (an
        engine that joined, the transfer's re-pause) does not wait on them again. All calls settle first.
        Returns the slots paused (``skip``: the participants paused already, left alone)."""
        version, epoch = self._version, self._fence_epoch
        targets = {p.slot: p for p in plan.participants if p.slot not in skip}
        handles = self.p.slots.handles
        native = self.p.slots.native_pause
        emulated = {s: p for s, p in targets.items() if native.get(s, True) is False}
        members = {p.slot for p in plan.participants}
        others = {(s, i): h for s, (i, h) in handles.items() if s not in members} if fence_others else {}
        fused = {s: (handles[s][1], "begin_refit", (epoch, version), {"pause": self._pause_kw()})
                 for s in targets if s not in emulated}
        outs, fenced, emulated_outs = await asyncio.gather(
            self._fan_out(fused),
            self._fan_out({key: (h, "fence", (epoch,), {}) for key, h in others.items()},
                          timeout=self.p.cfg.probe_timeout_s),
            self._pause_emulated(emulated, version, epoch))
        unfenced = sorted([s, i, o.kind] for (s, i), o in fenced.items() if not o.ok)
        if unfenced:  # it answers nothing, so it admits nothing either; its leave notice is still being retried
            self.p.log.emit(ev.FenceFailed(version=version, epoch=epoch, engines=unfenced))
        outs = {s: self._paused_outcome(s, o) for s, o in outs.items()}
        outs.update(emulated_outs)
        self._warn_keep_if_busy()
        failed = {s: (targets[s].incarnation, out) for s, out in outs.items() if out.kind != OK}
        acts = self.p.act.observe_all(CallKind.PAUSE, failed)  # an ok pause is not fed (``observe_all``)
        aborts = [a for a in acts if isinstance(a, AbortRefit)]
        paused = {s for s in outs if s not in failed}
        held = self._held
        for slot in outs:  # every engine a pause was sent to: one whose ack was lost may have paused all the same
            held[(slot, targets[slot].incarnation)] = handles[slot][1]
        if aborts:
            raise _EndRefit(RefitFailed, aborts[0].message)
        return paused

    def _pause_kw(self) -> dict:
        """How a participant pauses under the fleet's ``kv_policy``: ``recompute`` clears the KV cache; ``keep``
        clears it only on a shard idle once the too-old requests are aborted (free, and it drops prefix blocks
        the old weights computed); ``salt`` keeps it (new requests get a new salt)."""
        policy = self.p.cfg.kv_policy
        return {"mode": "keep", "clear_cache": policy == "recompute", "clear_if_idle": policy == "keep"}

    def _paused_outcome(self, slot: int, out: Outcome) -> Outcome:
        """A ``begin_refit`` answer as the pause's outcome: its staleness aborts and what it holds recorded
        (``_aborted``, ``_busy``), ``paused`` as the acknowledgement (anything but True is a lie)."""
        if out.kind != OK:
            return out
        began: BeginRefit = out.value
        self._began(slot, began)
        return out if began.paused is True else Outcome(BAD_ACK, value=began.paused, elapsed_s=out.elapsed_s)

    def _began(self, slot: int, began: BeginRefit) -> None:
        self._aborted += began.aborted
        if began.in_flight:
            self._busy[slot] = began.in_flight

    async def _pause_emulated(self, targets: dict, version: int, epoch: int) -> dict:
        """The participants whose backend has no native pause (none of vLLM's): fence and abort the too old,
        then confirm a cache invalidation where the policy clears it (or the refit stops), then pause: three
        calls, in order."""
        if not targets:
            return {}
        handles = self.p.slots.handles
        began = await self._fan_out({s: (handles[s][1], "begin_refit", (epoch, version), {}) for s in targets})
        for s, o in began.items():
            if o.kind == OK:
                self._began(s, o.value)
        clear = self._clear_cache(targets)
        await self._invalidate_without_native_pause({s: p for s, p in targets.items() if clear[s]})
        return await self._fan_out({s: (handles[s][1], "pause", (), {"mode": "keep", "clear_cache": clear[s],
                                                                       "owner": "refit"})
                                    for s in targets}, expect_ack=True)

    async def pause_settled(self, plan: MembershipPlan) -> tuple[MembershipPlan, set[int]]:
        """Pause until the plan's participants are exactly the paused, live engines.

        A participant that died while pausing leaves the plan (a new epoch without
        it); an engine that became ready meanwhile joins it and is paused too.
        """
        paused = await self.pause(plan, fence_others=True)
        for _ in range(3):
            fresh = self.reconcile()
            members = {p.slot for p in fresh.participants}
            if members <= paused:
                return fresh, paused & members
            paused = (paused & members) | await self.pause(fresh, skip=paused & members)
            plan = fresh
        return plan, paused

    async def transfer(self, plan: MembershipPlan, version: int, source: Any, paused: set[int], ahead: Any = None):
        """Step 5: transfer; on failure classify, rebuild without the dead, re-pause and retry exactly once,
        only to the engines that did not complete the first attempt. One deadline bounds the whole phase,
        classification and re-pause included; the retry runs only if enough of it is left (``_no_retry``).

        Returns the plan of the last attempt (every participant, those that completed the first attempt
        included), the engines paused for it, the slots that hold the complete new weights, and the number
        of attempts that ran (1 or 2; ``retry_skipped`` in the summary says why a retry did not run).
        Raises ``_RollBack`` when no byte reached any engine (``_roll_back_if_nothing_moved``). ``ahead``: the
        sender's plan started before the pause (``TransferPort.plan_ahead``), for the first attempt.
        """
        deadline = self.p.clock.now() + self.p.cfg.lifecycle_deadline_s  # one bound for the phase, retry included
        results = await self._transfer_once(plan, version, source, rebuild=False, deadline=deadline, ahead=ahead)
        self._refuse_if_the_update_does_not_fit(results)
        tried, done = [results], _completed(plan, results)
        self._moving = _moved(tried)  # an error before the retry rolls back if nothing moved yet
        if len(done) < len(plan.participants):
            plan, paused, retry = await self._prepare_retry(plan, version, source, results, done, paused, deadline)
            if retry is not None:
                self._moving = True
                results = await self._transfer_once(retry, version, source, rebuild=True, deadline=deadline)
                self._refuse_if_the_update_does_not_fit(results)
                tried.append(results)
                done |= _completed(retry, results)
        self._roll_back_if_nothing_moved(tried, source)
        return plan, paused, {p.slot for p in plan.participants if (p.slot, p.incarnation) in done}, len(tried)

    def _refuse_if_the_update_does_not_fit(self, results: dict) -> None:
        """An update that does not fit the model is the trainer's fault, not the engines': no retry,
        no engine marked, roll back (the engines refused it before any byte moved)."""
        refused = sorted({r.refused for r in results.values() if r.refused})
        if refused and not any(r.bytes_moved for r in results.values()):
            self._moving = False
            raise _RollBack(RefitRefused(
                f"weight update for version {self._version} refused: {'; '.join(refused)[:1500]}; "
                f"the fleet keeps serving {self.p.slots.serves()}"
            ))

    async def _prepare_retry(self, plan: MembershipPlan, version: int, source: Any, results: dict, done: set,
                             paused: set[int], deadline: float):
        """Before the one retry: classify the failed participants, rebuild membership, re-pause the retry's
        participants (those that failed and are alive, and engines restarted meanwhile; not those that
        completed: they stay paused and are sent nothing more). Every call here ends by ``deadline``.

        Returns the plan (the retry's participants and those that completed), the paused slots, and the
        retry's plan, or None when the retry does not run (``_retry_skipped`` then says why)."""
        failed = [p for p in plan.participants if (p.slot, p.incarnation) not in done]
        self.p.log.emit(ev.RefitFailedAttempt(version=version, attempt=1,
                        failed={p.slot: results[p.slot].detail[:200] for p in failed}))
        with self._within(deadline):
            if deadline - self.p.clock.now() >= self.p.cfg.probe_timeout_s:  # a ping cut shorter proves no hang
                await self._classify_failed(failed)
            skip = self._no_retry(source, results, deadline)
            repaused: set[tuple[int, int]] = set()
            if skip is None:
                repaused, skip = await self._re_pause(done, deadline)
        fresh = self.reconcile()  # without what died or hung in the re-pause
        kept = {(p.slot, p.incarnation) for p in plan.participants if p.slot in paused} | repaused
        paused = {p.slot for p in fresh.participants if (p.slot, p.incarnation) in kept}
        retry = [p for p in fresh.participants if (p.slot, p.incarnation) in repaused]
        if skip is None and not retry:
            skip = "no engine that failed the first attempt is alive and paused to retry"
        if skip is not None:
            self._retry_skipped = skip
            self.p.log.emit(ev.RefitRetrySkipped(version=version, reason=skip))
            return fresh, paused, None
        return fresh, paused, MembershipPlan(fresh.epoch, tuple(retry))

    async def _re_pause(self, done: set, deadline: float) -> tuple[set[tuple[int, int]], str | None]:
        """Pause the retry's participants: every live one that did not complete the first attempt, engines
        that became ready meanwhile (even during this re-pause) included, as ``pause_settled`` does for the
        first. Returns the (slot, incarnation) paused, and why the retry cannot run after all (or None)."""
        repaused: set[tuple[int, int]] = set()
        asked = set(done)  # each engine is asked once; one whose pause failed was observed by ``pause``
        for _ in range(3):
            fresh = self.reconcile()
            todo = [p for p in fresh.participants if (p.slot, p.incarnation) not in asked]
            if not todo:
                break
            asked |= {(p.slot, p.incarnation) for p in todo}
            try:
                slots = await self.pause(fresh, skip={p.slot for p in fresh.participants} - {p.slot for p in todo})
            except _PhaseOver:  # a fan-out of the re-pause found the phase over: nothing more was sent
                slots = set()
            repaused |= {(p.slot, p.incarnation) for p in todo if p.slot in slots}
            if deadline - self.p.clock.now() < _needed_s(self.p.cfg):
                return repaused, "the transfer phase's deadline passed during the re-pause"
        return repaused, None

    def _no_retry(self, source: Any, results: dict, deadline: float) -> str | None:
        """Why the retry must not run, or None. It cannot help when the sender is dead; it cannot finish
        when less of the phase is left than an attempt needs (``_needed_s``)."""
        if any(r.sender_error for r in results.values()) and self.p.door.actor_state(source) == "DEAD":
            return f"the weight sender {source!r} is dead: a retry from it cannot move anything"
        left, needed = deadline - self.p.clock.now(), _needed_s(self.p.cfg)
        if left < needed:
            return (f"{max(0.0, left):.3f} s left of the transfer phase's {self.p.cfg.lifecycle_deadline_s:.1f} s, "
                    f"less than a retry needs ({needed:.3f} s: a quarter of refit_timeout_s, what one attempt is sized for)")
        return None

    def _roll_back_if_nothing_moved(self, tried: list[dict], source: Any) -> None:
        """No engine's live weights changed in any attempt (every result ``NOT_STARTED``: no byte reached an
        engine, or only its staging area): nothing changed, so the refit rolls back like a refusal
        (``_RollBack``), with ``RefitSourceFailed`` naming the sender when it failed, else ``RefitNotDelivered``
        naming each engine. Returns when anything moved (the refit goes on to stamp what completed)."""
        if _moved(tried):
            return
        self._moving = False
        v, committed, n = self._version, self.p.slots.ledger.current_version, len(tried)
        after = (f"the refit rolled back: no engine changed, they resume on version {committed} and the gate "
                 f"reopens on it if quorum serves it; send version {v} again")
        sender = next((r.sender_error for res in reversed(tried) for r in res.values() if r.sender_error), None)
        if sender is not None:
            dead = " is dead: it" if self.p.door.actor_state(source) == "DEAD" else ""
            raise _RollBack(RefitSourceFailed(
                f"refit of version {v}: the weight sender {source!r}{dead} failed before the update reached any engine's weights "
                f"({n} attempt(s); sender: {sender[:400]}); {after}, from a live sender"))
        why = "; ".join(f"slot {s}: {r.detail[:200]}" for s, r in sorted(tried[-1].items()))
        raise _RollBack(RefitNotDelivered(
            f"refit of version {v}: no engine received any byte of the update after {n} attempt(s) ({why}); {after}"))

    def commit(self, plan: MembershipPlan, version: int, complete: set[int]) -> None:
        """Step 5: commit ``version`` in the ledger, stored first in the intent with the engines that hold it
        (a successor stamps exactly these engines and serves the version). Nothing to commit when no engine
        holds it whole."""
        if not complete:
            return
        members = tuple((p.slot, p.incarnation) for p in plan.participants if p.slot in complete)
        self.p.intent.refit_committed(version, plan.epoch, members)
        self.p.act.decide(VersionCommitted(version))

    async def resume(self, plan: MembershipPlan, version: int, paused: set[int], complete: set[int]) -> None:
        """Step 6, one call per engine (``end_refit``), under one shared deadline; never retries the transfer.
        Every paused participant is resumed, and every other engine this refit sent a pause to (its ack lost, or
        it left the plan since) that is still the same incarnation. Each that holds the whole update is
        stamped with ``version`` first; one that does not (or whose stamp fails) has what it held across the
        pause aborted before it resumes (the dispatcher re-sends it to a serving engine): its results would
        carry the old tag on the new weights.

        An engine whose stamp is not acknowledged (unavailable, raised, lied) holds an unknown version from
        then on: out of routing (a probe that finds it alive brings it back stale) until a refit lands on it
        again (``CallKind.STAMP``); one whose call failed as a whole is a failed resume (``CallKind.RESUME``)
        and counts as not stamped."""
        parts = [p for p in plan.participants if p.slot in paused or p.slot in complete]
        handles = self.p.slots.handles
        others = self._paused_outside({p.slot for p in parts})
        # participants by slot, the others by (slot, incarnation)
        calls: dict[Hashable, tuple] = {
            p.slot: (handles[p.slot][1], "end_refit", (),
                     {"version": version, "abort_held": False} if p.slot in complete else {"abort_held": True})
            for p in parts}
        calls.update({key: (h, "end_refit", (), {"abort_held": True}) for key, h in others.items()})
        outs = await self._fan_out(calls)
        self._note_resumed_outside({key: self._resumed_outcome(outs[key]) for key in others})
        self._stamped(version, [p for p in parts if p.slot in complete], outs)
        acts = self.p.act.observe_all(  # an ok resume is not fed (``observe_all``)
            CallKind.RESUME, {p.slot: (p.incarnation, r) for p in parts
                              if (r := self._resumed_outcome(outs[p.slot])).kind != OK})
        aborts = [a for a in acts if isinstance(a, AbortRefit)]
        if aborts:
            raise _EndRefit(RefitFailed, aborts[0].message)

    @staticmethod
    def _resumed_outcome(out: Outcome) -> Outcome:
        """An ``end_refit`` answer as the resume's outcome: ``resumed`` is its acknowledgement."""
        if out.kind != OK or out.value.resumed is True:
            return out
        return Outcome(BAD_ACK, value=out.value.resumed, elapsed_s=out.elapsed_s)

    def _stamped(self, version: int, parts: list, outs: dict) -> None:
        """Record the stamps of ``end_refit``: the ``stamp`` event names the engines stamped (``members``), those
        whose stamp failed and why (``failed``: they said so, kept their old tag and aborted what they held), and
        those whose call failed as a whole (``unknown``: stamped or not, nobody can tell; the resume's failure
        decides their fate). A stamp that failed on an answering engine is a ``CallKind.STAMP`` failure. The
        intent names only the stamped (a successor re-adopting the fleet serves an unacknowledged engine only if
        its own tag says so)."""
        if not parts:
            return
        failed: dict[int, Outcome] = {}
        unknown: dict[int, Outcome] = {}
        for p in parts:
            out = outs[p.slot]
            if out.kind != OK:
                unknown[p.slot] = out
            elif out.value.stamp != OK:
                ended: EndRefit = out.value
                kind, error = ended.stamp or ERROR, ended.stamp_error
                failed[p.slot] = Outcome(kind, value=False if kind == BAD_ACK else None, error=error)
                self.p.act.observe(p.slot, p.incarnation, CallKind.STAMP, failed[p.slot])
        members = tuple((p.slot, p.incarnation) for p in parts if p.slot not in failed and p.slot not in unknown)
        if failed or unknown:
            self.p.intent.refit_stamped(version, members)

        def named(which: dict) -> list:
            return [[p.slot, p.incarnation, which[p.slot].describe()[:200]] for p in parts if p.slot in which]

        self.p.log.emit(ev.Stamp(version=version, members=list(members), failed=named(failed), unknown=named(unknown)))

    async def reopen(self, version: int) -> None:
        """Step 8: the health core closes the refit (``RefitFinished``) and decides the gate: open if quorum
        serves ``version`` (closed while the operator's pause holds); the refit stops with it closed only
        where that decision says so (``StopExhausted``, ``KeepGateClosed``)."""
        d = self._finish(version)
        self._finished = True
        stop = next((a for a in d.actions if isinstance(a, (StopExhausted, KeepGateClosed))), None)
        if stop is None:
            await self.publisher.publish()  # out to clients before sync_weights returns
            return
        raise _EndRefit(FleetExhausted if isinstance(stop, StopExhausted) else RefitFailed, stop.message)

    # ------------------------------------------------------------------ helpers
    def _paused_outside(self, resuming: set[int]) -> dict[tuple[int, int], Any]:
        """(slot, incarnation) -> handle of each engine this refit sent a pause to that is not resumed with the
        participants (its pause ack was lost, or it left the plan later) and is still the slot's incarnation:
        it may be paused, holding requests; resume must reach it too."""
        return {key: h for key, h in self._held.items() if key[0] not in resuming and self.p.slots.handle_of(*key) is h}

    def _note_resumed_outside(self, outs: dict) -> None:
        """Log the resumes of engines outside the refit; one that does not answer counts as a failed probe
        (it is quarantined already, or found so): still paused, it serves nothing, and the next refit resumes it."""
        if not outs:
            return
        self.p.log.emit(ev.ResumeOutsideRefit(version=self._version,
                        engines=[[s, i, o.kind] for (s, i), o in sorted(outs.items())]))
        failed = {s: (i, o) for (s, i), o in outs.items() if not o.ok}
        if failed:
            self.p.act.observe_all(CallKind.PROBE, failed)

    def _clear_cache(self, slots) -> dict[int, bool]:
        """slot -> whether pausing it clears its KV cache (the emulated pause, decided here from what each held
        at ``begin_refit``; a native pause decides it on the shard, ``_pause_kw``): under ``keep``, only an idle
        shard clears."""
        policy = self.p.cfg.kv_policy
        if policy != "keep":
            return dict.fromkeys(slots, policy == "recompute")
        return {s: s not in self._busy for s in slots}

    def _warn_keep_if_busy(self) -> None:
        if self._busy and self.p.cfg.kv_policy == "keep" and self.p.cfg.engine.enable_prefix_caching:
            self._warn_once(
                "kv_policy='keep' with requests in flight during a refit: later requests may reuse "
                "prefix-cache blocks computed by the old weights (use 'recompute' or 'salt' to avoid this)"
            )

    async def _invalidate_without_native_pause(self, targets: dict) -> None:
        """A backend without native pause must confirm an equivalent cache invalidation, or the refit stops."""
        native = self.p.slots.native_pause
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
                f"kv_policy={self.p.cfg.kv_policy!r} needs the KV cache cleared at pause, but slot(s) {failed} "
                f"have no native pause and did not confirm a cache invalidation "
                f"({'; '.join(outs[s].describe() for s in failed)})"
            )
            raise _EndRefit(CacheInvalidationUnsupported, message)

    async def _transfer_once(self, plan: MembershipPlan, version: int, source: Any, rebuild: bool, deadline: float,
                             ahead: Any = None) -> dict:
        """One transfer attempt, cut off at the phase's ``deadline``: whoever had not finished
        then holds unknown weights (PARTIAL: never serves them, rejoins the next refit)."""
        results = await self._bounded_transfer(plan, deadline, lambda parts, left: self.transfer_port().transfer(
            parts, version, plan.epoch, source, rebuild=rebuild, timeout=left, ahead=ahead))
        self._report(plan.participants, version, results)
        return results

    async def apply_staged(self, plan: MembershipPlan, version: int, paused: set[int], staged: set[tuple[int, int]]) -> set[int]:
        """Step 5 under ``stage_ahead``: apply the staged update on the paused participants that staged it
        (the same incarnation); the others did not get it (``NOT_STARTED``: stale until the next refit).
        Returns the slots that hold the complete new weights. No retry: an apply that failed left its
        engine's weights unknown."""
        deadline = self.p.clock.now() + self.p.cfg.lifecycle_deadline_s
        ready = MembershipPlan(plan.epoch, tuple(p for p in plan.participants
                                                 if p.slot in paused and (p.slot, p.incarnation) in staged))
        results = await self._bounded_transfer(ready, deadline, lambda parts, left: self.transfer_port().apply_staged(
            parts, version, timeout=left)) if ready.participants else {}
        for p in plan.participants:
            results.setdefault(p.slot, TransferResult(RefitResult.NOT_STARTED, "[stage] did not stage this update"))
        self._report(plan.participants, version, results)
        return {s for s, r in results.items() if r.result is RefitResult.COMPLETE}

    async def _bounded_transfer(self, plan: MembershipPlan, deadline: float, call) -> dict:
        """``call(participants, seconds_left)`` on the port, cut off at ``deadline``: whoever had not
        finished then holds unknown weights (PARTIAL)."""
        handles = self.p.slots.handles
        participants = [(p, handles[p.slot][1]) for p in plan.participants]
        with self._inside_shards():
            left = max(0.0, deadline - self.p.clock.now())
            try:
                return await asyncio.wait_for(call(participants, left), left)
            except asyncio.TimeoutError:
                bound = self.p.cfg.lifecycle_deadline_s
                return {p.slot: TransferResult(
                    RefitResult.PARTIAL, f"{self.phase} cut off at the phase deadline ({bound:.1f} s); weights unknown"
                ) for p in plan.participants}

    def _report(self, participants, version: int, results: dict) -> None:
        """What each participant holds after the transfer step, as one health decision."""
        self.p.act.decide(Batch(tuple(
            RefitReport(p.slot, p.incarnation, version, results[p.slot].result, results[p.slot].detail[:300])
            for p in participants
        )))

    async def _classify_failed(self, failed) -> None:
        """Find out why participants failed: dead, hung, or alive (a survivor of someone else's failure)."""
        outs = await self._fan_out(
            {p.slot: (self._handle(p), "ping", (), {}) for p in failed}, timeout=self.p.cfg.probe_timeout_s
        )
        for p in failed:
            out = outs[p.slot]
            if not out.ok:
                self.p.act.observe(p.slot, p.incarnation, CallKind.REFIT, out)

    async def _end(self, error: type[FleetStopped], message: str, cause: BaseException | None = None) -> None:
        """The one way a refit ends without reopening: halt with the gate closed (it never opens on
        the way), close the refit in the ledger, return held requests at once, raise ``error``."""
        self.p.act.halt(message)
        if not self._finished and self.holding:  # a refit that never closed the gate never began in the ledger
            self._finish(self._version)
            self._finished = True
        live = {s: (h, "pause", (), {"mode": "abort"}) for s, (_, h) in self.p.slots.handles.items()}
        await self.p.door.fan_out(live, timeout=self.p.cfg.probe_timeout_s, expect_ack=True)
        await self.publisher.publish()  # clients learn the fleet stopped and return what they hold
        raise error(message) from cause

    async def _roll_back(self, reason: str) -> None:
        """The refit ends before any engine's weights changed: resume what it paused (on the committed
        version), close the refit without a commit, reopen the gate on the committed version if quorum serves it."""
        held = {key: h for key, h in self._held.items() if self.p.slots.handle_of(*key) is h}
        outs = await self._fan_out({key: (h, "end_refit", (), {}) for key, h in held.items()})  # release, no stamp
        outs = {key: self._resumed_outcome(out) for key, out in outs.items()}
        for (slot, inc), out in outs.items():
            self.p.act.observe(slot, inc, CallKind.RESUME, out)
        self.p.log.emit(ev.RefitRolledBack(version=self._version, reason=reason[:300],
                        resumed=sorted(slot for (slot, _), o in outs.items() if o.ok), gate_closed=self.holding))
        if self.holding:  # a refit refused while it staged never closed the gate nor began in the ledger
            self._rolled_back(self._version, reason)
        self._finished = True
        await self.publisher.publish()

    async def _fan_out(self, calls: dict, expect_ack: bool = False, timeout: float | None = None) -> dict:
        if not calls:
            return {}
        timeout = timeout or self.p.cfg.lifecycle_deadline_s
        if self._deadline is not None:  # inside ``_within``: no call waits past the phase's deadline
            left = self._deadline - self.p.clock.now()
            if left <= 0:
                raise _PhaseOver(f"{self.phase} phase's deadline passed; no call started")
            timeout = min(timeout, left)
        with self._inside_shards():
            return await self.p.door.fan_out(calls, timeout=timeout, expect_ack=expect_ack)

    @contextmanager
    def _within(self, deadline: float):
        """Every fan-out inside ends by ``deadline`` (its timeout is cut to what is left); none starts after
        it (``_PhaseOver``). One deadline for a phase's several fan-outs."""
        self._deadline = deadline
        try:
            yield
        finally:
            self._deadline = None

    @contextmanager
    def _inside_shards(self):
        """Time spent on the shards' calls (RPC round trips included), wall and this thread's CPU: what
        ``overhead_s`` and ``controller_cpu_s`` leave out."""
        t0, cpu0 = self.p.clock.now(), time.thread_time()
        try:
            yield
        finally:
            self._inside_s += self.p.clock.now() - t0
            self._inside_cpu_s += time.thread_time() - cpu0

    def _handle(self, p):
        return self.p.slots.handles[p.slot][1]


    @contextmanager
    def _phase(self, name: str):
        t0 = self.p.clock.now()
        self.p.log.emit(ev.Phase(phase=name, edge="begin", version=self._version))
        self.phase = name
        self._crash_point(name)
        try:
            yield
        finally:
            self.phase = None
            dt = self.p.clock.now() - t0
            self._phases[name] = dt
            self.p.metrics.phase(name, dt)
            self.p.log.emit(ev.Phase(phase=name, edge="end", version=self._version, seconds=round(dt, 6)))


def _completed(plan: MembershipPlan, results: dict) -> set[tuple[int, int]]:
    """(slot, incarnation) of the participants that hold the complete new weights after one attempt."""
    return {(p.slot, p.incarnation) for p in plan.participants if results[p.slot].result is RefitResult.COMPLETE}


def _moved(tried: list[dict]) -> bool:
    """Whether any engine's live weights may have changed in these attempts: any result but ``NOT_STARTED``
    (which may count bytes received into a staging area, never applied: nothing changed there)."""
    return any(r.result is not RefitResult.NOT_STARTED for res in tried for r in res.values())


def _needed_s(cfg: Any) -> float:
    """What a retry needs of the transfer phase: the time one healthy attempt is sized for
    (``fleet.control.transfer_port.healthy_attempt_s``: a quarter of ``refit_timeout_s``). Not what the first attempt took:
    one that failed on a frozen engine ran into the receivers' bound, far longer than a retry without it needs."""
    return healthy_attempt_s(cfg)
