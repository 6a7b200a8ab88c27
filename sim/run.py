"""One simulated training run: the production ``SingleController`` on a ``SimDoor``, in virtual time.

``simulate(Scenario)`` builds the fleet exactly as ``Fleet.start`` would build its
controller, except for the door (``sim.door.SimDoor``), the clock (the virtual-time
loop's, ``sim.clock``) and the weight transport (``sim.transfer.SimTransfer``). Then a
trainer loop runs: ``step_s`` of training (engines serve), ``sync_weights(version)``,
again, for ``horizon_s`` of simulated time, while ``sim.faults`` kills engines, hangs
them, takes nodes away (the cluster declares a lost node dead ``node_death_detect_s``
later; a replacement node joins ``node_repair_s`` after the loss) and kills the
controller (its successor is built ``controller_restart_s`` later, as Ray restarts the
actor, and re-adopts the shards; the trainer re-sends its refit). With ``stage_ahead`` a
refit refused because too few engines staged it (``RefitNotStaged``: the gate never
closed) is re-sent at once as well.

What it measures, every ``sample_s`` of simulated time, from what clients see (the
routing state the controller last published) and what is true (which of those engines
are alive and answering):

- availability: the share of time the published gate is open;
- for each refit, the seconds its controller's gate was closed from its step 1 on (the
  gate's and the lifecycle's records in the event log): the whole refit without
  ``stage_ahead``; with it, only pause, apply, stamp and resume;
- capacity: published members that are alive and answering, as a share of ``engines``;
- each refit's simulated seconds, and the real CPU seconds the process spent while it ran
  (``time.process_time``: the controller's own work, plus the simulated door's, which is
  a few microseconds per call); the simulated CPU the door charged the controller for the
  calls made while it ran (``call_cpu_s_per_refit``, at ``Scenario.call_cpu_us`` per call: what real
  Ray's client side costs, ``sim.door.CALL_CPU_US``), and the refit's phases' seconds;
- for every fault, the time until capacity was whole again;
- the control plane's load: door calls and key-value writes per refit and per hour.

Guarantee on failure: a fleet that stops (quorum lost) is recorded, not raised: the rest
of the run counts as unavailable, and the report says why it stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import pickle
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.errors import FleetStopped, RefitNotStaged
from rlfleet.fleet.records import Gate, Phase, Record, Routing, all_of
from rlfleet.sim.clock import LoopClock, run_virtual
from rlfleet.sim.door import CALL_CPU_US, SimDoor, SimTrainer
from rlfleet.sim.faults import Fault, FaultSpec, schedule
from rlfleet.sim.shard import Timings
from rlfleet.sim.transfer import SimTransfer, TransferModel

__all__ = ["Scenario", "simulate"]


@dataclass(frozen=True)
class Scenario:
    engines: int = 64
    spare_engines: int = 0
    quorum_share: float = 0.75  # min_healthy_engines = ceil(quorum_share * engines)
    gpus_per_engine: int = 1
    engines_per_node: int = 8
    spare_nodes: int = 0  # idle nodes the cluster holds for replacements
    step_s: float = 300.0  # one training step of the trainer (engines serve meanwhile)
    horizon_s: float = 24 * 3600.0
    warmup_s: float = 0.0  # seconds after the fleet started (engines up, gate open) that are not measured
    node_death_detect_s: float = 30.0  # until the cluster (Ray's GCS) declares a lost node dead
    node_repair_s: float = 3600.0  # a lost node's replacement joins this much later
    controller_restart_s: float = 5.0  # Ray restarting the controller actor's process
    sample_s: float = 1.0
    timings: Timings = Timings()
    transfer: TransferModel = TransferModel()
    faults: FaultSpec = FaultSpec()
    fault_list: tuple[Fault, ...] | None = None  # these faults instead of ``faults``' random ones (tests)
    # the refit stages the update while the fleet serves and closes the gate for the apply only
    # (FleetConfig.stage_ahead); the apply's speed is ``transfer.apply_Bps``
    stage_ahead: bool = False
    # the controller's CPU per control call (``sim.door``): by default what real Ray cost (``CALL_CPU_US``)
    call_cpu_us: float = CALL_CPU_US
    fleet: dict = field(default_factory=dict)  # FleetConfig fields over the defaults below

    def fleet_config(self) -> dict:
        cfg = {
            "name": f"sim-{self.engines}",
            # a request held across a refit fits its budget (FleetConfig refuses timeouts below the 610 s)
            "engine": {"model": model_card(), "start_timeout_s": 3 * self.timings.engine_start_s,
                       "generate_timeout_s": 900.0},
            "num_engines": self.engines,
            "spare_engines": self.spare_engines,
            "min_healthy_engines": max(1, math.ceil(self.quorum_share * self.engines)),
            "refit_timeout_s": 600.0,
            "request_timeout_s": 900.0,
            # a large fleet's liveness and load polls: every 10 s, not every 1 s / 0.5 s as a small one
            "monitor_interval_s": 10.0,
            "admission": {"poll_interval_s": 10.0},
            "restart_budget": 3,
            "restart_backoff_s": 10.0,
            "stage_ahead": self.stage_ahead,
        }
        cfg.update(self.fleet)
        return cfg


def model_card() -> str:
    """A model directory for the fleet config, which checks that one exists: the simulated shards
    never read it. Its config.json names a 70B-class Llama (the transfer model's size)."""
    path = os.path.join(tempfile.gettempdir(), "rlfleet-sim-model")
    os.makedirs(path, exist_ok=True)
    card = os.path.join(path, "config.json")
    if not os.path.isfile(card):
        with open(card, "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                       "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                       "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16"}, f)
    return path


class _Run:
    """The state of one simulated run (see ``simulate``)."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.door = SimDoor(sc.engines + sc.spare_engines, sc.timings, sc.engines_per_node, sc.spare_nodes,
                            sc.call_cpu_us)
        self.clock = LoopClock()
        self.trainer = SimTrainer()
        self.controllers: list[SingleController] = []  # the last one is the live one
        self.visible: SingleController | None = None  # whose routing state clients hold
        self.samples: list[tuple[float, bool, int]] = []  # (t, gate open, capacity)
        self.refits: list[dict] = []
        self.fired: list[dict] = []
        self.not_staged: list[dict] = []  # refits refused because too few engines staged (re-sent at once)
        self.stopped: str | None = None
        self.t0 = 0.0
        self.controller_down = asyncio.Event()
        self.controller_up = asyncio.Event()
        self.controller_up.set()
        self._capacity_key: tuple = ()
        self._capacity = 0

    # -- the controller, as Ray runs it ------------------------------------------------------
    def build_controller(self) -> SingleController:
        ctl = SingleController(self.sc.fleet_config(), door=self.door, clock=self.clock,
                               transfer=SimTransfer(self.sc.transfer, send_calls=self.door.send_calls))
        self.controllers.append(ctl)
        if self.visible is None:
            self.visible = ctl
        return ctl

    @property
    def ctl(self) -> SingleController:
        return self.controllers[-1]

    @staticmethod
    def halt_tasks(ctl: SingleController) -> None:
        """Stop every task ``ctl`` runs where it is (its process died, or the run ended)."""
        for task in list(ctl._tasks) + list(ctl.launching.values()):
            task.cancel()

    async def kill_controller(self) -> None:
        """The controller's process dies: its tasks stop where they are; Ray restarts it a moment later."""
        self.controller_up.clear()
        self.controller_down.set()
        self.halt_tasks(self.ctl)
        await asyncio.sleep(self.sc.controller_restart_s)
        self.door.was_restarted = True
        new = self.build_controller()
        await new.adopt_if_restarted()
        self.visible = new
        self.controller_down.clear()
        self.controller_up.set()

    # -- what clients see, and what is true ----------------------------------------------------
    def published(self):
        """The routing state clients hold: the last controller's whose clients could reach it. A
        successor answers ``watch_routing`` only once it has re-adopted the shards: until then clients
        keep what its predecessor published."""
        return self.visible.publisher.current

    def capacity(self) -> int:
        state = self.published()
        key = (id(state), self.door.changes)
        if key != self._capacity_key:
            shards = self.door.shards
            self._capacity = sum(1 for m in state.members if (s := shards.get((m.slot, m.incarnation))) is not None
                                 and not s.dead and not s.hung)
            self._capacity_key = key
        return self._capacity

    async def sampler(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.samples.append((loop.time() - self.t0, self.published().gate_open, self.capacity()))
            await asyncio.sleep(self.sc.sample_s)

    # -- the trainer --------------------------------------------------------------------------
    async def trainer_loop(self) -> None:
        loop = asyncio.get_running_loop()
        version = 0
        while loop.time() - self.t0 < self.sc.horizon_s:
            await asyncio.sleep(self.sc.step_s)
            version += 1
            while True:  # a refit cut short by the controller's death is re-sent to its successor
                await self.controller_up.wait()
                ctl = self.ctl
                t_start, cpu0, calls0, kv0 = loop.time(), time.process_time(), self.door.calls, self.door.kv_puts
                charged0 = self.door.cpu_charged_s
                log0, open0 = len(ctl.log), ctl.gate.is_open
                methods0 = dict(self.door.by_method)
                refit = asyncio.ensure_future(ctl.sync_weights(version, self.trainer))
                died = asyncio.ensure_future(self.controller_down.wait())
                await asyncio.wait({refit, died}, return_when=asyncio.FIRST_COMPLETED)
                died.cancel()
                if not refit.done():
                    refit.cancel()
                    continue
                try:
                    summary = refit.result()
                except FleetStopped as exc:
                    self.stopped = f"refit of version {version}: {exc}"
                    return
                except asyncio.CancelledError:
                    continue
                except RefitNotStaged as exc:  # the gate never closed: the trainer sends the same update again
                    self.not_staged.append({"version": version, "t": t_start - self.t0, "error": str(exc)[:300]})
                    if loop.time() - self.t0 >= self.sc.horizon_s:
                        return
                    continue
                self.refits.append({
                    "version": version, "t": t_start - self.t0, "s": loop.time() - t_start,
                    "cpu_s": time.process_time() - cpu0, "calls": self.door.calls - calls0,
                    "kv_puts": self.door.kv_puts - kv0, "call_cpu_s": self.door.cpu_charged_s - charged0,
                    "phases_s": dict(summary.get("phases_s", {})),
                    "methods": {m: k - methods0.get(m, 0) for m, k in self.door.by_method.items() if k > methods0.get(m, 0)},
                })
                self.refits[-1]["gate_closed_s"] = self.gate_closed_s(ctl, log0, open0, loop.time())
                break

    @staticmethod
    def gate_closed_s(ctl: SingleController, since: int, was_open: bool, t1: float) -> float:
        """Seconds ``ctl``'s gate was closed from the refit's step 1 (``close``) until ``t1`` (it returned),
        from the ``phase`` and ``gate`` records after record ``since`` (the gate was ``was_open`` then).
        Under ``stage_ahead`` the staging before step 1 does not count even if the gate was closed for
        another reason meanwhile (below quorum): that closure is not the refit's."""
        is_open, changed_at, t_close, closed = was_open, -math.inf, None, 0.0
        for rec in all_of(ctl.log.records(since=since, kinds=[Gate, Phase])):
            if isinstance(rec, Phase):
                if t_close is None and rec.phase == "close" and rec.edge == "begin":
                    t_close = rec.t
                continue
            if t_close is not None and not is_open:
                closed += rec.t - max(changed_at, t_close)
            is_open, changed_at = rec.open, rec.t
        if t_close is None:
            return 0.0
        return closed + (0.0 if is_open else t1 - max(changed_at, t_close))

    # -- the faults ---------------------------------------------------------------------------
    async def injector(self, faults: list[Fault]) -> None:
        loop = asyncio.get_running_loop()
        for fault in faults:
            await asyncio.sleep(max(0.0, self.t0 + fault.t - loop.time()))
            self.fire(fault)

    def fire(self, fault: Fault) -> None:
        loop = asyncio.get_running_loop()
        record: dict[str, Any] = {"t": loop.time() - self.t0, "kind": fault.kind, "capacity_before": self.capacity()}
        if fault.kind == "controller":
            loop.create_task(self.kill_controller())
        elif fault.kind == "node":
            alive = [n for n in self.door.nodes.values() if n.alive and n.shards]
            if not alive:
                return
            node = alive[int(fault.pick * len(alive))]
            record["node"], record["shards"] = node.node_id, sorted(node.shards)  # (slot, incarnation) each
            self.door.lose_node(node.node_id)
            loop.call_later(self.sc.node_death_detect_s, self.door.declare_dead, node.node_id)
            loop.call_later(self.sc.node_repair_s, self.door.add_node)
        else:
            live = [s for s in self.door.shards.values() if not s.dead and not s.hung and s.node]
            if not live:
                return
            shard = live[int(fault.pick * len(live))]
            record["shards"] = [(shard.slot, shard.incarnation)]
            if fault.kind == "die":
                self.door.kill(shard)  # its process is gone: the node slot is free for its restart
            else:
                self.door.hang(shard)
        self.fired.append(record)

    # -- the report ---------------------------------------------------------------------------
    def report(self, wall_s: float, cpu_s: float, loop_cpu_s: float = 0.0) -> dict[str, Any]:
        sc = self.sc
        samples = self.measured()
        n = max(1, len(samples))
        availability = sum(1 for _, g, _ in samples if g) / n
        shares = [c / sc.engines for _, _, c in samples]
        refit_s = [r["s"] for r in self.refits]
        closed_s = [r["gate_closed_s"] for r in self.refits]
        cpu = [r["cpu_s"] for r in self.refits]
        hours = sc.horizon_s / 3600.0

        def records(kind: type[Record] | None) -> list:
            return [r for c in self.controllers for r in c.log.records(kinds=None if kind is None else [kind])]

        return {
            "engines": sc.engines, "spare_engines": sc.spare_engines, "horizon_h": round(hours, 2),
            "step_s": sc.step_s, "refits": len(self.refits),
            "availability": round(availability, 5),
            "capacity_mean_share": round(sum(shares) / n, 5) if shares else 0.0,
            "capacity_min_share": round(min(shares), 5) if shares else 0.0,
            "refit_s_mean": round(sum(refit_s) / len(refit_s), 3) if refit_s else None,
            "refit_s_max": round(max(refit_s), 3) if refit_s else None,
            "stage_ahead": sc.stage_ahead,
            "gate_closed_s_per_refit": round(sum(closed_s) / len(closed_s), 3) if closed_s else None,
            "gate_closed_s_max": round(max(closed_s), 3) if closed_s else None,
            "refits_stopped": 1 if self.stopped else 0, "stopped": self.stopped,
            "refits_not_staged": len(self.not_staged),
            "controller_cpu_s_per_refit": round(sum(cpu) / len(cpu), 5) if cpu else None,
            "call_cpu_us": sc.call_cpu_us,
            "call_cpu_s_per_refit": round(sum(r["call_cpu_s"] for r in self.refits) / len(self.refits), 3)
            if self.refits else None,
            "phases_s_per_refit": {p: round(sum(r["phases_s"].get(p, 0.0) for r in self.refits) / len(self.refits), 3)
                                   for p in dict.fromkeys(p for r in self.refits for p in r["phases_s"])},
            "calls_per_refit": round(sum(r["calls"] for r in self.refits) / max(1, len(self.refits)), 1),
            "calls_by_method_per_refit": {m: round(sum(r["methods"].get(m, 0) for r in self.refits) / max(1, len(self.refits)), 1)
                                          for m in sorted({m for r in self.refits for m in r["methods"]})},
            "kv_puts_per_refit": round(sum(r["kv_puts"] for r in self.refits) / max(1, len(self.refits)), 2),
            "controller_cpu_s_per_hour_between_refits": round((loop_cpu_s - sum(cpu)) / hours, 3),
            "calls_per_hour": round(self.door.calls / hours, 1), "kv_puts_per_hour": round(self.door.kv_puts / hours, 1),
            "kv_bytes_per_put": round(self.door.kv_bytes / max(1, self.door.kv_puts)),
            "routing_publications_per_refit": round(len(records(Routing)) / max(1, len(self.refits)), 2),
            "routing_state_bytes_without_handles": self.routing_bytes(),
            "event_records_per_refit": round(len(records(None)) / max(1, len(self.refits)), 1),
            "faults": {k: sum(1 for f in self.fired if f["kind"] == k) for k in ("die", "hang", "node", "controller")},
            "time_to_full_capacity_s": self.recoveries(),
            "controller_generations": len(self.controllers),
            "real_s": round(wall_s, 2), "real_cpu_s": round(cpu_s, 2),
        }

    def measured(self) -> list[tuple[float, bool, int]]:
        """The samples of the measured window, ``[warmup_s, horizon_s)`` (the trainer's last refit may end
        past the horizon: it is not counted)."""
        return [s for s in self.samples if self.sc.warmup_s <= s[0] < self.sc.horizon_s]

    def routing_bytes(self) -> int:
        """Pickled size of the published routing state with each member's actor handle left out (what a
        client receives per publication, plus one handle per member: a Ray handle is a few hundred bytes)."""
        state = self.published()
        bare = dataclasses.replace(state, members=tuple(dataclasses.replace(m, handle=None) for m in state.members))
        return len(pickle.dumps(bare))

    def recoveries(self) -> list[float | None]:
        """Per fault that hit serving capacity: seconds from the fault until capacity was whole again
        (None: never within the run). A fault that took no capacity away counts 0."""
        out: list[float | None] = []
        full = self.sc.engines
        for f in self.fired:
            if f["kind"] == "controller":
                continue
            after = [s for s in self.samples if s[0] >= f["t"]]
            dropped = next((i for i, s in enumerate(after) if s[2] < full), None)
            if dropped is None:
                out.append(0.0)
                continue
            back = next((s[0] for s in after[dropped:] if s[2] >= full), None)
            out.append(round(back - f["t"], 1) if back is not None else None)
        return out

    def series(self, every_s: float = 60.0) -> list[tuple[float, float, float, float]]:
        """(window start, gate-open share, mean capacity share, min capacity share) per ``every_s``
        window of the samples: what the plot draws."""
        buckets: dict[int, list[tuple[bool, int]]] = {}
        for t, g, c in self.measured():
            buckets.setdefault(int(t // every_s), []).append((g, c))
        n = self.sc.engines
        return [(k * every_s, sum(g for g, _ in b) / len(b), sum(c for _, c in b) / len(b) / n, min(c for _, c in b) / n)
                for k, b in sorted(buckets.items())]


async def _simulate(sc: Scenario) -> tuple[_Run, dict]:
    run = _Run(sc)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    ctl = run.build_controller()
    await ctl.start()
    run.t0 = asyncio.get_running_loop().time()
    cpu_t0 = time.process_time()
    faults = list(sc.fault_list) if sc.fault_list is not None else \
        schedule(sc.faults, (sc.engines + sc.spare_engines) * sc.gpus_per_engine, sc.horizon_s)
    tasks = [asyncio.ensure_future(c) for c in (run.sampler(), run.injector(faults))]
    try:
        await run.trainer_loop()
        left = sc.horizon_s - (asyncio.get_running_loop().time() - run.t0)
        if left > 0:  # stopped early: the rest of the run is sampled as it is (gate closed)
            await asyncio.sleep(left)
    finally:
        for t in tasks:
            t.cancel()
        for c in run.controllers:
            run.halt_tasks(c)
    report = run.report(time.perf_counter() - wall0, time.process_time() - cpu0, time.process_time() - cpu_t0)
    report["scenario"] = {k: v for k, v in asdict(sc).items() if k not in ("fleet", "fault_list")}
    return run, report


def simulate(sc: Scenario) -> tuple[_Run, dict]:
    """Run ``sc`` in virtual time; returns the run (samples, refits, faults) and its report."""
    return run_virtual(_simulate(sc))
