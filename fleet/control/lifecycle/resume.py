"""Steps 5 to 7 of a refit: commit the version, resume the engines (each stamped first), reopen.

The commit is stored first in the intent with the engines that hold the version whole (a successor stamps
exactly these and serves it), then decided (``VersionCommitted``). Each engine gets one last control call,
``end_refit``: stamped with the version if it holds it whole, else what it held across the pause is aborted
(those results would carry the old tag on the new weights; the dispatcher re-sends them); then the refit
releases its pause (an operator's ``keep`` pause keeps the engine paused past it). The gate is the health
core's to open (``RefitFinished``): the refit reads that decision and stops only where it says so.
"""

from __future__ import annotations

from typing import Any

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.lifecycle.run import EndRefit, RefitRun
from rlfleet.fleet.errors import FleetExhausted, RefitFailed
from rlfleet.fleet import wire
from rlfleet.fleet.outcome import BAD_ACK, ERROR, OK, Outcome
from rlfleet.health import AbortRefit, CallKind, KeepGateClosed, MembershipPlan, RefitFinished, StopExhausted, VersionCommitted


def commit(r: RefitRun, plan: MembershipPlan, complete: set[int]) -> None:
    """Step 5: stored first, then decided. Nothing to commit when no engine holds the version whole."""
    if not complete:
        return
    members = tuple((p.slot, p.incarnation) for p in plan.participants if p.slot in complete)
    r.p.intent.refit_committed(r.version, plan.epoch, members)
    r.p.act.decide(VersionCommitted(r.version))


async def resume(r: RefitRun, plan: MembershipPlan, paused: set[int], complete: set[int]) -> None:
    """Step 6, one call per engine (``end_refit``), under one shared deadline; never retries the transfer.
    Every paused participant is released, and every other engine this refit sent a pause to (its ack lost,
    or it left the plan since) that is still the same incarnation.

    An engine whose stamp is not acknowledged (unavailable, raised, lied) holds an unknown version from then
    on: out of routing (a probe that finds it alive brings it back stale) until a refit lands on it again
    (``CallKind.STAMP``), and the refit goes on with the others; the second failed stamp in a row evicts it
    (``health.slot_rules``). One whose call failed as a whole is a failed resume (``CallKind.RESUME``) and
    counts as not stamped."""
    parts = [p for p in plan.participants if p.slot in paused or p.slot in complete]
    handles = r.p.slots.handles
    others = _paused_outside(r, {p.slot for p in parts})
    calls: dict[Any, tuple] = {p.slot: (handles[p.slot][1], "end_refit", (),
                               {"version": r.version, "abort_held": False} if p.slot in complete else {"abort_held": True})
                               for p in parts}
    calls.update({key: (h, "end_refit", (), {"abort_held": True}) for key, h in others.items()})
    outs = await r.fan_out(calls)
    _note_resumed_outside(r, {key: resumed_outcome(outs[key]) for key in others})
    _stamped(r, [p for p in parts if p.slot in complete], outs)
    acts = r.p.act.observe_all(  # an ok resume is not fed (``observe_all``)
        CallKind.RESUME, {p.slot: (p.incarnation, o) for p in parts if (o := resumed_outcome(outs[p.slot])).kind != OK})
    aborts = [a for a in acts if isinstance(a, AbortRefit)]
    if aborts:
        raise EndRefit(RefitFailed, aborts[0].message)


async def reopen(r: RefitRun) -> None:
    """Step 7: the health core closes the refit (``RefitFinished``) and decides the gate: open if quorum
    serves the version (closed while the operator's pause holds); the refit stops with it closed only where
    that decision says so (``StopExhausted``, ``KeepGateClosed``)."""
    d = r.p.act.decide(RefitFinished(r.version))
    r.finished = True
    stop = next((a for a in d.actions if isinstance(a, (StopExhausted, KeepGateClosed))), None)
    if stop is None:
        await r.publisher.publish()  # out to clients before sync_weights returns
        return
    raise EndRefit(FleetExhausted if isinstance(stop, StopExhausted) else RefitFailed, stop.message)


def resumed_outcome(out: Outcome) -> Outcome:
    """An ``end_refit`` answer as the resume's outcome: ``resumed`` is its acknowledgement."""
    if out.kind != OK or out.value.resumed is True:
        return out
    return Outcome(BAD_ACK, value=out.value.resumed, elapsed_s=out.elapsed_s)


def _stamped(r: RefitRun, parts: list, outs: dict) -> None:
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
            ended: wire.EndRefit = out.value
            kind, error = ended.stamp or ERROR, ended.stamp_error
            failed[p.slot] = Outcome(kind, value=False if kind == BAD_ACK else None, error=error)
            r.p.act.observe(p.slot, p.incarnation, CallKind.STAMP, failed[p.slot])
        else:
            rec = r.p.slots.ledger.raw(p.slot)
            if rec.incarnation == p.incarnation and rec.stamp_failures:  # a stamp taken after one that failed
                r.p.act.observe(p.slot, p.incarnation, CallKind.STAMP, out)
    members = tuple((p.slot, p.incarnation) for p in parts if p.slot not in failed and p.slot not in unknown)
    if failed or unknown:
        r.p.intent.refit_stamped(r.version, members)

    def named(which: dict) -> list:
        return [[p.slot, p.incarnation, which[p.slot].describe()[:200]] for p in parts if p.slot in which]

    r.p.log.emit(ev.Stamp(version=r.version, members=list(members), failed=named(failed), unknown=named(unknown)))


def _paused_outside(r: RefitRun, resuming: set[int]) -> dict[tuple[int, int], Any]:
    """(slot, incarnation) -> handle of each engine this refit sent a pause to that is not resumed with the
    participants (its pause ack was lost, or it left the plan later) and is still the slot's incarnation:
    it may be paused, holding requests; resume must reach it too."""
    return {key: h for key, h in r.held.items() if key[0] not in resuming and r.p.slots.handle_of(*key) is h}


def _note_resumed_outside(r: RefitRun, outs: dict) -> None:
    """Log the resumes of engines outside the refit; one that does not answer counts as a failed probe
    (it is quarantined already, or found so): still paused, it serves nothing, and the next refit resumes it."""
    if not outs:
        return
    r.p.log.emit(ev.ResumeOutsideRefit(version=r.version, engines=[[s, i, o.kind] for (s, i), o in sorted(outs.items())]))
    failed = {s: (i, o) for (s, i), o in outs.items() if not o.ok}
    if failed:
        r.p.act.observe_all(CallKind.PROBE, failed)
