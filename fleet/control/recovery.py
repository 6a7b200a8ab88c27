"""Re-adoption: what a controller that Ray restarted does before it answers anything.

The dead controller left its intent in Ray's key-value store (``fleet.control.intent``) and its
shards running as named, detached actors (``fleet.cluster.naming``). The new one:

1. reads the intent and counts itself one generation later (routing epochs of this
   generation start above every epoch of the last: clients adopt the new states, and
   shards raise their floors to them);
2. finds each slot's recorded incarnation by name and fences what is not it: a
   neighbouring incarnation that is still alive (replaced, or spawned after the last
   write) is killed, and so is any engine left of a slot a resize removed;
3. if the intent holds a shutdown marker, finishes the shutdown (nothing orphaned) and
   stays stopped; if the fleet had stopped, it stays stopped;
4. asks every found shard what it is (``EngineShard.describe``): incarnation, stamped
   version, ``dirty`` (a transfer wrote into its weights since that stamp), paused;
   takes every shard out of routing (``set_route(member=False)``) until step 7;
5. rebuilds the health ledger at the recorded incarnations and restarts spent, and
   the roles (which slots serve, which are warm spares) as recorded; a missing shard
   is dead (the health core restarts it within its budget); one still starting stays
   launching, and the reconcile (``fleet.control.reconcile``) watches its start to its end,
   as it launches every other engine, once the ledger is settled;
6. settles the weights. A refit that had committed (``committed`` phase) is finished:
   the engines it lists that are still there are stamped with the committed version.
   Only a shard stamped with the committed version and not dirty serves it; every other
   shard (dirty: unknown weights, or on an older version) is stale and joins the next
   refit. Requests held by a shard that will not serve are aborted (their clients
   re-send them); a pause the dead controller's refit owned is released, then every
   engine is left as the stored operator's pause says: under ``keep`` paused with its
   requests kept until ``resume``, otherwise running;
7. commits the version in the ledger and reopens the gate only with quorum (mixed or
   too few: it stays closed until the next ``sync_weights``), then publishes.

Every call to a shard in steps 4 to 7 is bounded by ``probe_timeout_s``, one round at a time
(``FleetConfig.adoption_bound_s`` bounds the whole; the config refuses one that clients would not
wait for): a shard that fails or hangs in a round is evicted at the end (killed, counted dead, its
slot restarted within its budget), never waited on. Clients wait ``controller_restart_wait_s``.

Every step is one record in the event log (``controller_restarted``, ``adopt_fence``,
``adopt``, ``adopted``).
"""

from __future__ import annotations

from typing import Any

from rlfleet.fleet.control.intent import COMMITTED
from rlfleet.fleet.cluster.naming import shard_name
from rlfleet.fleet.outcome import DIED, Outcome
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.publisher import RoutingPublisher
from rlfleet.fleet.control.resize import adopted_ledger, fence_removed
from rlfleet.health import (
    CallKind,
    EngineReady,
    MembershipPlan,
    OperatorPaused,
)
from rlfleet.fleet import records as ev
from rlfleet.fleet.wire import Description

EPOCHS_PER_GENERATION = 1 << 40


async def adopt(p: Parts, publisher: RoutingPublisher) -> dict:
    """Re-adopt the shards of the controller this one replaced; returns what it found and did (the controller
    keeps it as ``recovered``; ``generation``: this controller's). Load the target from the intent, find the named
    shards, settle the ledger; then the reconcile launches what is missing and watches what was starting."""
    with p.reconciler.held():
        recovered = await _adopt(p, publisher)
    p.reconciler.launch_missing()
    return recovered


async def _adopt(p: Parts, publisher: RoutingPublisher) -> dict:
    intent = p.intent.load()
    t0 = p.clock.now()
    if intent is None:
        p.act.halt("controller restarted but found no stored intent for fleet "
                   f"{p.name!r}: its shards cannot be re-adopted")
        return {"intent": False}
    generation = intent.generation + 1
    p.intent.adopted(intent, generation)
    p.log.emit(ev.ControllerRestarted(fleet=p.name, generation=generation, committed=intent.committed,
              refit=None if intent.refit is None else [intent.refit.version, intent.refit.phase],
              shutdown=intent.shutdown, stopped=intent.stopped))
    publisher.start_above(generation * EPOCHS_PER_GENERATION)
    found, fenced = _find_shards(p, intent)
    fenced += fence_removed(p, intent)  # a resize removed them: nothing of theirs may serve again
    if intent.shutdown:
        return await _finish_shutdown(p, publisher, generation, found, fenced, t0)

    ledger, size = adopted_ledger(p, intent)  # every slot it had (a resize may have grown or shrunk it)
    # the roles before any decision (a rebalance reads them); the next refit forms a new epoch (fresh group)
    p.slots.adopt(ledger, size, intent.serving_roles, MembershipPlan(intent.membership_epoch, ()),
                  {slot: (intent.slots[slot][0], h) for slot, h in found.items()})
    failed: dict[int, str] = {}  # slot -> the adoption call it failed: evicted below, never waited on again
    described = await _round(p, "describe", {s: (h, "describe", (), {}) for s, h in found.items()}, failed)
    # out of routing until the state below is published: nothing routed under the old controller runs
    await _round(p, "set_route", {s: (h, "set_route", (publisher.current.epoch, False, intent.committed), {})
                                    for s, h in found.items()}, failed)
    alive, starting = _sort_found(p, intent, found, described, failed)
    if intent.stopped:
        p.act.halt(intent.stopped)
    stamped = await _finish_commit(p, intent, alive, failed)
    serving = {s for s, info in alive.items()
               if (s in stamped or (info.weight_version == intent.committed and not info.dirty))}
    paused = {s for s, info in alive.items() if info.paused}
    held = {s for s in paused if s not in serving and alive[s].in_flight}
    aborts = await _round(p, "abort_in_flight", {s: (found[s], "abort_in_flight", (), {}) for s in held}, failed)
    resumed = await _resume_to_intent(p, intent, found, alive, failed)
    serving -= set(failed)
    for slot in sorted(alive):
        info = alive[slot]
        p.log.emit(ev.Adopt(slot=slot, incarnation=info.incarnation, weight_version=info.weight_version,
                     dirty=info.dirty, paused=info.paused, serves=slot in serving,
                     stamped=slot in stamped, aborted=aborts[slot].value if slot in aborts and aborts[slot].ok else 0,
                     resumed=resumed[slot].ok if slot in resumed else None, failed=failed.get(slot)))
    if intent.paused is not None:  # the stored pause holds before the commit below would open the gate
        p.act.decide(OperatorPaused(intent.paused))
    p.reconciler.land(intent.committed, {s: p.slots.handles[s][0] for s in serving},
                      "re-adopted: holds the committed version", hold_without_quorum=True)
    for slot in starting:  # launching at the recorded incarnation, its handle found: the reconcile watches it
        p.log.emit(ev.Adopt(slot=slot, incarnation=intent.slots[slot][0], starting=True))
    alive = {s: info for s, info in alive.items() if s not in failed}
    for slot, (inc, _) in sorted(intent.slots.items()):
        if slot not in alive and slot not in starting:  # gone, hung, or not the recorded incarnation: dead
            why = failed.get(slot) or (described[slot].describe() if slot in described else "no actor of that name")
            _evict(p, slot, inc, why, hung=slot in failed)
    await p.act.poll_admission()  # caps sized from the engines before clients route on the new state
    await publisher.publish()
    finished = intent.refit.version if intent.refit is not None and intent.refit.phase == COMMITTED else None
    recovered: dict[str, Any] = {
        "intent": True, "generation": generation, "committed": intent.committed,
        "refit": None if intent.refit is None else [intent.refit.version, intent.refit.phase],
        "finished_refit": finished, "alive": sorted(alive), "serving": sorted(serving),
        "stale": sorted(set(alive) - serving), "starting": sorted(starting), "roles": p.slots.roles.to_list(),
        "missing": sorted(set(intent.slots) - set(alive) - set(starting)),
        "fenced": fenced, "stamped": sorted(stamped), "evicted": dict(sorted(failed.items())),
        "gate_open": p.gate.is_open, "gate_reason": None if p.gate.is_open else p.gate.reason,
        "seconds": round(p.clock.now() - t0, 3), "bound_s": p.cfg.adoption_bound_s,
    }
    p.log.emit(ev.Adopted(**recovered))
    return recovered


def _sort_found(p: Parts, intent, found: dict[int, Any], described: dict, failed: dict[int, str]):
    """(alive: slot -> what it said of itself, starting: slot -> handle) among the slots' recorded incarnations;
    an alive one is ready in the ledger from here on."""
    alive: dict[int, Description] = {}
    starting: dict[int, Any] = {}
    for slot, (inc, _) in sorted(intent.slots.items()):
        out = described.get(slot)
        info = out.value if out is not None and out.ok and slot not in failed else None
        if not isinstance(info, Description) or info.incarnation != inc:
            continue  # gone, or not the recorded incarnation: evicted below
        if info.state == "ready":
            alive[slot] = info
            p.slots.note_started(slot, inc, info)
            p.act.decide(EngineReady(slot, inc))
        elif info.state in ("new", "starting"):
            starting[slot] = found[slot]  # a restart the predecessor began: wait for its engine, then it is ready
    return alive, starting


async def _resume_to_intent(p: Parts, intent, found: dict[int, Any], alive: dict[int, Description],
                            failed: dict[int, str]) -> dict:
    """Leave every live engine paused or running as the stored intent says. A pause the dead controller's refit
    owns is released (``end_refit``, no stamp: the commit above stamped what it could); then, under a stored
    ``keep`` pause, every engine is paused for the operator, requests kept (it holds past this re-adoption,
    until ``resume``), and otherwise every engine still paused is resumed. Returns slot -> the outcome of the
    call that left it running or paused."""
    keep = intent.paused == "keep"
    owned = {s for s, info in alive.items() if info.refit_hold is not None}
    released = await _round(p, "resume (end_refit: the dead refit's pause released)",
                            {s: (found[s], "end_refit", (), {}) for s in owned}, failed)
    still = {s for s, info in alive.items() if s not in owned and (info.paused or info.operator_hold)}
    still |= {s for s, o in released.items() if o.ok and o.value.paused_for == "operator"}
    if keep:
        outs = await _round(p, "keep pause", {s: (found[s], "pause", ("keep", False), {}) for s in alive}, failed,
                            expect_ack=True)
    else:
        outs = await _round(p, "resume", {s: (found[s], "resume", (), {}) for s in still}, failed, expect_ack=True)
    return {**released, **outs}


async def _round(p: Parts, phase: str, calls: dict[int, tuple], failed: dict[int, str], expect_ack: bool = False) -> dict[int, Outcome]:
    """One round of re-adoption calls, each bounded by ``probe_timeout_s`` (``FleetConfig.adoption_bound_s``
    counts the rounds). A slot whose call fails (hangs, dies, lies) is put in ``failed`` with what it failed,
    and no later round calls it: it is evicted at the end of re-adoption."""
    calls = {s: c for s, c in calls.items() if s not in failed}
    bound = p.cfg.probe_timeout_s
    outs = await p.door.fan_out(calls, timeout=bound, expect_ack=expect_ack)
    for slot, out in outs.items():
        if not out.ok:
            failed[slot] = f"{phase} failed within the adoption round's bound ({bound:g} s): {out.describe()[:200]}"
    return outs


def _evict(p: Parts, slot: int, incarnation: int, why: str, hung: bool) -> None:
    """The slot's recorded shard is gone, or failed a re-adoption call: it is dead (killed first if it is
    still there; ``observe`` fences it) and its slot restarts within its budget."""
    what = "failed a re-adoption call: evicted" if hung else "not found alive when the restarted controller re-adopted the fleet"
    p.act.observe(slot, incarnation, CallKind.START, Outcome(DIED, error=RuntimeError(
        f"slot {slot} (incarnation {incarnation}) {what}: {why[:300]}")))


def _find_shards(p: Parts, intent) -> tuple[dict[int, Any], list]:
    """slot -> handle of the recorded incarnation (when alive); kill the neighbours that are not it."""
    found: dict[int, Any] = {}
    fenced = []
    for slot, (inc, _) in sorted(intent.slots.items()):
        handle = p.door.find(shard_name(p.name, slot, inc))
        if handle is not None:
            found[slot] = handle
        for other in (inc - 1, inc + 1):
            if p.slots.fence_by_name(slot, other, inc, "an incarnation other than the recorded one: killed"):
                fenced.append([slot, other])
    return found, fenced


async def _finish_commit(p: Parts, intent, alive: dict[int, Description], failed: dict[int, str]) -> set[int]:
    """A refit that committed before the controller died: stamp the engines it lists (still there,
    same incarnation). Returns the slots stamped now; one whose stamp fails is in ``failed``."""
    refit = intent.refit
    if refit is None or refit.phase != COMMITTED or refit.version != intent.committed:
        return set()
    todo = {slot: p.slots.handles[slot][1] for slot, inc in refit.complete
            if slot in alive and slot not in failed and alive[slot].incarnation == inc
            and alive[slot].weight_version != refit.version}
    outs = await _round(p, "stamp", {s: (h, "set_weight_version", (refit.version,), {}) for s, h in todo.items()},
                        failed, expect_ack=True)
    return {s for s, o in outs.items() if o.ok}


async def _finish_shutdown(p: Parts, publisher: RoutingPublisher, generation: int, found: dict[int, Any],
                           fenced: list, t0: float) -> dict:
    """The controller died inside ``shutdown``: shut down and kill every shard it can find, then stay stopped."""
    p.act.halt("controller shut down (finished by the restarted controller)", shutdown=True)
    # bounded like re-adoption (clients wait for it): a shard that does not finish in time is killed below
    outs = await p.door.fan_out({s: (h, "shutdown", (), {}) for s, h in found.items()}, timeout=p.cfg.adoption_bound_s)
    for handle in found.values():
        p.door.kill(handle)
    p.slots.drop_all()
    await publisher.publish()
    p.intent.clear()
    recovered: dict[str, Any] = {"intent": True, "generation": generation, "shutdown_finished": True,
                                 "shards": {s: o.kind for s, o in outs.items()}, "fenced": fenced,
                                 "seconds": round(p.clock.now() - t0, 3)}
    p.log.emit(ev.Adopted(**recovered))
    p.log.emit(ev.Phase(phase="shutdown", edge="end", shards={s: o.kind for s, o in outs.items()}))
    return recovered
