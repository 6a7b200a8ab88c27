"""Step 4 of a refit: the transfer, with its one retry, all within the phase's one deadline; and step 0,
staging the update ahead while the fleet serves (``stage_ahead``), with the apply of what staged.

On a failed first attempt: classify the failed participants (a ping), rebuild membership without the dead,
re-pause the retry's participants (engines restarted meanwhile included), retry exactly once, only to the
engines that did not complete. A shard holds partial weights only if bytes actually moved to it. An update
that does not fit the model is the trainer's fault: refused with no retry (``RollBack``); no byte reaching
any engine rolls back too. The port to the weight transport honours the deadline it is given (one place
enforces it) and rebuilds its group when asked.
"""

from __future__ import annotations

from typing import Any

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.lifecycle import pause as pause_step
from rlfleet.fleet.control.lifecycle.run import PhaseOver, RefitRun, RollBack
from rlfleet.fleet.control.transfer_port import TransferResult, healthy_attempt_s, sender_state
from rlfleet.fleet.errors import RefitNotDelivered, RefitNotStaged, RefitRefused, RefitSourceFailed
from rlfleet.health import Batch, CallKind, MembershipPlan, RefitReport, RefitResult


async def transfer(r: RefitRun, plan: MembershipPlan, source: Any, paused: set[int], ahead: Any = None):
    """Step 4. Returns the plan of the last attempt (every participant, those that completed the first
    attempt included), the engines paused for it, the slots that hold the complete new weights, and the
    number of attempts that ran (1 or 2; ``retry_skipped`` in the summary says why a retry did not run).
    Raises ``RollBack`` when no byte reached any engine. ``ahead``: the sender's plan started before the
    pause (``TransferPort.plan_ahead``), for the first attempt."""
    deadline = r.p.clock.now() + r.p.cfg.lifecycle_deadline_s  # one bound for the phase, retry included
    results = await _transfer_once(r, plan, source, rebuild=False, deadline=deadline, ahead=ahead)
    _refuse_if_the_update_does_not_fit(r, results)
    tried, done = [results], _completed(plan, results)
    r.moving = _moved(tried)  # an error before the retry rolls back if nothing moved yet
    if len(done) < len(plan.participants):
        plan, paused, retry = await _prepare_retry(r, plan, source, results, done, paused, deadline)
        if retry is not None:
            r.moving = True
            results = await _transfer_once(r, retry, source, rebuild=True, deadline=deadline)
            _refuse_if_the_update_does_not_fit(r, results)
            tried.append(results)
            done |= _completed(retry, results)
    _roll_back_if_nothing_moved(r, tried, source)
    return plan, paused, {p.slot for p in plan.participants if (p.slot, p.incarnation) in done}, len(tried)


async def stage_ahead(r: RefitRun, source: Any) -> set[tuple[int, int]]:
    """Step 0, under ``stage_ahead``: with the gate open and every engine serving, move the update into the
    staging area of every live engine; on failure classify the failed (a ping), reconcile, and stage once
    more on a rebuilt group, all within one phase deadline. Returns the (slot, incarnation) that hold the
    whole update. Nothing live changed, so every way out of here rolls back with the gate never closed: an
    update that does not fit (``RefitRefused``), fewer than ``min_healthy_engines`` staged (``RefitNotStaged``,
    naming each engine and why)."""
    deadline = r.p.clock.now() + r.p.cfg.lifecycle_deadline_s
    results: dict = {}
    staged: set[tuple[int, int]] = set()
    attempt = 0
    plan = r.p.slots.plan
    for attempt in (1, 2):
        plan = pause_step.reconcile(r)
        results = await _bounded(r, plan, deadline, lambda parts, left: r.port.stage(
            parts, r.version, plan.epoch, source, timeout=left))
        _refuse_if_the_update_does_not_fit(r, results)
        _record_transfer(r, plan.epoch, results)
        staged = {(p.slot, p.incarnation) for p in plan.participants if results[p.slot].staged}
        if len(staged) == len(plan.participants):
            break
        failed = [p for p in plan.participants if (p.slot, p.incarnation) not in staged]
        r.p.log.emit(ev.RefitFailedAttempt(version=r.version, attempt=attempt, phase="stage",
                     failed={p.slot: results[p.slot].detail[:200] for p in failed}))
        await classify_failed(r, failed)
        if r.p.clock.now() >= deadline:
            break
    r.p.log.emit(ev.Staged(version=r.version, epoch=plan.epoch, attempts=attempt,
                 members=sorted([s, i] for s, i in staged)))
    if len(staged) < r.p.cfg.min_healthy_engines:
        why = "; ".join(f"slot {p.slot} (incarnation {p.incarnation}): {results[p.slot].detail[:200]}"
                        for p in plan.participants if (p.slot, p.incarnation) not in staged)
        raise RollBack(RefitNotStaged(
            f"refit of version {r.version}: {len(staged)} engine(s) staged the update after {attempt} attempt(s), "
            f"fewer than min_healthy_engines ({r.p.cfg.min_healthy_engines}); failed: {why or 'no live engine'}. "
            f"The gate never closed; the fleet keeps serving {r.p.slots.serves()}"))
    return staged


async def apply_staged(r: RefitRun, plan: MembershipPlan, paused: set[int], staged: set[tuple[int, int]]) -> set[int]:
    """Step 4 under ``stage_ahead``: apply the staged update on the paused participants that staged it (the
    same incarnation); the others did not get it (``NOT_STARTED``: stale until the next refit). Returns the
    slots that hold the complete new weights. No retry: an apply that failed left its weights unknown."""
    deadline = r.p.clock.now() + r.p.cfg.lifecycle_deadline_s
    ready = MembershipPlan(plan.epoch, tuple(p for p in plan.participants
                                             if p.slot in paused and (p.slot, p.incarnation) in staged))
    results = await _bounded(r, ready, deadline, lambda parts, left: r.port.apply_staged(
        parts, r.version, timeout=left)) if ready.participants else {}
    for p in plan.participants:
        results.setdefault(p.slot, TransferResult(RefitResult.NOT_STARTED, "[stage] did not stage this update"))
    _report(r, plan.participants, results)
    return {s for s, res in results.items() if res.result is RefitResult.COMPLETE}


async def classify_failed(r: RefitRun, failed) -> None:
    """Find out why participants failed: dead, hung, or alive (a survivor of someone else's failure)."""
    outs = await r.fan_out({p.slot: (r.handle(p), "ping", (), {}) for p in failed}, timeout=r.p.cfg.probe_timeout_s)
    for p in failed:
        out = outs[p.slot]
        if not out.ok:
            r.p.act.observe(p.slot, p.incarnation, CallKind.REFIT, out)


# ---------------------------------------------------------------------------------- the retry
async def _prepare_retry(r: RefitRun, plan: MembershipPlan, source: Any, results: dict, done: set,
                         paused: set[int], deadline: float):
    """Before the one retry: classify the failed participants, rebuild membership, re-pause the retry's
    participants (those that failed and are alive, and engines restarted meanwhile; not those that
    completed: they stay paused and are sent nothing more). Every call here ends by ``deadline``.

    Returns the plan (the retry's participants and those that completed), the paused slots, and the
    retry's plan, or None when the retry does not run (``retry_skipped`` then says why)."""
    failed = [p for p in plan.participants if (p.slot, p.incarnation) not in done]
    r.p.log.emit(ev.RefitFailedAttempt(version=r.version, attempt=1,
                 failed={p.slot: results[p.slot].detail[:200] for p in failed}))
    with r.within(deadline):
        if deadline - r.p.clock.now() >= r.p.cfg.probe_timeout_s:  # a ping cut shorter proves no hang
            await classify_failed(r, failed)
        skip = _no_retry(r, source, results, deadline)
        repaused: set[tuple[int, int]] = set()
        if skip is None:
            repaused, skip = await _re_pause(r, done, deadline)
    fresh = pause_step.reconcile(r)  # without what died or hung in the re-pause
    kept = {(p.slot, p.incarnation) for p in plan.participants if p.slot in paused} | repaused
    paused = {p.slot for p in fresh.participants if (p.slot, p.incarnation) in kept}
    retry = [p for p in fresh.participants if (p.slot, p.incarnation) in repaused]
    if skip is None and not retry:
        skip = "no engine that failed the first attempt is alive and paused to retry"
    if skip is not None:
        r.retry_skipped = skip
        r.p.log.emit(ev.RefitRetrySkipped(version=r.version, reason=skip))
        return fresh, paused, None
    return fresh, paused, MembershipPlan(fresh.epoch, tuple(retry))


async def _re_pause(r: RefitRun, done: set, deadline: float) -> tuple[set[tuple[int, int]], str | None]:
    """Pause the retry's participants: every live one that did not complete the first attempt, engines that
    became ready meanwhile (even during this re-pause) included, as ``pause_settled`` does for the first.
    Returns the (slot, incarnation) paused, and why the retry cannot run after all (or None)."""
    repaused: set[tuple[int, int]] = set()
    asked = set(done)  # each engine is asked once; one whose pause failed was observed by ``pause``
    for _ in range(3):
        fresh = pause_step.reconcile(r)
        todo = [p for p in fresh.participants if (p.slot, p.incarnation) not in asked]
        if not todo:
            break
        asked |= {(p.slot, p.incarnation) for p in todo}
        try:
            slots = await pause_step.pause(r, fresh, skip={p.slot for p in fresh.participants} - {p.slot for p in todo})
        except PhaseOver:  # a fan-out of the re-pause found the phase over: nothing more was sent
            slots = set()
        repaused |= {(p.slot, p.incarnation) for p in todo if p.slot in slots}
        if deadline - r.p.clock.now() < healthy_attempt_s(r.p.cfg):
            return repaused, "the transfer phase's deadline passed during the re-pause"
    return repaused, None


def _no_retry(r: RefitRun, source: Any, results: dict, deadline: float) -> str | None:
    """Why the retry must not run, or None. It cannot help when the sender is dead; it cannot finish when
    less of the phase is left than an attempt needs: the time one healthy attempt is sized for
    (``healthy_attempt_s``, a quarter of ``refit_timeout_s``), not what the first attempt took (one that
    failed on a frozen engine ran into the receivers' bound, far longer than a retry without it needs)."""
    if any(res.sender_error for res in results.values()) and sender_state(r.p.door, source) == "DEAD":
        return f"the weight sender {source!r} is dead: a retry from it cannot move anything"
    left, needed = deadline - r.p.clock.now(), healthy_attempt_s(r.p.cfg)
    if left < needed:
        return (f"{max(0.0, left):.3f} s left of the transfer phase's {r.p.cfg.lifecycle_deadline_s:.1f} s, "
                f"less than a retry needs ({needed:.3f} s: a quarter of refit_timeout_s, what one attempt is sized for)")
    return None


# ---------------------------------------------------------------------------------- one attempt
async def _transfer_once(r: RefitRun, plan: MembershipPlan, source: Any, rebuild: bool, deadline: float,
                         ahead: Any = None) -> dict:
    """One transfer attempt, given what is left of the phase's ``deadline``: whoever had not finished then
    holds unknown weights (PARTIAL: never serves them, rejoins the next refit)."""
    results = await _bounded(r, plan, deadline, lambda parts, left: r.port.transfer(
        parts, r.version, plan.epoch, source, rebuild=rebuild, timeout=left, ahead=ahead))
    _report(r, plan.participants, results)
    _record_transfer(r, plan.epoch, results)
    return results


def _record_transfer(r: RefitRun, epoch: int, results: dict) -> None:
    """The ``transfer`` record of one attempt that moved the update (into live weights, or staging areas)."""
    if not results:
        return
    values = results.values()
    r.p.log.emit(ev.Transfer(version=r.version, epoch=epoch, bytes=max(res.bytes_moved for res in values),
                             delta=any(res.delta for res in values),
                             delta_refused=next((res.delta_refused for res in values if res.delta_refused), None),
                             sharded=any(res.sharded for res in values),
                             sharded_refused=next((res.sharded_refused for res in values if res.sharded_refused), None),
                             sharded_group_reused=any(res.sharded_group_reused for res in values)))


async def _bounded(r: RefitRun, plan: MembershipPlan, deadline: float, call) -> dict:
    """``call(participants, seconds_left)`` on the port, which answers by then (``TransferPort``'s contract:
    whoever had not finished at the deadline is PARTIAL, or NOT_STARTED where only a staging area moved)."""
    handles = r.p.slots.handles
    participants = [(p, handles[p.slot][1]) for p in plan.participants]
    with r.inside_shards():
        return await call(participants, max(0.0, deadline - r.p.clock.now()))


def _report(r: RefitRun, participants, results: dict) -> None:
    """What each participant holds after the transfer step, as one health decision."""
    r.p.act.decide(Batch(tuple(
        RefitReport(p.slot, p.incarnation, r.version, results[p.slot].result, results[p.slot].detail[:300])
        for p in participants
    )))


def _refuse_if_the_update_does_not_fit(r: RefitRun, results: dict) -> None:
    """An update that does not fit the model is the trainer's fault, not the engines': no retry, no engine
    marked, roll back (the engines refused it before any byte moved)."""
    refused = sorted({res.refused for res in results.values() if res.refused})
    if refused and not any(res.bytes_moved for res in results.values()):
        r.moving = False
        raise RollBack(RefitRefused(
            f"weight update for version {r.version} refused: {'; '.join(refused)[:1500]}; "
            f"the fleet keeps serving {r.p.slots.serves()}"
        ))


def _roll_back_if_nothing_moved(r: RefitRun, tried: list[dict], source: Any) -> None:
    """No engine's live weights changed in any attempt (every result ``NOT_STARTED``): nothing changed, so the
    refit rolls back like a refusal (``RollBack``), with ``RefitSourceFailed`` naming the sender when it
    failed, else ``RefitNotDelivered`` naming each engine. Returns when anything moved."""
    if _moved(tried):
        return
    r.moving = False
    v, committed, n = r.version, r.p.slots.ledger.current_version, len(tried)
    after = (f"the refit rolled back: no engine changed, they resume on version {committed} and the gate "
             f"reopens on it if quorum serves it; send version {v} again")
    sender = next((res.sender_error for attempt in reversed(tried) for res in attempt.values() if res.sender_error), None)
    if sender is not None:
        dead = " is dead: it" if sender_state(r.p.door, source) == "DEAD" else ""
        raise RollBack(RefitSourceFailed(
            f"refit of version {v}: the weight sender {source!r}{dead} failed before the update reached any engine's weights "
            f"({n} attempt(s); sender: {sender[:400]}); {after}, from a live sender"))
    why = "; ".join(f"slot {s}: {res.detail[:200]}" for s, res in sorted(tried[-1].items()))
    raise RollBack(RefitNotDelivered(
        f"refit of version {v}: no engine received any byte of the update after {n} attempt(s) ({why}); {after}"))


def _completed(plan: MembershipPlan, results: dict) -> set[tuple[int, int]]:
    """(slot, incarnation) of the participants that hold the complete new weights after one attempt."""
    return {(p.slot, p.incarnation) for p in plan.participants if results[p.slot].result is RefitResult.COMPLETE}


def _moved(tried: list[dict]) -> bool:
    """Whether any engine's live weights may have changed in these attempts: any result but ``NOT_STARTED``
    (which may count bytes received into a staging area, never applied: nothing changed there)."""
    return any(res.result is not RefitResult.NOT_STARTED for attempt in tried for res in attempt.values())
