"""``SingleController``: owns the engine shards, the dispatch gate, and the health ledger.

The controller is a plain class (``fleet.api.Fleet.start`` makes it an async Ray
actor through the door; unit tests drive it in-process with a fake door and fake shards). It
never decides on its own how to react to a failure: it turns every observed
outcome into a ``health`` event, applies ``health.step``'s decision, logs the
reason, and carries out the actions (probe, evict, restart, retire, stop). The
weight-update lifecycle lives in ``fleet.control.lifecycle``. It is the control plane only:
it publishes the routing state (``fleet.control.publisher``) and clients
(``fleet.data.client``) send requests straight to the shards; a client reports a
shard's failure with ``report_failure``.

Guarantees: the gate is open only while quorum serves the committed version, and
closing it is published at once and fences the shards; after an unrecovered
failure the gate stays closed and the error names the shards.
"""

from __future__ import annotations

import asyncio
from types import MappingProxyType
from typing import Any, Mapping

from rlfleet.fleet.control.admission import AdmissionController
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.config.fleet import FleetConfig, load_fleet_config
from rlfleet.fleet.control.dispatch_gate import DispatchGate
from rlfleet.fleet.control.reconcile import Reconciler
from rlfleet.fleet.control.loops import LoopFaults, run_loop
from rlfleet.fleet.control.intent import COMMITTED, Intent, IntentStore
from rlfleet.fleet.control.monitor import LivenessMonitor
from rlfleet.fleet.control.metrics import FleetMetrics, RunMeter, shard_load, shard_rows
from rlfleet.fleet.control.lifecycle import RefitLifecycle
from rlfleet.fleet.cluster.naming import new_fleet_name
from rlfleet.fleet.outcome import DIED, ERROR, TIMED_OUT, UNUSABLE, Outcome
from rlfleet.fleet.control.nodes import NodeMap
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.publisher import RoutingPublisher
from rlfleet.fleet.control.refit_resends import RefitResends
from rlfleet.fleet.data.routing_state import RoutingState
from rlfleet.fleet.control.slots import Slots
from rlfleet.health import (
    Batch,
    CallKind,
    Decision,
    EngineReady,
    Evict,
    Halted,
    Ledger,
    MembershipPlan,
    MonotonicClock,
    Probe,
    Readmit,
    Restart,
    Retire,
    SlotPhase,
    StopExhausted,
)
from rlfleet.fleet import records as ev
from rlfleet.fleet.control.operator_pause import OperatorPause
from rlfleet.fleet.control.controller_faults import ControllerFaults
from rlfleet.fleet.control.readmission import Readmissions

TIMER_INTERVAL_S = 0.2


class SingleController(ControllerFaults):
    """The fleet's control plane. Call ``start()`` once, then ``sync_weights``; clients follow ``watch_routing``."""

    def __init__(self, config: dict | FleetConfig, door: Any = None, clock: Any = None, transfer: Any = None) -> None:
        self.cfg = load_fleet_config(config)
        self.name = self.cfg.name or new_fleet_name()
        self.clock = clock or MonotonicClock()
        self.log = EventLog(self.cfg.event_log_path, clock=self.clock.now)
        if door is None:
            from rlfleet.fleet.cluster.ray_door import RayDoor

            door = RayDoor()
        self.door = door
        self.intent = IntentStore(door, self.name, report=self._intent_failed)
        # the slots' one owner: handles, ledger, roles, the membership plan, and the intent writes about them
        self.slots = Slots(Ledger(self.cfg.health_config(), now=self.clock.now()), self.cfg.num_engines,
                           name=self.name, door=door, log=self.log, intent=self.intent, now=self.clock.now,
                           engine=self.cfg.engine)
        self.metrics = FleetMetrics(enabled=self.cfg.metrics)
        self.meter = RunMeter(self.clock.now())  # one run step: from one committed refit to the next
        self.gate = DispatchGate(self.log, ledger=lambda: self.slots.ledger, on_change=self._gate_changed)
        self.admission = AdmissionController(self.cfg.admission, operator_pause=lambda: self.slots.ledger.operator_pause)
        self.parts = Parts(self.cfg, self.name, self.clock, self.log, door, self.slots, self.intent, self.gate,
                           self.admission, self.metrics, act=self)
        self.publisher = RoutingPublisher(self.parts, holding=lambda: self.lifecycle.holding)
        self.monitor = LivenessMonitor(self.parts, holding=lambda: self.lifecycle.holding,
                                       epoch=lambda: self.publisher.current.epoch)
        self.lifecycle = RefitLifecycle(self.parts, self.publisher, transfer, crash_point=lambda p: self.crash_point(p))
        self.operator_pause = OperatorPause(self.parts, self.publisher)
        self.readmissions = Readmissions(self.parts, busy=lambda: self.lifecycle.lock.locked())
        self.parts.readmissions = self.readmissions
        self.reconciler = Reconciler(self.parts, busy=lambda: self.lifecycle.lock.locked())
        self.parts.reconciler = self.reconciler
        self._tasks: set[asyncio.Task] = set()
        self.refits: list[dict] = []
        self.resends = RefitResends()  # recent refits by the caller's id: a re-sent refit gets its own end
        self.generation = 0  # times this fleet's controller was restarted
        # Ray restarted this actor after its process died: the first call re-adopts the live shards.
        self._must_adopt = bool(getattr(door, "restarted", lambda: False)())
        if self._must_adopt:  # the history so far stays readable through events()
            self.log.load_previous(skip_kinds=ev.CLIENT_RECORDS)  # the clients' own records are theirs
            try:  # a Ray async actor is built on its loop: re-adopt now, not at the first call
                asyncio.get_running_loop().call_soon(lambda: self.in_background(self.adopt_if_restarted()))
            except RuntimeError:
                pass  # built outside a loop: the first call re-adopts
        self._adopting: asyncio.Lock | None = None
        self.recovered: dict | None = None  # what re-adoption found and did (``fleet.control.recovery``)
        self._crash_at: tuple[str, float] | None = None  # fault injection: where this process kills itself
        self._loop_faults = LoopFaults(self.log)  # fault injection: ticks of a background loop that raise

    # ------------------------------------------------------------------ the slots, read-only (status, tests)
    @property
    def stopped(self) -> str | None:
        """Why the fleet stopped, or None while it runs: the health core's record (``Halted``)."""
        return self.slots.ledger.stopped

    @property
    def ledger(self) -> Ledger:
        return self.slots.ledger

    @property
    def handles(self) -> Mapping[int, tuple[int, Any]]:
        return MappingProxyType(self.slots.handles)

    @property
    def plan(self) -> MembershipPlan:
        return self.slots.plan

    @property
    def nodes(self) -> NodeMap:
        return self.slots.nodes

    @property
    def launching(self) -> Mapping[int, asyncio.Task]:
        return MappingProxyType(self.slots.launching)

    def serving_slots(self) -> list[int]:
        """The slots that get traffic: HEALTHY (on the committed version) and in the serving role."""
        return self.slots.serving_slots()

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> dict:
        """Launch every slot, wait for them (bounded), commit the checkpoint as version 0, open the gate."""
        self.log.emit(ev.Phase(phase="start", edge="begin", engines=self.cfg.num_engines,
                      spares=self.cfg.spare_engines, fleet=self.name))
        ledger = self.ledger
        self.intent.begin(self.name, self.cfg.model_dump(), {s: (ledger.raw(s).incarnation, 0) for s in range(ledger.num_slots)},
                          tuple(self.slots.roles.to_list()))
        await self.reconciler.launched(range(ledger.num_slots))  # bounded; a failed start is a death, restarted
        # every engine loaded the checkpoint from disk: that load is the complete refit of version 0
        self.reconciler.land(0, {slot: inc for slot, (inc, _) in self.slots.handles.items()},
                             "loaded from the checkpoint", hold_without_quorum=False)
        await self.poll_admission()  # size every cap from the engines' KV capacity before the first request
        await self.publisher.publish()  # clients may route from here on
        self.start_loops()
        self.log.emit(ev.Phase(phase="start", edge="end", serving=self.ledger.serving_count()))
        if self.stopped:
            raise_stopped(self.stopped)
        return self.status()

    def start_loops(self) -> None:
        """The background loops: health timers, the liveness monitor, the admission poll. None of them ends at
        an exception (``fleet.control.loops``): each tick's is logged, naming the loop, and the next tick runs."""
        ticks = {"health timers": (lambda: TIMER_INTERVAL_S, self.reconciler.step),
                 "liveness monitor": (lambda: self.cfg.monitor_interval_s, self.monitor.round),
                 "admission": (lambda: self.cfg.admission.poll_interval_s, self.poll_admission)}
        for name, (interval, tick) in ticks.items():
            self.in_background(run_loop(name, interval, self._loop_faults.wrap(name, tick), self.log))

    async def shutdown(self, by: str | None = None) -> dict:
        """Stop dispatch, return every pending request explicitly, shut every shard down. ``by`` names who asked
        (a process, ``rlfleet fleet stop``): every client, the one that started the fleet too, is told it.

        The shutdown marker is stored first: a controller that dies halfway is restarted by Ray and
        finishes the shutdown (``fleet.control.recovery``) instead of leaving engines orphaned."""
        await self.adopt_if_restarted()
        if self.intent.current is not None:
            self.intent.shutting_down()
        self.halt(f"shut down by {by}" if by else "controller shut down", shutdown=True)
        for task in list(self._tasks):
            task.cancel()
        outs = {}
        handles = self.slots.handles
        slots = sorted(handles)
        # An engine still starting (or waiting for Ray to place it) holds no request and may not answer
        # for a long while: it is killed, not asked to shut down (a lost node's restart waited 60 s here).
        starting = {s for s in slots if self.ledger.raw(s).phase is SlotPhase.LAUNCHING}
        for part in (slots[: (len(slots) + 1) // 2], slots[(len(slots) + 1) // 2:]):
            outs.update(await self.door.fan_out(
                {slot: (handles[slot][1], "shutdown", (), {}) for slot in part if slot not in starting}, timeout=60
            ))
            for slot in part:
                self.door.kill(handles[slot][1])
            self.crash_point("shutdown")  # fault injection: die with half the shards shut down
        await self.publisher.publish()  # clients learn the fleet stopped and return what they hold
        kinds = {s: outs[s].kind if s in outs else "killed_while_starting" for s in slots}
        self.log.emit(ev.Phase(phase="shutdown", edge="end", shards=kinds))
        try:
            self.intent.clear()
        except Exception as exc:  # noqa: BLE001 - every shard is down: a stale intent only makes a successor finish the shutdown
            self._intent_failed(exc, None)
        self.log.close()
        return {"shards": kinds}

    def halt(self, reason: str, shutdown: bool = False) -> None:
        """Stop with the gate closed: waiting requests are returned explicitly from now on. Stored first (a
        store that fails now is reported: it must not hide the stop), then decided (``Halted``)."""
        if self.stopped is None:
            self.log.emit(ev.Stopped(reason=reason, shutdown=shutdown))
            if self.intent.current is not None:
                self.intent.stopped(reason)
        self.decide(Halted(reason))

    def _intent_failed(self, exc: Exception, intent: Intent | None) -> None:
        """The intent store failed a write made while the fleet stops: recorded, and the stop goes on."""
        self.log.emit(ev.Error(where="intent store", error=f"{type(exc).__name__}: {exc}"[:500],
                      stopped=None if intent is None else intent.stopped, shutdown=intent is not None and intent.shutdown,
                      reason="written while the fleet stops: the stop goes on; a successor may not see it"))

    # ------------------------------------------------------------------ health
    def decide(self, event) -> Decision:
        """Apply one event (``Slots.decide``: the ledger, the log, the roles) and carry out its non-lifecycle
        actions: the one place the controller's actions are carried out."""
        d = self.slots.decide(event)
        self.gate.sync()  # the gate is the ledger's: announced (log, metrics, routing) before any action runs
        for action in d.actions:
            self._carry_out(action)
        self.metrics.health(self.slots.ledger)
        if d.transitions or d.actions:
            self.publisher.mark_dirty()
        return d

    def _gate_changed(self, is_open: bool, version: int | None) -> None:
        self.metrics.gate(is_open, version)
        if not is_open:
            self.publisher.close_now(self.gate.reason)
        self.publisher.mark_dirty()

    def _carry_out(self, action) -> None:
        if isinstance(action, Probe):
            self.in_background(self.monitor.probe(action.slot, action.incarnation, action.not_before))
        elif isinstance(action, Evict):
            self.slots.kill(action.slot, action.incarnation, f"evicted: {action.reason}")
        elif isinstance(action, Restart):
            self.reconciler.launch_missing()  # the ledger names its new incarnation: the reconcile launches it
        elif isinstance(action, Retire):
            self.slots.kill(action.slot, action.incarnation, f"retired: {action.reason}")
            self.log.emit(ev.Retire(slot=action.slot, incarnation=action.incarnation, reason=action.reason,
                          note="not relaunched on its own: resize(n) replaces slots retired by failures"))
        elif isinstance(action, StopExhausted):
            self.halt(action.message)
        elif isinstance(action, Readmit):
            self.readmissions.want(action)
        # OpenGate and CloseGate are the ledger's state already (``gate.sync`` announced them); AbortRefit and
        # KeepGateClosed are read by the lifecycle from the decision.

    async def poll_admission(self) -> None:
        """Poll every live shard's engine stats once and let the admission law set its cap."""
        live = self.slots.live_handles()
        outs = await self.door.fan_out(
            {s: (h, "stats", (), {}) for s, (_, h) in live.items()}, timeout=self.cfg.probe_timeout_s
        )
        grew = False
        for slot, out in outs.items():
            inc = live[slot][0]
            before = self.admission.cap(slot)
            reason = self.admission.observe(slot, out.value if out.ok else None, self.clock.now(), incarnation=inc)
            if reason:
                self.log.emit(ev.Admission(slot=slot, incarnation=inc, cap=self.admission.cap(slot), reason=reason))
            grew = grew or self.admission.cap(slot) > before
        self.metrics.in_flight(sum(int(o.value.in_flight) for o in outs.values() if o.ok))
        rows = shard_rows(outs, live, self.admission.cap)
        self.metrics.shards(rows, self.clock.now())
        for slot, row in rows.items():
            self.meter.observe(slot, row["incarnation"], row["generation_tokens"])
        if grew or any(self.admission.cap(s) != c for s, c in self.publisher.current.cap_map.items()):
            self.publisher.mark_dirty()

    def in_background(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.emit(ev.Error(where="background task", error=repr(task.exception())))

    # ------------------------------------------------------------------ observations (Actions)
    def observe(self, slot: int, incarnation: int, call: CallKind, outcome: Outcome) -> Decision:
        """Turn one settled call into a health decision: the one place a failure is classified and fenced.

        A dead or unusable incarnation is killed first, and only that incarnation:
        a late report about a replaced one never touches its replacement (``Slots.observed``).
        """
        return self.decide(self.slots.observed(slot, incarnation, call, outcome))

    def observe_all(self, call: CallKind, settled: dict[int, tuple[int, Outcome]]) -> tuple:
        """``observe`` for every settled call of one fan-out (slot -> (incarnation, outcome)): the
        unusable are fenced first, then one health decision (a ``Batch``) covers them all. Returns its
        actions. An ``ok`` answer to a pause or resume is not fed: the health core only notes it (no
        state, timer or action depends on it), and at 32 shards that note was most of a refit's cost."""
        quiet = call in (CallKind.PAUSE, CallKind.RESUME)
        observed = self.slots.observed
        events = tuple(observed(slot, inc, call, out) for slot, (inc, out) in settled.items()
                       if not (quiet and out.ok))
        return self.decide(Batch(events)).actions if events else ()

    # ------------------------------------------------------------------ client API (control only)
    async def watch_routing(self, after_epoch: int = -1, timeout: float = 10.0) -> RoutingState:
        """The published routing state once its epoch is past ``after_epoch`` (a long poll), or the
        current one after ``timeout`` s. Clients call this; no request passes through the controller."""
        await self.adopt_if_restarted()
        return await self.publisher.wait_newer(after_epoch, timeout)

    def report_failure(self, slot: int, incarnation: int, kind: str, detail: str, epoch: int) -> bool:
        """A client's request to ``incarnation`` of ``slot`` failed (``kind``: an outcome kind; ``died``
        when the actor died; ``unusable`` when it answered, alive, that it cannot serve: probed at once, and
        killed on the probe's answer), as routed under ``epoch``. Returns True if it was taken as a health
        observation (or the probe was sent).

        A request that timed out while a refit ran, or that was routed before the last refit began,
        timed out because the shard was paused for the refit: a slow refit is not a sick shard, so it is
        logged and ignored.
        """
        if self._must_adopt:
            return False  # not re-adopted yet: the client excludes the shard on its own meanwhile
        if kind == TIMED_OUT and (self.lifecycle.holding or epoch < self.publisher.refit_epoch):
            self.log.emit(ev.ReportIgnored(slot=slot, incarnation=incarnation, outcome=kind, epoch=epoch,
                         reason="the request was held by a refit"))
            return False
        if self.slots.handle_of(slot, incarnation) is None:
            return False  # about an incarnation already replaced
        if kind == UNUSABLE:
            # alive, its engine core dead: the requests it ran answer first, each naming itself, which their
            # clients count against them (``fleet.data.poison``); killed on this report, it would leave them a
            # dead actor, no evidence, and a poison request of another client would take down a third engine.
            # A probe waits for those answers (``EngineShard.ping``), and its verdict kills the actor
            self.in_background(self.monitor.probe(slot, incarnation))
            return True
        error = RuntimeError(f"client report: {detail}") if kind != "ok" else None
        self.observe(slot, incarnation, CallKind.GENERATE, Outcome(DIED if kind == DIED else kind, error=error))
        return True

    async def sync_weights(self, version: int, source: Any = None, refit_id: str | None = None,
                           stage_ahead: bool | None = None) -> dict:
        """Run the refit lifecycle for ``version`` (see ``fleet.control.lifecycle``); ``stage_ahead`` chooses for this
        refit whether the update is staged while the fleet serves (None: the fleet's ``stage_ahead``).

        ``refit_id``: the caller's id of this refit (``Fleet`` sends one and re-sends the call under it
        after a lost answer or a controller restart). A re-sent refit is recognised by it: one still
        running is awaited, one that committed (here, or under the controller this one replaced) returns
        its summary, marked ``resent`` or ``recovered``, with ``gate_open`` and ``gate_reason`` as they are
        now. Without an id, a refit the dead predecessor committed is recognised by its version alone.

        Raises ``TypeError``/``RefitRefused`` (nothing changed) for a bad ``version`` or
        ``source``; ``RefitSourceFailed`` for a dead source (nothing changed) or one that failed before
        any byte reached an engine (rolled back), ``RefitNotDelivered`` when no engine got a byte (rolled
        back): send again; ``RefitFailed`` or ``FleetExhausted`` when the fleet had to stop.
        """
        await self.adopt_if_restarted()
        again = self._resent_refit(version, refit_id)
        if again is not None:
            return {**again, **self._gate_now()} if isinstance(again, dict) else await asyncio.shield(again)
        if refit_id is None:
            return await self._run_refit(version, source, stage_ahead)
        before = self.intent.current
        self.intent.refit_id(refit_id)  # stored with the refit's first write
        try:
            return await self.resends.run(version, refit_id, self._run_refit(version, source, stage_ahead),
                                          lambda: self._committed_under(version, refit_id))
        except Exception:
            now = self.intent.current
            if before is not None and now is not None and now.refit is before.refit:  # it wrote no record of its own
                self.intent.refit_id(before.refit_id)  # its id must not ride on another refit's record
            raise

    def _committed_under(self, version: int, refit_id: str) -> bool:
        """The intent's word: the refit ``refit_id`` committed ``version`` (its record says so)."""
        intent = self.intent.current
        return intent is not None and intent.refit_id == refit_id and intent.refit is not None \
            and intent.refit.phase == COMMITTED and intent.refit.version == version

    async def refit_outcome(self, version: int, refit_id: str) -> dict:
        """Whether the refit a caller sent under ``refit_id`` committed ``version``, for a caller whose call
        ended without telling it (its answer lost, the controller restarted, its wait ran out): ``running``,
        ``committed`` or ``not_committed`` (this controller, or the one it replaced, ran it and said so), or
        ``not_begun`` (no controller wrote a record of it: nothing of it happened). Answered after re-adoption,
        which finishes or rolls back a refit the predecessor left begun."""
        await self.adopt_if_restarted()
        now = {"committed_version": self.ledger.current_version, "routing_epoch": self.publisher.current.epoch}
        ran = self.resends.outcome(version, refit_id)
        if ran is not None:
            return {**ran, **now}
        intent = self.intent.current
        if intent is not None and intent.refit_id == refit_id and intent.refit is not None \
                and intent.refit.version == version:
            word = "committed" if self._committed_under(version, refit_id) else "not_committed"
            return {"outcome": word, "error": None, **now}
        return {"outcome": "not_begun", "error": None, **now}

    async def _run_refit(self, version: int, source: Any, stage_ahead: bool | None = None) -> dict:
        summary = await self.lifecycle.run(version, source, stage_ahead)
        self._note_refit(summary)
        self.refits.append(summary)
        return summary

    def _resent_refit(self, version: int, refit_id: str | None):
        """The answer to a re-sent refit: its summary (dict), the running refit's future, or None (not a re-send)."""
        if refit_id is not None:
            again = self.resends.answer(version, refit_id)
            if again is not None:
                return again
            if self._committed_under(version, refit_id) and version == self.ledger.current_version:
                return self.recovery_summary(version)  # the refit this call re-sends committed under the predecessor
            return None
        again = self.recovered.get("finished_refit") if self.recovered else None
        if again is not None and version == again and version == self.ledger.current_version:
            return self.recovery_summary(version)  # re-adoption finished the refit this call re-sends
        return None

    def _gate_now(self) -> dict:
        """Whether the gate is open now, and why not (a re-sent refit's summary says so)."""
        return {"gate_open": self.gate.is_open, "gate_reason": None if self.gate.is_open else self.gate.reason}

    def _note_refit(self, summary: dict) -> None:
        """A committed refit: the requests it held across its pause (in flight on the engines as it fenced
        them, kept and resumed on the new weights), and the run step it closes (time since the last commit,
        generation tokens/s as of the last admission poll); each in the summary, the event log and a metric."""
        version = summary["version"]
        busy = self.lifecycle.held_at_fence
        summary["held_across_pause"] = sum(busy.values())
        self.log.emit(ev.RefitHeld(version=version, requests=summary["held_across_pause"],
                     by_slot={str(s): n for s, n in sorted(busy.items())}))
        self.metrics.refit_held(summary["held_across_pause"])
        step = summary["run_step"] = self.meter.step(version, self.clock.now())
        self.log.emit(ev.RunStep(**step))
        self.metrics.run_step(step)

    async def pause(self, mode: str = "abort", timeout_s: float = 60.0) -> dict:
        """Close the gate for the operator (vLLM's ``/pause``; ``fleet.control.operator_pause``): new requests are
        held by their clients, those in flight are aborted and held (``abort``), waited for (``wait``) or kept
        on their paused engines (``keep``). Holds through refits, quorum changes and controller restarts."""
        await self.adopt_if_restarted()
        return await self.operator_pause.pause(mode, float(timeout_s))

    async def resume(self) -> dict:
        """End the operator's pause: the gate opens where the health core would have it open."""
        await self.adopt_if_restarted()
        return await self.operator_pause.resume()

    async def is_paused(self) -> bool:
        await self.adopt_if_restarted()
        return self.operator_pause.holds

    async def resize(self, n: int, drain_timeout_s: float | None = None) -> dict:
        """Grow or shrink the fleet to ``n`` serving engines (``fleet.control.resize``); waits for a refit running now.
        ``ConfigError`` (nothing changed) for an ``n`` that is not an integer >= 1 and >= ``min_healthy_engines``."""
        await self.adopt_if_restarted()
        from rlfleet.fleet.control.resize import resize

        return await resize(self.parts, self.publisher, self.lifecycle.lock, n, drain_timeout_s)

    def routing_state(self) -> RoutingState:
        return self.publisher.current

    def status(self) -> dict:
        ledger = self.ledger.to_dict()
        return {
            "fleet": self.name,
            "generation": self.generation,
            "recovered": self.recovered,
            "gate_open": self.gate.is_open,
            "version": self.gate.version,
            "epoch": self.slots.plan.epoch,
            "stopped": self.stopped,
            "routing_epoch": self.publisher.current.epoch,
            "target_size": self.slots.size,  # serving engines the fleet is sized to (``resize``)
            "hang_detection_bound_s": self.cfg.hang_detection_bound_s,
            "stall_detection_bound_s": self.cfg.stall_detection_bound_s,
            "nodes": self.slots.nodes.by_node(),
            "ledger": {**ledger, "slots": self.slots.role_rows(ledger["slots"])},  # each slot's role: serving or spare
            "serving": self.serving_slots(),
            "refits": len(self.refits),
            "shard_load": shard_load(self.admission.metrics()),  # per slot, as of the last admission poll
        }

    def events(self, since: int = 0, kinds: list[str] | None = None) -> list[dict]:
        return self.log.records(since, kinds)

    async def shard_counters(self) -> dict[int, dict]:
        """Per live slot: what its shard admitted and refused, and why (``EngineShard.counters``, as a plain dict)."""
        await self.adopt_if_restarted()
        live = self.slots.live_handles()
        outs = await self.door.fan_out({s: (h, "counters", (), {}) for s, (_, h) in live.items()},
                                       timeout=self.cfg.probe_timeout_s)
        return {s: o.value.to_dict() for s, o in outs.items() if o.ok}

    def admission_metrics(self) -> dict[int, dict]:
        """Read-only: per slot, the cap, the law's counters and the last polled engine stats (preemptions, KV)."""
        return self.admission.metrics()

    # ------------------------------------------------------------------ fault injection
    # ------------------------------------------------------------------ restarts of the controller itself
    async def ping(self) -> dict:
        """Liveness of the controller (a restarted one re-adopts its shards first)."""
        await self.adopt_if_restarted()
        import os

        return {"fleet": self.name, "generation": self.generation, "pid": os.getpid(), "stopped": self.stopped}

    def config(self) -> dict:
        """The fleet's config (what ``Fleet.connect`` builds its client from), sized as the fleet is now."""
        return {**self.cfg.model_dump(), "num_engines": self.slots.size}

    async def adopt_if_restarted(self) -> None:
        """After Ray restarted this controller: re-adopt the shards once (``fleet.control.recovery``), before any call."""
        if not self._must_adopt:
            return
        if self._adopting is None:
            self._adopting = asyncio.Lock()
        async with self._adopting:
            if not self._must_adopt:
                return
            from rlfleet.fleet.control.recovery import adopt

            try:
                self.recovered = await adopt(self.parts, self.publisher)
                self.generation = self.recovered.get("generation", self.generation)
                if self.recovered.get("alive") is not None:  # re-adopted a serving fleet: watch it from here on
                    self.start_loops()
            except Exception as exc:  # noqa: BLE001 - a half-adopted fleet must not serve: stop, loudly
                self.log.emit(ev.Error(where="re-adoption", error=repr(exc)[:500]))
                self.halt(f"the restarted controller could not re-adopt its shards: {type(exc).__name__}: {exc}")
                await self.publisher.publish()  # clients learn the fleet stopped and return what they hold
            finally:
                self._must_adopt = False

    def recovery_summary(self, version: int) -> dict:
        """The summary of a refit the predecessor committed and re-adoption finished: ``recovered`` says only
        that; ``gate_open``/``gate_reason`` say whether the fleet serves it (below quorum it does not: the
        next ``sync_weights`` brings the stale and restarted engines back)."""
        return {"version": version, "recovered": True, "complete": sorted(self.ledger.serving_slots()),
                "serving": self.serving_slots(), "routing_epoch": self.publisher.current.epoch,
                "epoch": self.slots.plan.epoch, "generation": self.generation, **self._gate_now()}

def raise_stopped(message: str) -> None:
    from rlfleet.fleet.errors import FleetStopped

    raise FleetStopped(message)
