"""Steps 1 to 3 of a refit: close the gate, reconcile membership, pause the participants.

Each participant gets one control call, ``begin_refit`` with its pause: it refuses work routed before the
gate closed, aborts the requests whose version policy the new version would break (their clients re-send
them) and pauses, keeping the rest in flight; from then on the refit owns its pause
(``fleet.shard.pause_holds``). A backend with no native pause gets the three calls in order, and must
confirm a cache invalidation where the policy clears the cache, or the refit stops. Every call settles
before any result is acted on; a failed pause is a health observation, and the health core's
``AbortRefit`` ends the refit (``EndRefit``).
"""

from __future__ import annotations

import asyncio
from typing import AbstractSet

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.lifecycle.run import EndRefit, RefitRun
from rlfleet.fleet.errors import CacheInvalidationUnsupported, FleetExhausted, RefitFailed
from rlfleet.fleet.outcome import BAD_ACK, OK, Outcome
from rlfleet.fleet.wire import BeginRefit
from rlfleet.health import AbortRefit, CallKind, MembershipPlan, RefitStarted, plan_membership


async def close_gate(r: RefitRun) -> int:
    """Step 1: stored first (the intent), then the health core closes the gate (``RefitStarted``), published
    at once: clients hold new requests, nothing is dropped. Returns the routing epoch of the closed gate."""
    r.p.intent.refit_begun(r.version)  # stored before anything changes: if it raises, nothing did
    r.holding = True
    r.p.admission.refit_started()  # the engines pause (and may reset their cache): not load signals
    r.p.act.decide(RefitStarted(r.version))
    return await r.publisher.fence_for_refit()


def reconcile(r: RefitRun) -> MembershipPlan:
    """Step 2: settle membership from the ledger; a changed participant set is a new epoch."""
    old = r.p.slots.plan
    plan = plan_membership(r.p.slots.ledger, old)
    if plan.epoch != old.epoch:
        r.p.log.emit(ev.Epoch(epoch=plan.epoch, previous=old.epoch,
                              participants=[(p.slot, p.incarnation, p.rank) for p in plan.participants]))
    r.p.slots.plan = plan
    if not plan.participants:
        raise EndRefit(FleetExhausted, f"refit of version {r.version}: no live engine to take part")
    return plan


async def pause(r: RefitRun, plan: MembershipPlan, skip: AbstractSet[int] = frozenset(),
                fence_others: bool = False) -> set[int]:
    """Step 3, one call per participant (``begin_refit`` with its pause). With ``fence_others`` (the refit's
    first pause) every other engine (quarantined, starting) is fenced too, bounded like a probe: one that
    never heard it left the serving set must not admit work routed before this refit; a later pause (an
    engine that joined, the transfer's re-pause) does not wait on them again. All calls settle first.
    Returns the slots paused (``skip``: the participants paused already, left alone)."""
    version, epoch = r.version, r.fence_epoch
    targets = {p.slot: p for p in plan.participants if p.slot not in skip}
    handles = r.p.slots.handles
    native = r.p.slots.native_pause
    emulated = {s: p for s, p in targets.items() if native.get(s, True) is False}
    members = {p.slot for p in plan.participants}
    others = {(s, i): h for s, (i, h) in handles.items() if s not in members} if fence_others else {}
    fused = {s: (handles[s][1], "begin_refit", (epoch, version), {"pause": pause_kw(r)})
             for s in targets if s not in emulated}
    outs, fenced, emulated_outs = await asyncio.gather(
        r.fan_out(fused),
        r.fan_out({key: (h, "fence", (epoch,), {}) for key, h in others.items()}, timeout=r.p.cfg.probe_timeout_s),
        _pause_emulated(r, emulated))
    unfenced = sorted([s, i, o.kind] for (s, i), o in fenced.items() if not o.ok)
    if unfenced:  # it answers nothing, so it admits nothing either; its leave notice is still being retried
        r.p.log.emit(ev.FenceFailed(version=version, epoch=epoch, engines=unfenced))
    outs = {s: _paused_outcome(r, s, o) for s, o in outs.items()}
    outs.update(emulated_outs)
    _warn_keep_if_busy(r)
    failed = {s: (targets[s].incarnation, out) for s, out in outs.items() if out.kind != OK}
    acts = r.p.act.observe_all(CallKind.PAUSE, failed)  # an ok pause is not fed (``observe_all``)
    aborts = [a for a in acts if isinstance(a, AbortRefit)]
    paused = {s for s in outs if s not in failed}
    for slot in outs:  # every engine a pause was sent to: one whose ack was lost may have paused all the same
        r.held[(slot, targets[slot].incarnation)] = handles[slot][1]
    if aborts:
        raise EndRefit(RefitFailed, aborts[0].message)
    return paused


async def pause_settled(r: RefitRun, plan: MembershipPlan) -> tuple[MembershipPlan, set[int]]:
    """Pause until the plan's participants are exactly the paused, live engines. A participant that died
    while pausing leaves the plan (a new epoch without it); an engine that became ready meanwhile joins it
    and is paused too."""
    paused = await pause(r, plan, fence_others=True)
    for _ in range(3):
        fresh = reconcile(r)
        members = {p.slot for p in fresh.participants}
        if members <= paused:
            return fresh, paused & members
        paused = (paused & members) | await pause(r, fresh, skip=paused & members)
        plan = fresh
    return plan, paused


def pause_kw(r: RefitRun) -> dict:
    """How a participant pauses under the fleet's ``kv_policy``: ``recompute`` clears the KV cache; ``keep``
    clears it only on a shard idle once the too-old requests are aborted (free, and it drops prefix blocks
    the old weights computed); ``salt`` keeps it (new requests get a new salt)."""
    policy = r.p.cfg.kv_policy
    return {"mode": "keep", "clear_cache": policy == "recompute", "clear_if_idle": policy == "keep"}


def _paused_outcome(r: RefitRun, slot: int, out: Outcome) -> Outcome:
    """A ``begin_refit`` answer as the pause's outcome: its staleness aborts and what it holds recorded,
    ``paused`` as the acknowledgement (anything but True is a lie)."""
    if out.kind != OK:
        return out
    began: BeginRefit = out.value
    _began(r, slot, began)
    return out if began.paused is True else Outcome(BAD_ACK, value=began.paused, elapsed_s=out.elapsed_s)


def _began(r: RefitRun, slot: int, began: BeginRefit) -> None:
    r.aborted += began.aborted
    if began.in_flight:
        r.busy[slot] = began.in_flight


async def _pause_emulated(r: RefitRun, targets: dict) -> dict:
    """The participants whose backend has no native pause (none of vLLM's): fence and abort the too old,
    then confirm a cache invalidation where the policy clears it (or the refit stops), then pause (the
    refit's pause): three calls, in order."""
    if not targets:
        return {}
    handles = r.p.slots.handles
    began = await r.fan_out({s: (handles[s][1], "begin_refit", (r.fence_epoch, r.version), {}) for s in targets})
    for s, o in began.items():
        if o.kind == OK:
            _began(r, s, o.value)
    clear = _clear_cache(r, targets)
    await _invalidate_without_native_pause(r, {s: p for s, p in targets.items() if clear[s]})
    return await r.fan_out({s: (handles[s][1], "pause", (), {"mode": "keep", "clear_cache": clear[s], "owner": "refit"})
                            for s in targets}, expect_ack=True)


def _clear_cache(r: RefitRun, slots) -> dict[int, bool]:
    """slot -> whether pausing it clears its KV cache (the emulated pause, decided here from what each held at
    ``begin_refit``; a native pause decides it on the shard, ``pause_kw``): under ``keep``, only an idle
    shard clears."""
    policy = r.p.cfg.kv_policy
    if policy != "keep":
        return dict.fromkeys(slots, policy == "recompute")
    return {s: s not in r.busy for s in slots}


def _warn_keep_if_busy(r: RefitRun) -> None:
    if r.busy and r.p.cfg.kv_policy == "keep" and r.p.cfg.engine.enable_prefix_caching:
        r.warn_once(
            "kv_policy='keep' with requests in flight during a refit: later requests may reuse "
            "prefix-cache blocks computed by the old weights (use 'recompute' or 'salt' to avoid this)"
        )


async def _invalidate_without_native_pause(r: RefitRun, targets: dict) -> None:
    """A backend without native pause must confirm an equivalent cache invalidation, or the refit stops."""
    native = r.p.slots.native_pause
    if False not in native.values():  # every engine pauses natively (the common case: no per-shard look)
        return
    emulated = {s: p for s, p in targets.items() if not native.get(s, True)}
    if not emulated:
        return
    outs = await r.fan_out({s: (r.handle(p), "invalidate_cache", (), {}) for s, p in emulated.items()},
                           expect_ack=True)
    failed = sorted(s for s, o in outs.items() if not o.ok)
    if failed:
        message = (
            f"kv_policy={r.p.cfg.kv_policy!r} needs the KV cache cleared at pause, but slot(s) {failed} "
            f"have no native pause and did not confirm a cache invalidation "
            f"({'; '.join(outs[s].describe() for s in failed)})"
        )
        raise EndRefit(CacheInvalidationUnsupported, message)
