"""Run fault plans against a short async loop on a real fleet, and judge each against its expectation.

The loop, per step: a batch of generation groups in flight, the step's faults
fired (``faults.firing``: a kill now, a fault armed at a hook point, or a trainer's
fault: a refit call of its own, through this runner as the ``Trainer``), then new
weights on the source and ``sync_weights``. Nothing is collected before the last
refit (a fleet below quorum holds requests until a refit reopens the gate).
Afterwards the runner collects every result, checks the DESIGN invariants on the
event log, and the variant's own checks (evicted, readmitted, retired, the stop
naming the slot, requests waiting below quorum, a warm spare promoted in place of a
killed serving slot), and ``judge`` proves from the records
that each fault went off on its slot and incarnation and did what it should
(``faults.evidence``: the shards' fault journal, a file this runner names in the
engine config, and the event log); fault -> reopen is measured from the firing.
A variant passes only if the observed outcome is the expected one, every fault
it fired went off and was followed by its health transition, no prompt was lost,
no sample carried a wrong version tag, and every invariant held.

The runner reads the event log from the file each fleet writes (``event_log_path``, one
per fleet it starts): a controller Ray restarted appends to it, so the file holds what
the dead controller logged too (its in-memory log died with it); a variant's records
are those stamped at or after the variant began. A ``kill_controller`` variant also
checks that the controller came back (``controller_back``: its generation grew by one
per kill, and the fleet serves one committed version); a plan with a
``kill_controller`` at ``shutdown`` ends its fleet: after its steps the runner shuts the
fleet down and checks that every shard actor of every incarnation the fleet listed is
gone, and so is the controller (``_shutdown_clean``).

Fleets are reused across consecutive variants that expect to recover and share a
fleet config (the runner heals the fleet in between: restarts done, every slot
serving); a variant that stops gets its own fleet.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from rlfleet.faults import invariants
from rlfleet.faults.evidence import prove
from rlfleet.faults.frozen import prove_core_reaped, prove_resent
from rlfleet.faults.promotion import prove_promotion
from rlfleet.faults.firing import FaultFiring, slot_states
from rlfleet.faults.polling import wait_until
from rlfleet.faults.timeline import read_log
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.errors import FleetStopped
from rlfleet.fleet.cluster.naming import controller_name, shard_name
from rlfleet.fleet.records import Health, Kill, Readmit, Record, Request, Stamp, Stopped, Transfer, all_of, of_kinds
from rlfleet.faults.matrix import BASE_FLEET, Variant
from rlfleet.faults.source import WeightSource
from rlfleet.health.faultplan import CONTROLLER_WHAT, FaultPlan, load_plan, resolve

PROMPT = [1, 21, 31, 41, 51]
SAMPLING = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0}
# Each training step changes this share of every tensor's elements, and the trainer sends deltas
# (``refit.delta``): after the first update, every variant's refits carry patches (an engine that lacks their
# base, a restarted one, gets the update whole), so each fault also meets a delta in flight.
STEP_CHANGES = 0.05


def spawn_source(model_dir: str):
    """The variants' trainer: a ``WeightSource`` sending deltas after its first update."""
    return ray_door.spawn_actor(WeightSource, model_dir, 0, 1, None, "copy", num_cpus=0)


@dataclass
class VariantReport:
    variant: str
    expected: str
    observed: str = "error"
    passed: bool = False
    fault_to_reopen_s: float | None = None  # from the first firing
    faults: list[dict] = field(default_factory=list)  # one evidence row per fault that went off (faults.evidence)
    accepted: int = 0
    completed: int = 0
    returned: int = 0
    lost: int = 0
    wrong_version_tags: int = 0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self) -> dict:
        return asdict(self)


def judge(rep: VariantReport, done: list[dict], events: list[dict], journal: list[dict]) -> VariantReport:
    """The verdict on a variant, from its records: ``done`` (``FaultFiring.fired``), the event log since the
    variant began, and the fault journal's lines since then. A fault that did not go off, or did nothing, fails it."""
    rep.faults, problems = prove(done, events, journal)
    rep.violations += problems
    rep.fault_to_reopen_s = rep.faults[0]["fault_to_reopen_s"] if rep.faults else None
    rep.passed = rep.observed == rep.expected and rep.lost == 0 and rep.wrong_version_tags == 0 and not rep.violations
    if not rep.passed:  # what else happened to the slots: a failed variant's report says who the fleet lost, and why
        rep.notes += slot_losses(events)
    return rep


def _state(value) -> str:
    return str(getattr(value, "value", value))


def slot_losses(events: list[dict], most: int = 8) -> list[str]:
    """One line per shard the controller killed and per slot that left the serving states, with the reason the
    event log gives (the first ``most``)."""
    lines: list[str] = []
    killed: set[tuple] = set()
    for e in all_of(events):
        if isinstance(e, Kill):
            who = (e.slot, e.incarnation)
            if who in killed:
                continue  # every client that found it unusable asks for the same kill
            killed.add(who)
            lines.append(f"killed slot {e.slot} (incarnation {e.incarnation}): {str(e.reason)[:300]}")
        elif isinstance(e, Health) and _state(e.after) in ("suspect", "hung", "dead"):
            lines.append(f"slot {e.slot} (incarnation {e.incarnation}) {_state(e.before)} -> "
                         f"{_state(e.after)}: {str(e.reason)[:300]}")
    return lines[:most] + ([f"and {len(lines) - most} more slot losses"] if len(lines) > most else [])


class FaultRunner:
    def __init__(self, model_dir: str, engine: dict | None = None, groups: int = 4, n: int = 2, log: Callable = print) -> None:
        self.model_dir = model_dir
        self._journal_dir = tempfile.mkdtemp(prefix="rlfleet-faults-")
        self.journal = f"{self._journal_dir}/fired.jsonl"  # every shard appends the faults that go off
        self.engine = {"model": model_dir, "kv_cache_memory_bytes": 32 << 20, "fault_journal": self.journal, **(engine or {})}
        self.groups, self.n = groups, n
        self.log = log
        self._fleet: Fleet | None = None
        self._fleet_key: tuple | None = None
        self._fleets = itertools.count(1)
        self.event_log: str | None = None  # the event log file of the current fleet
        self._source = None
        self._version = 0

    # ------------------------------------------------------------------ fleets
    def _config(self, plan: FaultPlan) -> dict:
        """The plan's fleet: ``BASE_FLEET`` under its overrides; an ``engine`` override is laid over the
        runner's engine (``faults.matrix.NULL_ENGINE``: shards with no vLLM engine)."""
        return {**BASE_FLEET, **plan.fleet, "engine": {**self.engine, **plan.fleet.get("engine", {})}}

    def fleet_for(self, plan: FaultPlan) -> Fleet:
        key = json.dumps(plan.fleet, sort_keys=True)
        if self._fleet is not None and (self._fleet_key != key or self._fleet.status()["stopped"]):
            self.close_fleet()
        if self._fleet is None:
            self.say(f"starting a fleet for {plan.name} ({self._config(plan)['num_engines']} engines)")
            self.event_log = f"{self._journal_dir}/events-{next(self._fleets)}.jsonl"
            self._fleet = Fleet.start({**self._config(plan), "event_log_path": self.event_log})
            self._fleet_key = key
            self._fleet.generate([PROMPT] * 6, n=1, sampling=SAMPLING)  # warm-up: an engine's first batch is slow
            self._version = self._fleet.status()["version"]
        else:
            self.heal(self._fleet)
        if self._source is None:
            self._source = spawn_source(self.model_dir)
        return self._fleet

    def close_fleet(self) -> None:
        if self._fleet is not None:
            self._fleet.shutdown()
            self._fleet, self._fleet_key = None, None

    def close(self, ray_gone: str | None = None) -> None:
        """Shut the fleet down and kill the trainer. ``ray_gone``: why the local Ray is gone (a signal sent to
        the whole process group stopped it): the fleet's requests are returned and logged, nothing is asked
        of actors that went down with it."""
        if ray_gone is not None:
            if self._fleet is not None:
                self._fleet.abandon(ray_gone)
            self._fleet = self._source = None
        self.close_fleet()
        if self._source is not None:
            ray_door.kill(self._source)
            self._source = None
        shutil.rmtree(self._journal_dir, ignore_errors=True)

    def journal_since(self, t: float) -> list[dict]:
        """The fault journal's lines written at or after monotonic time ``t``."""
        return [r for r in read_log(self.journal) if r["t"] >= t]

    def events(self, since_t: float = float("-inf"), kinds: Iterable[str | type[Record]] | None = None) -> list[dict]:
        """The current fleet's event log from its file (every controller generation's records and the
        client's), in time order, from monotonic time ``since_t`` on, of ``kinds`` (record classes or kind
        strings) when given; ``seq`` numbers the whole file."""
        records = [{**r, "seq": i} for i, r in enumerate(read_log(self.event_log))] if self.event_log else []
        return of_kinds([r for r in records if r["t"] >= since_t], kinds)

    def say(self, message: str) -> None:
        """One line of the run's log, marked as the fault runner's."""
        self.log(f"[faults] {message}")

    def _wait(self, predicate, timeout_s: float, what: str) -> bool:
        if wait_until(predicate, timeout_s):
            return True
        self.say(f"gave up waiting for {what} after {timeout_s:.0f} s")
        return False

    def heal(self, fleet: Fleet) -> None:
        """Wait for restarts to finish; refit so every live slot serves the current version."""
        settled = {"healthy", "stale", "retired"}
        self._wait(lambda: set(slot_states(fleet.status()).values()) <= settled, 240, "every slot up")
        if "stale" in slot_states(fleet.status()).values():
            self.refit(fleet)

    def refit(self, fleet: Fleet) -> dict:
        return fleet.sync_weights(self.new_version(), self._source)

    # ------------------------------------------------------------------ the trainer (faults.firing.Trainer)
    @property
    def source(self):
        return self._source

    def new_version(self) -> int:
        """A deterministic training step on the weight source; its version number."""
        self._version += 1
        ray_door.ask(self._source, "perturb", self._version, 0.01, False, STEP_CHANGES, timeout=60)
        return self._version

    def skip_to(self, version: int) -> None:
        self._version = max(self._version, int(version))

    def corrupt_next_update(self, kind: str | None, tensor: str) -> None:
        ray_door.ask(self._source, "corrupt_next_update", kind, tensor, timeout=60)

    def kill_source_at_next_send(self) -> None:
        ray_door.ask(self._source, "die_at_next_send", timeout=60)

    def replace_source(self) -> str:
        """A fresh ``WeightSource`` from the checkpoint (later steps perturb it); Ray's word on the old one."""
        old, state = self._source, ray_door.actor_state(self._source)
        ray_door.kill(old)
        self._source = spawn_source(self.model_dir)
        return state

    # ------------------------------------------------------------------ one variant
    def run(self, variant: Variant) -> VariantReport:
        plan = load_plan(variant.plan)
        t0 = time.monotonic()
        rep = VariantReport(plan.name, plan.expect)
        try:
            fleet = self.fleet_for(plan)
            self._run_steps(fleet, plan, variant, rep)
        except Exception as exc:  # noqa: BLE001 - a broken variant is a failed row, not a crashed matrix
            where = traceback.extract_tb(exc.__traceback__)[-3:]  # the call that raised, as the row's evidence
            rep.notes.append(f"runner error: {type(exc).__name__}: {exc} (at "
                             + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(where)) + ")")
            self.close_fleet()
        rep.wall_s = round(time.monotonic() - t0, 1)
        self.say(
            f"{rep.variant}: expected {rep.expected}, observed {rep.observed}, "
            f"{'PASS' if rep.passed else 'FAIL'} in {rep.wall_s} s"
        )
        if rep.observed == "stops":
            self.close_fleet()
        return rep

    def _run_steps(self, fleet: Fleet, plan: FaultPlan, variant: Variant, rep: VariantReport) -> None:
        t0 = time.monotonic()
        before = fleet.status()["requests"]
        generation = fleet.controller_info()["generation"]
        pending: list = []

        def load() -> int:
            batch = [fleet.submit(PROMPT, self.n, SAMPLING) for _ in range(self.groups)]
            pending.extend(batch)
            return len(batch)

        firings = resolve(plan, self._config(plan)["num_engines"])
        firing = FaultFiring(fleet, firings, log=self.say, trainer=self, load=load)
        stopped: str | None = None
        for step in range(1, plan.steps + 1):
            load()
            firing.at(step)
            try:
                self.refit(fleet)
            except FleetStopped as exc:
                stopped = str(exc)
                break
            firing.settle(step)
        results = [r for p in pending for r in fleet.collect(p)]
        rep.observed = "stops" if stopped else "recovers"
        if stopped:
            rep.notes.append(f"stopped: {stopped[:300]}")
        kills = sum(1 for f in firings if f.what in CONTROLLER_WHAT and f.where != "shutdown")
        self._extra_checks(fleet, variant, rep, t0, generation + kills)
        self._account(fleet, before, t0, results, rep)
        if any(f.what in CONTROLLER_WHAT and f.where == "shutdown" for f in firings):
            self._shutdown_clean(fleet, rep)
        judge(rep, firing.fired, self.events(t0), self.journal_since(t0))

    def _extra_checks(self, fleet: Fleet, variant: Variant, rep: VariantReport, t0: float, generation: int) -> None:
        for check in variant.checks:
            kind, _, arg = check.partition(":")
            slot = int(arg) if arg else None
            if kind == "below_quorum":
                problems = invariants.requests_waited_below_quorum(self.events(t0))
                rep.violations += [f"check {check}: {p}" for p in problems]
                continue
            if kind == "resent":  # a frozen shard: evicted within the detection bound, its requests re-sent then
                self._wait(lambda: self._evicted(slot, t0), 60, f"eviction of slot {slot}")
                bound = fleet.status()[_detection_bound(variant, slot)]
                measured: dict = {}
                problems = prove_resent(self.events(t0), self.journal_since(t0), slot, bound, measured=measured)
                rep.violations += [f"check {check}: {p}" for p in problems]
                rep.notes.append(f"check {check}: {measured}")
                continue
            if kind == "reaped":  # the engine core that froze under a live actor died with its eviction
                self._wait(lambda: self._evicted(slot, t0), 60, f"eviction of slot {slot}")
                self._wait(lambda: not prove_core_reaped(self.journal_since(t0), slot, _pid_alive), 30,
                           f"slot {slot}'s stopped engine core to go")
                rep.violations += [f"check {check}: {p}" for p in prove_core_reaped(self.journal_since(t0), slot, _pid_alive)]
                rep.notes.append(f"check {check}: {self._found_after(slot, t0, fleet.status()[_detection_bound(variant, slot)])}")
                continue
            if kind == "controller_back":
                rep.violations += [f"check {check}: {p}" for p in self._controller_back(fleet, generation)]
                continue
            if kind == "promoted":  # a warm spare took the killed serving slot's place (faults.promotion)
                rep.violations += [f"check {check}: {p}" for p in prove_promotion(self.events(t0), slot)]
                continue
            if kind == "delta_sent":  # the variant's refits met the fault with patches in flight (``refit.delta``)
                sent = Transfer.among(self.events(t0, kinds=[Transfer]))
                ok = any(t.delta for t in sent)
                rep.notes.append(f"check {check}: transfers {[(t.version, t.delta, t.bytes, t.delta_refused) for t in sent]}")
            elif kind == "delta_refused":  # an engine without the patches' base refused them; the update went whole
                sent = Transfer.among(self.events(t0, kinds=[Transfer]))
                refused = [t for t in sent if t.delta_refused and f"slot {slot} " in t.delta_refused and not t.delta]
                ok = bool(refused)
                rep.notes.append(f"check {check}: " + (refused[0].delta_refused[:200] if refused else f"none in {sent}"))
            elif kind == "stop_names":
                ok = any(f"slot {slot}" in e.reason for e in Stopped.among(self.events(t0)))
            elif kind == "evicted":
                ok = self._wait(lambda: self._evicted(slot), 60, f"eviction of slot {slot}")
            elif kind == "retired":
                ok = self._wait(lambda: slot_states(fleet.status())[slot] == "retired", 240, f"slot {slot} retired")
            elif kind == "readmitted":
                ok = self._readmitted(fleet, slot)
                how = Readmit.last(self.events(t0, kinds=[Readmit]), lambda r: r.outcome == "readmitted", slot=slot)
                rep.notes.append(f"check {check}: slot {slot} came back "
                                 + (f"re-admitted from {how.donor} at version {how.version}" if how else "by a refit"))
            elif kind == "restamped":
                rep.violations += [f"check {check}: {p}" for p in self._restamped(fleet, slot, t0)]
                continue
            else:
                raise ValueError(f"unknown check {check!r}")
            if not ok:
                rep.violations.append(f"check {check} failed")

    def _found_after(self, slot: int, t0: float, bound_s: float) -> dict:
        """Seconds from the fault on ``slot`` going off (its journal line) to its eviction (the ``kill``)."""
        shot = next((r for r in self.journal_since(t0) if r.get("slot") == slot), None)
        kill = Kill.first(self.events(t0, kinds=[Kill]), lambda k: "evicted" in k.reason, slot=slot)
        if shot is None or kill is None:
            return {"evicted_after_s": None, "bound_s": bound_s}
        return {"evicted_after_s": round(kill.t - shot["t"], 3), "bound_s": bound_s, "reason": kill.reason[:160]}

    def _evicted(self, slot: int, since_t: float = float("-inf")) -> bool:
        """The controller killed an incarnation of ``slot`` as evicted (at or after ``since_t``)."""
        return Kill.first(self.events(since_t, kinds=[Kill]), lambda k: "evicted" in k.reason, slot=slot) is not None

    def _controller_back(self, fleet: Fleet, generation: int) -> list[str]:
        """The controller answers at ``generation`` (one restart per kill), the gate is open, and the fleet
        serves one committed version: every serving slot holds it and a batch comes back tagged with it."""
        out = []
        info = fleet.controller_info()
        if info["generation"] != generation:
            out.append(f"the controller answers at generation {info['generation']}, expected {generation}")
        status = fleet.status()
        version, serving = status["version"], [s for s in status["ledger"]["slots"] if s["state"] == "healthy"]
        if not status["gate_open"] or not serving:
            out.append(f"the gate is {'open' if status['gate_open'] else 'closed'} with {len(serving)} slot(s) serving")
        out += [f"slot {s['slot']} serves version {s['weight_version']}, not the committed {version}"
                for s in serving if s["weight_version"] != version]
        groups = fleet.generate([PROMPT] * 6, n=1, sampling={"max_tokens": 4})
        tags = sorted({r.result.weight_version if r.ok else f"not ok: {r.status}" for g in groups for r in g}, key=str)
        if tags != [version]:
            out.append(f"a batch after the restart came back tagged {tags}, not only the committed version {version}")
        return out

    def _shutdown_clean(self, fleet: Fleet, rep: VariantReport) -> None:
        """Shut the fleet down (its controller crashes half way: armed by the plan) and check that every shard
        actor of every incarnation the fleet listed, and its controller, are gone."""
        slots = fleet.status()["ledger"]["slots"]
        names = [shard_name(fleet.name, s["slot"], inc) for s in slots for inc in range(1, s["incarnation"] + 2)]
        summary = fleet.shutdown()
        self._fleet, self._fleet_key = None, None
        rep.notes.append(f"shutdown: {str(summary)[:300]}")

        def left() -> list[str]:
            return [n for n in names + [controller_name(fleet.name)] if ray_door.find_actor(n) is not None]

        if not self._wait(lambda: not left(), 30, "the fleet's actors gone after its shutdown"):
            rep.violations.append(f"check shutdown_clean: actors still alive 30 s after the shutdown: {left()}")
        if "error" in summary:
            rep.violations.append(f"check shutdown_clean: the shutdown call failed: {summary['error'][:300]}")

    def _readmitted(self, fleet: Fleet, slot: int) -> bool:
        self.heal(fleet)
        inc = next(s["incarnation"] for s in fleet.status()["ledger"]["slots"] if s["slot"] == slot)
        for _ in range(4):  # routing is a random choice of two: a few batches before "never served" counts
            groups = fleet.generate([PROMPT] * 6, n=1, sampling={"max_tokens": 4})
            if inc > 1 and any(r.ok and (r.result.slot, r.result.incarnation) == (slot, inc) for g in groups for r in g):
                return True
        return False

    def _restamped(self, fleet: Fleet, slot: int, t0: float) -> list[str]:
        """A stamp that failed on ``slot``: the ledger dropped its version (it never served the refit's version
        unstamped), and the same incarnation was stamped again (re-admitted from a live peer, or by a later refit),
        and then serves the committed version."""
        out = []
        stamps = Stamp.among(self.events(t0, kinds=[Stamp]))
        failed = [s for s in stamps if any(f[0] == slot for f in s.failed)]
        if not failed:
            return [f"no stamp of slot {slot} failed after the fault: {[s.failed for s in stamps]}"]
        inc = next(f[1] for f in failed[0].failed if f[0] == slot)
        unknown = Health.among(self.events(t0, kinds=[Health]), lambda h: "version unknown" in h.reason,
                               slot=slot, incarnation=inc)
        if not unknown:
            out.append(f"slot {slot} (incarnation {inc}): no transition says its version became unknown")
        self.heal(fleet)
        row = next(s for s in fleet.status()["ledger"]["slots"] if s["slot"] == slot)
        version = fleet.status()["version"]
        if (row["incarnation"], row["state"], row["weight_version"]) != (inc, "healthy", version):
            out.append(f"slot {slot} is {row} once the fleet healed, not incarnation {inc} healthy on {version}")
        for _ in range(4):  # routing is a random choice of two: a few batches before "never served" counts
            rs = [r for g in fleet.generate([PROMPT] * 6, n=1, sampling={"max_tokens": 4}) for r in g]
            mine = [r.result.weight_version for r in rs if r.ok and (r.result.slot, r.result.incarnation) == (slot, inc)]
            if mine:
                return out + ([] if set(mine) == {version} else [f"slot {slot} served versions {mine}, not {version}"])
        return out + [f"slot {slot} (incarnation {inc}) never served after it was re-stamped"]

    def _account(self, fleet: Fleet, before: dict, t0: float, results: list, rep: VariantReport) -> list[dict]:
        """Requests, version tags and invariants since monotonic time ``t0``; returns the whole event log."""
        after = fleet.status()["requests"]
        rep.accepted = after["accepted"] - before["accepted"]
        rep.completed = after["completed"] - before["completed"]
        rep.returned = after["returned"] - before["returned"]
        rep.lost = rep.accepted - rep.completed - rep.returned - after["in_progress"]
        events = self.events()
        new = [e for e in events if e["t"] >= t0]
        rep.wrong_version_tags = len(invariants.version_tags_match_stamps(events)) - len(
            invariants.version_tags_match_stamps([e for e in events if e["t"] < t0])
        ) + len(invariants.open_gate_serves_current_version(new))
        returned = Request.among(new, event=Request.RETURNED)
        rep.notes += [f"returned {r.request_id}: {str(r.reason)[:1200]}" for r in returned[:3]]
        rep.notes += [f"and {len(returned) - 3} more returned"] if len(returned) > 3 else []
        rep.violations += invariants.requests_accounted(new) + invariants.phases_within_deadline(
            new, fleet.config.lifecycle_deadline_s, slack_s=fleet.config.probe_timeout_s + 2.0
        ) + invariants.gate_closed_after_stop(new)
        return events


def run_variants(model_dir: str, variants: list[Variant], log: Callable = print, done: list | None = None,
                 **kw: Any) -> list[VariantReport]:
    """Each variant in turn on the runner's fleets; returns their reports, also appended to ``done`` as each
    ends. A signal (``fleet.interrupt``) ends the run after shutting the fleet down, or abandoning it if the
    signal also stopped the local Ray; ``done`` then holds the variants that finished."""
    runner = FaultRunner(model_dir, log=log, **kw)
    reports = [] if done is None else done
    gone = None
    try:
        for v in variants:
            reports.append(runner.run(v))
        return reports
    except KeyboardInterrupt:
        dead = ray_door.local_ray_down()
        gone = ray_door.ray_down_reason(dead) if dead else None
        raise
    finally:
        runner.close(ray_gone=gone)


def _detection_bound(variant: Variant, slot: int) -> str:
    """The status field bounding how long finding the freeze of ``slot`` may take: a frozen shard answers
    no ping (``hang_detection_bound_s``); an engine core frozen with work in flight under a live actor is
    found by its missing progress (``stall_detection_bound_s``)."""
    whats = {f["what"] for f in variant.plan["faults"] if f.get("shard") == slot}
    return "stall_detection_bound_s" if "freeze_core" in whats else "hang_detection_bound_s"


def _pid_alive(pid: int) -> bool:
    """A process of this host that has not exited (a zombie has)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
