"""``Slots``: the one owner of the fleet's slots, as the controller's collaborators see them.

Which actor each slot runs (``handles``: slot -> (incarnation, handle)), their health
(the ``health`` ledger), which serve and which are warm spares (``roles``), the refit's
membership plan, the serving size a resize sets, and what each shard said of itself when
it started (native pause, its node). Every change to these goes through a method here,
and so does every intent write about slots (an incarnation spawned, a role change, a slot
a resize removed), stored before the change is made: a restarted controller finds by
name what the intent names (``fleet.control.recovery``).

``decide(event)`` applies one health event to the ledger, logs the decision and its
transitions, and rebalances the roles; it returns the decision and carries out none of its
actions: the controller (``SingleController.decide``) is the one place that does. The
same holds for ``observed``: it kills an unusable incarnation (only that one) and returns
the health event the controller then decides.

Warm spares: a fleet with ``spare_engines: k`` runs ``size + k`` slots, which the health core
treats alike (each starts, restarts within its budget and takes part in every refit, so a
healthy spare holds the committed weights); the roles decide which get traffic. After every
decision that changed something, ``rebalance`` lets ``health.roles.rebalance`` promote a
healthy spare in place of a serving slot that is not healthy: stored in the intent first,
then logged (``promote``: the spare, the slot it replaced and why; ``demote``: a slot that
left the serving role with no spare in its place); the controller then publishes (during a
refit, when it ends). The slot a spare replaced is a spare from then on; a spare that dies is
restarted like any slot and stays a spare.

Guarantee on failure: a kill or a handle lookup never touches a slot's replacement (every
call names the incarnation); an intent write that fails raises before the change it
records is made.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rlfleet.fleet.cluster.door import Door
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.control.intent import IntentStore
from rlfleet.fleet.cluster.naming import shard_name
from rlfleet.fleet.control.nodes import NodeMap
from rlfleet.fleet.outcome import Outcome, is_unusable, observed
from rlfleet.health import CallKind, Decision, Ledger, MembershipPlan, SlotPhase, step
from rlfleet.health.roles import Rebalanced, Roles, rebalance
from rlfleet.fleet import records as ev
from rlfleet.fleet.wire import Description, Started


class Slots:
    def __init__(self, ledger: Ledger, size: int, *, name: str, door: Door, log: EventLog, intent: IntentStore,
                 now: Callable[[], float], engine: Any) -> None:
        self.ledger = ledger
        self.size = size  # slots that serve when all is well (``num_engines``; a resize sets it); the rest are spares
        self.roles = Roles.initial(size)
        self.handles: dict[int, tuple[int, Any]] = {}
        self.revision = 0  # grows with every change of ``handles`` (the publisher caches members by it)
        self.plan = MembershipPlan.initial()
        self.native_pause: dict[int, bool] = {}
        self.nodes = NodeMap()  # which Ray node each shard runs on (``fleet.control.nodes``)
        self.launching: dict[int, Any] = {}  # slot -> the task launching it (``fleet.control.reconcile``)
        self._name, self._door, self._log, self._intent, self._now, self._engine = name, door, log, intent, now, engine

    # ------------------------------------------------------------------ reads
    def handle_of(self, slot: int, incarnation: int):
        """The actor of ``incarnation`` of ``slot`` if it is still the slot's current one, else None."""
        current = self.handles.get(slot)
        return current[1] if current is not None and current[0] == incarnation else None

    def live_handles(self) -> dict[int, tuple[int, Any]]:
        """slot -> (incarnation, handle) of every engine that is up (serving or stale)."""
        handles = self.handles
        return {s: handles[s] for s in self.ledger.live_slots() if s in handles}  # live == healthy or stale

    def current_incarnations(self) -> dict[int, int]:
        """slot -> incarnation of every handle that is its slot's current incarnation."""
        ledger = self.ledger
        return {s: inc for s, (inc, _) in self.handles.items() if inc == ledger.raw(s).incarnation}

    def serving_slots(self) -> list[int]:
        """The slots that get traffic: HEALTHY (on the committed version) and in the serving role."""
        return [s for s in self.ledger.serving_slots() if s in self.roles.serving]

    def serving(self) -> Sequence[tuple[int, int, Any]]:
        """(slot, incarnation, handle) of every serving slot whose handle is its current incarnation."""
        out = []
        for slot in self.serving_slots():
            inc, handle = self.handles[slot]
            if inc == self.ledger.raw(slot).incarnation:
                out.append((slot, inc, handle))
        return out

    def role_rows(self, rows: list[dict]) -> list[dict]:
        """``Ledger.to_dict()``'s slot rows with each slot's ``role`` (``serving`` or ``spare``)."""
        return [{**row, "role": self.roles.role(row["slot"])} for row in rows]

    def serves(self) -> str:
        """What the fleet serves, for a refusal's message: always a version (or why there is none)."""
        committed = self.ledger.current_version
        return "no committed version yet" if committed is None else f"version {committed}"

    # ------------------------------------------------------------------ health
    def decide(self, event) -> Decision:
        """Apply ``event`` to the ledger and log the decision; rebalance the roles if anything changed.
        Returns the decision: its actions are the controller's to carry out."""
        d = step(self.ledger, event, self._now())
        self._log.emit(ev.Decision(event=type(event).__name__, failure=d.failure.value, reason=d.reason))
        self._log.emit_rows(ev.Health, d.transitions)  # per transition: slot, incarnation, before, after, reason
        if d.transitions or d.actions:
            self.rebalance()
        return d

    def observed(self, slot: int, incarnation: int, call: CallKind, outcome: Outcome):
        """The health event of one settled call; a dead or unusable incarnation is killed first, and only it
        (a late report about a replaced incarnation never touches its replacement)."""
        if is_unusable(outcome):
            self.kill(slot, incarnation, f"{call.value} found it unusable: {outcome.describe()[:200]}")
        return observed(slot, incarnation, call, outcome)

    def rebalance(self) -> Rebalanced | None:
        """A healthy spare takes the place of a serving slot that is not healthy (``health.roles``); the change
        is stored in the intent first, then logged (``promote``/``demote``). None: no role can change."""
        ledger, size, roles = self.ledger, self.size, self.roles
        every = len(roles.serving) == ledger.num_slots == size and max(roles.serving, default=-1) == size - 1
        if every and not ledger.phase_count(SlotPhase.RETIRED):
            return None  # no spare, no retired slot: every slot serves and no role can change
        out = rebalance(roles, {s: ledger.state(s) for s in range(ledger.num_slots)}, size)
        if out.roles is roles:
            return out
        self._intent.roles(tuple(out.roles.to_list()))  # stored before routing follows it
        self.roles = out.roles
        for p in out.promotions:
            replaced = {} if p.replaced is None else {
                "replaced": p.replaced, "replaced_incarnation": ledger.raw(p.replaced).incarnation}
            self._log.emit(ev.Promote(slot=p.spare, incarnation=ledger.raw(p.spare).incarnation, **replaced,
                           reason=p.reason, serving=out.roles.to_list()))
        for d in out.demotions:
            self._log.emit(ev.Demote(slot=d.slot, incarnation=ledger.raw(d.slot).incarnation, reason=d.reason,
                           serving=out.roles.to_list()))
        return out

    # ------------------------------------------------------------------ actors
    def spawn(self, slot: int, incarnation: int):
        """Spawn ``incarnation`` of ``slot`` (stored in the intent first: a successor finds it by name)."""
        self._intent.spawned(slot, incarnation, self.ledger.raw(slot).restarts)
        handle = self._door.spawn_shard(self._engine, slot, incarnation, 0,
                                        name=shard_name(self._name, slot, incarnation))
        self.handles[slot] = (incarnation, handle)
        self.revision += 1
        return handle

    def kill(self, slot: int, incarnation: int, reason: str) -> None:
        """Kill ``incarnation`` of ``slot`` if it is still the slot's current actor; never its replacement."""
        current = self.handles.get(slot)
        if current is not None and current[0] == incarnation:
            self._door.kill(current[1])
            self._log.emit(ev.Kill(slot=slot, incarnation=incarnation, reason=reason))

    def fence_by_name(self, slot: int, incarnation: int, recorded: int, reason: str) -> bool:
        """Kill the shard actor named for ``incarnation`` of ``slot`` if one is alive (a restarted controller
        fencing what its intent does not want serving: ``recorded`` is the incarnation it did record)."""
        handle = self._door.find(shard_name(self._name, slot, incarnation)) if incarnation >= 1 else None
        if handle is None:
            return False
        self._door.kill(handle)
        self._log.emit(ev.AdoptFence(slot=slot, incarnation=incarnation, recorded=recorded, reason=reason))
        return True

    def note_started(self, slot: int, incarnation: int, info: Started | Description) -> None:
        """What a shard said of itself when it started (or was re-adopted): native pause, its node."""
        self.native_pause[slot] = info.native_pause
        self.nodes.place(slot, incarnation, info.node)

    def remove(self, removed: dict[int, int]) -> None:
        """Slots a resize removes (slot -> incarnation): stored in the intent first (a successor fences them
        and never serves them again), and any launch under way is cancelled (it would bring one back)."""
        self._intent.removed(removed)
        for slot in removed:
            task = self.launching.pop(slot, None)
            if task is not None:
                task.cancel()

    def forget(self, slot: int, incarnation: int, reason: str) -> None:
        """A removed slot: its actor killed (if still the slot's), its handle and what it said of itself dropped."""
        self.kill(slot, incarnation, reason)
        if slot in self.handles:
            del self.handles[slot]
            self.revision += 1
        self.native_pause.pop(slot, None)
        self.nodes.forget(slot)

    def adopt(self, ledger: Ledger, size: int, serving_roles: Sequence[int] | None, plan: MembershipPlan,
              handles: dict[int, tuple[int, Any]]) -> None:
        """A restarted controller takes over its predecessor's slots: the ledger rebuilt from the intent, the
        serving size and roles it stored (the initial ones if it stored none), its membership epoch, and the
        recorded incarnations found alive."""
        self.ledger, self.size = ledger, size
        self.roles = Roles.restore(serving_roles, size)
        self.plan = plan
        self.handles = dict(handles)
        self.revision += 1

    def drop_all(self) -> None:
        """Every shard is gone (a shutdown finished): no handle is kept."""
        self.handles = {}
        self.revision += 1
