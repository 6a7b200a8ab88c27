"""Fault firing: the firings of a resolved fault plan carried out on a live fleet, step by step.

The demo, the fault runner and the chaos soak fire faults through ``FaultFiring``
only, so a firing means the same everywhere, and this is the one place that knows
how each kind of fault is fired (``faults.evidence`` is the one that knows how each
is proven):

- a ``kill`` at the ``step_boundary`` is ``kill_shard`` (``fleet.operator.FaultInjector``) once the slot is up
  (healthy or stale; waited for up to ``up_timeout_s``, since killing a slot that is
  still restarting would hit nothing);
- a ``kill`` ``between_refits`` is the same kill; once the step's firings are done,
  the firing waits until the controller found each such slot gone (on its own, before
  any refit), submits a batch of requests (``load``: they must wait while the fleet is
  below quorum), then waits until the slots are back up (restarted, stale; or retired,
  their restart budget spent: they never come back), so the step's refit can bring them in;
- a ``freeze`` ``between_refits`` is armed at the shard's next request (``generate``), and
  batches are submitted (``load``, every ``PROVOKE_EVERY_S``) until the controller found
  the slot gone; then as for a kill. The controller must evict it within its
  ``hang_detection_bound_s`` (recorded as ``bound_s``), and its requests are re-sent then;
- every other shard fault is armed with ``arm_fault`` at the shard's hook point
  for its ``where`` and goes off when the shard reaches that point;
- a ``kill_controller`` kills the fleet's controller (Ray restarts it; the new one
  re-adopts the shards). ``between_refits``: its process is SIGKILLed from here
  (``os.kill`` on the pid ``Fleet.controller_info`` names, read just before) while the
  step's requests are in flight; a batch is submitted while it is down (``load``), and
  the firing waits until the controller answers again (its generation grew) and
  records the client's view of the outage. At a refit phase or ``shutdown``:
  ``arm_controller_crash`` (the controller kills itself when it gets there);
- a trainer's fault (``where: update`` or ``call``) is a ``sync_weights`` call the
  firing makes itself, with the ``trainer``'s weight source, and records as it ends:
  ``corrupt_<kind>``: the source's next update corrupted (``TENSOR``), one refit,
  the source restored; ``kill_sender``: the source dies as its next send begins, one
  refit, a new source in its place (Ray's word on the old one recorded); ``stale_version``: a refit of the committed version;
  ``concurrent_refit``: two refits of the next two versions from two threads at once;
  ``poison_request``: a prompt armed to crash every engine, sent twice; ``poison_in_batch``: one in a batch of
  24 on three engines (``faults.poison``); ``readmit_*``: a fault in the middle of a stale engine's
  re-admission from a live peer (``faults.readmit``).

On failure: a fleet call that fails raises to the caller (nothing is recorded as
fired), except a refit the fault makes, whose ``RefitRefused``, ``RefitNotDelivered`` or ``FleetStopped`` is
recorded (``calls``) for the proof to judge; a slot that is not up in time is killed
anyway, and every wait that gives up is logged.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Callable, Iterable, Protocol

from rlfleet.faults.admission_hold import admission_hold_across_refit
from rlfleet.faults.load import refit_under_load
from rlfleet.faults.loop_fault import loop_error_then_kill
from rlfleet.faults.operator import controller_kill_under_keep_pause, operator_resume_mid_refit
from rlfleet.faults.relay_commit import relay_commit_lost
from rlfleet.faults.poison import poison_in_batch, poison_request
from rlfleet.faults.readmit import SCENARIOS as READMIT_SCENARIOS
from rlfleet.faults.polling import wait_until
from rlfleet.faults.resize_load import resize_under_load
from rlfleet.fleet.errors import FleetStopped, RefitNotDelivered, RefitRefused
from rlfleet.health.faultplan import CONTROLLER_WHAT, TRAINER_WHERE, Firing

# A plan's ``where`` -> the shard's fault hook point (a step-boundary fault other than a kill goes off at the next probe).
# A ``freeze`` ``between_refits`` goes off at the shard's next request: one is in flight on it when it freezes.
POINT_OF = {"pause": "pause", "transfer": "transfer", "stamp": "set_weight_version", "resume": "resume",
            "generate": "generate", "stream": "stream", "donate": "donate", "step_boundary": "ping",
            "between_refits": "generate"}
UP = ("healthy", "stale")
KILLED_BY_THE_CONTROLLER = ("step_boundary", "between_refits")
PROVOKE_EVERY_S = 2.0
FREEZES = ("freeze", "freeze_core")  # the whole shard, or only its engine core under a live actor
TENSOR = "model.layers.1.mlp.up_proj.weight"  # the tensor an ``update`` fault corrupts (or leaves out with its layer)


class Trainer(Protocol):
    """What a trainer's faults need from the driver: its weight source (``sync_weights``'s ``source``),
    fresh versions, and a way to break the source's updates."""

    source: Any

    def new_version(self) -> int:
        """Take a training step on ``source``; return the new version number (never used before)."""

    def corrupt_next_update(self, kind: str | None, tensor: str) -> None:
        """From now on every update of ``source`` is corrupted (``faults.source.CORRUPTIONS``); None restores it."""

    def kill_source_at_next_send(self) -> None:
        """The ``source``'s process dies as its next send begins (``WeightSource.die_at_next_send``)."""

    def replace_source(self) -> str:
        """A new ``source`` in place of the current one (killed); returns what Ray says of the old one."""

    def skip_to(self, version: int) -> None:
        """Versions up to ``version`` were committed by another trainer: ``new_version`` goes on above it."""


def hook_point(where: str, what: str) -> str:
    """Where a firing goes off: ``step_boundary`` for the controller's own kill, ``update``/``call`` for a
    trainer's fault (its own refit call), the controller's point for a ``kill_controller``, else the
    shard's hook point."""
    if what == "kill" and where in KILLED_BY_THE_CONTROLLER:
        return "step_boundary"
    return where if where in TRAINER_WHERE or what in CONTROLLER_WHAT else POINT_OF[where]


def slot_states(status: dict) -> dict[int, str]:
    """Each slot's health state in a ``Fleet.status()``."""
    return {s["slot"]: s["state"] for s in status["ledger"]["slots"]}


def incarnations(status: dict) -> dict[int, int]:
    """Each slot's current incarnation in a ``Fleet.status()``."""
    return {s["slot"]: s["incarnation"] for s in status["ledger"]["slots"]}


class FaultFiring:
    """Fires ``firings`` on ``fleet`` when the caller's loop reaches their step; keeps a record of what fired.

    ``fired``: one dict per firing done (the ``Firing``'s fields and ``t``, seconds since ``t0``): killed,
    armed, or (a trainer's fault) the refit calls it made, each with its ``version``, ``outcome``
    (``committed``, ``refused``, ``stopped``), ``error`` and ``began``/``ended`` (``time.monotonic()``, the
    event log's clock on this host); a ``kill_controller``: the ``controller`` it aimed at (pid and generation,
    read just before), and from outside ``killed_at`` (``time.monotonic()`` just after the kill), the
    controller ``after`` (pid and generation once it answered again) and the client's ``outage``
    (completed and submitted while it was down). An armed fault goes off later, if ever;
    ``faults.evidence.prove`` tells from the records. ``trainer``: needed by trainer's faults only;
    ``load``: submits a batch of requests and returns how many (``between_refits`` kills).
    """

    def __init__(self, fleet, firings: Iterable[Firing] = (), log: Callable[[str], object] | None = None,
                 t0: float | None = None, up_timeout_s: float = 240.0, trainer: Trainer | None = None,
                 load: Callable[[], int] | None = None) -> None:
        self.fleet = fleet
        self.faults = fleet.fault_injector()  # ``fleet.operator.FaultInjector``: what arms and kills
        self.firings = list(firings)
        self.log = log
        self.t0 = time.monotonic() if t0 is None else t0
        self.up_timeout_s = up_timeout_s
        self.trainer = trainer
        self.load = load
        self.fired: list[dict] = []

    def due(self, step: int) -> list[Firing]:
        """The firings planned for ``step``, in plan order."""
        return [f for f in self.firings if f.step == step]

    def beyond(self, step: int) -> list[Firing]:
        """The firings planned after ``step`` (a loop that ends at ``step`` never fires them)."""
        return [f for f in self.firings if f.step > step]

    def at(self, step: int) -> list[Firing]:
        """Fire every firing planned for ``step``, then wait out the ``between_refits`` kills; returns them."""
        due = self.due(step)
        shard_kills = [f for f in due if f.where == "between_refits" and f.slot is not None]
        before = incarnations(self.fleet.status()) if shard_kills else {}
        for f in due:
            self.fire(f)
        self._between_refits({f.slot: before[f.slot] for f in shard_kills},
                             frozen={f.slot for f in shard_kills if f.what in FREEZES})
        return due

    def fire(self, f: Firing) -> None:
        done: dict = {}
        if f.where in TRAINER_WHERE:
            done = self._trainer_fault(f)
        elif f.what in CONTROLLER_WHAT:
            done = self._controller_fault(f)
        elif hook_point(f.where, f.what) == "step_boundary":
            self._wait_up(f.slot, "the kill")
            self.faults.kill_shard(f.slot)
        else:
            self._arm(f)
        if f.where == "between_refits" and f.what in FREEZES:  # freeze_core: with a request in flight, by its stall
            done["bound_s"] = self.fleet.status()["stall_detection_bound_s" if f.what == "freeze_core"
                                                  else "hang_detection_bound_s"]
        self.fired.append({**asdict(f), "t": round(time.monotonic() - self.t0, 3), **done})

    def _wait_up(self, slot: int, before: str) -> None:
        self._say_if(not wait_until(lambda: slot_states(self.fleet.status()).get(slot) in UP, self.up_timeout_s),
                     f"gave up waiting for slot {slot} up before {before} after {self.up_timeout_s:.0f} s")

    def _arm(self, f: Firing) -> None:
        """Arm ``f`` on its slot once the slot is up. An incarnation that died as it was armed (the controller
        replaced it meanwhile: a loaded machine, an earlier variant's leftovers) is not where the plan meant
        the fault: it is armed once more on the incarnation that took its place. The journal still proves
        where it fired."""
        self._wait_up(f.slot, "arming the fault")
        was = incarnations(self.fleet.status()).get(f.slot)
        try:
            self.faults.arm_fault(f.slot, POINT_OF[f.where], f.what, f.delay_s, f.after_calls)
        except RuntimeError as exc:
            if "died" not in str(exc):
                raise
            self._say_if(True, f"slot {f.slot} died as its fault was armed ({exc}); arming it on the next incarnation")

            def replaced() -> bool:
                status = self.fleet.status()
                return incarnations(status).get(f.slot) != was and slot_states(status).get(f.slot) in UP

            self._say_if(not wait_until(replaced, self.up_timeout_s),
                         f"gave up waiting for slot {f.slot}'s next incarnation after {self.up_timeout_s:.0f} s")
            self.faults.arm_fault(f.slot, POINT_OF[f.where], f.what, f.delay_s, f.after_calls)

    def settle(self, step: int) -> list[Firing]:
        """After the step's refit: the faults of ``step`` that would outlive it are undone (a ``slow`` shard
        answers at full speed again: armed anew with no delay), so later steps and later variants on the same
        fleet run at full speed and health probes of that shard do not time out. Returns them."""
        slowed = [f for f in self.due(step) if f.what == "slow" and f.slot is not None]
        for f in slowed:
            self.faults.arm_fault(f.slot, "ping", "slow", 0.0)
        return slowed

    def _say_if(self, cond: bool, message: str) -> None:
        if cond and self.log:
            self.log(message)

    # ------------------------------------------------------------------ between refits
    def _between_refits(self, killed: dict[int, int], frozen: set[int] = frozenset()) -> None:
        """The controller finds each killed (or frozen) incarnation gone on its own; requests submitted then
        wait; the slots come back up (restarted) before the step's refit. A frozen slot freezes at its next
        request: batches are submitted until it did and the controller noticed."""
        if not killed:
            return

        def gone() -> bool:
            status = self.fleet.status()
            states, incs = slot_states(status), incarnations(status)
            return all(states[s] not in UP or incs[s] != inc for s, inc in killed.items())

        deadline = time.monotonic() + 60
        while frozen and not gone() and time.monotonic() < deadline:
            if self.load:
                self.load()
            wait_until(gone, PROVOKE_EVERY_S)
        self._say_if(not wait_until(gone, max(0.0, deadline - time.monotonic())),
                     f"gave up waiting for the controller to find slots {sorted(killed)} gone")
        self._client_caught_up()
        waiting = self.load() if self.load else 0
        back = lambda: {s: st for s, st in slot_states(self.fleet.status()).items() if s in killed}  # noqa: E731
        self._say_if(not wait_until(lambda: set(back().values()) <= {*UP, "retired"}, self.up_timeout_s),
                     f"gave up waiting for slots {sorted(killed)} back up after {self.up_timeout_s:.0f} s")
        self._say_if("retired" in back().values(), f"not back (retired: restart budget spent): {back()}")
        for rec in self.fired:
            if rec["where"] == "between_refits" and rec["slot"] in killed and "submitted_while_gone" not in rec:
                rec["submitted_while_gone"] = waiting

    def _client_caught_up(self, timeout_s: float = 30.0) -> None:
        """Wait until the fleet's client holds the routing state the controller publishes now: the requests
        submitted next are accepted under the controller's view (below quorum: a closed gate), not under the
        state the client held before the close reached it."""
        epoch = self.fleet.status()["routing_epoch"]
        self._say_if(not wait_until(lambda: self.fleet.client.routing().epoch >= epoch, timeout_s),
                     f"gave up waiting for the client to reach routing epoch {epoch} after {timeout_s:.0f} s")

    # ------------------------------------------------------------------ the controller's faults
    def _controller_fault(self, f: Firing) -> dict:
        """Arm the controller's crash at its point, or kill its process now (``between_refits``)."""
        info = self.fleet.controller_info()
        done: dict[str, Any] = {"controller": {"pid": info["pid"], "generation": info["generation"]}}
        if f.where != "between_refits":
            self.faults.arm_controller_crash(f.where, f.delay_s)
            return done
        outage0 = self.fleet.client.controller_outage()
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError as exc:
            return {**done, "error": f"os.kill({info['pid']}): {exc}"}
        done["killed_at"] = round(time.monotonic(), 6)
        waiting = self.load() if self.load else 0  # sent while the controller is down: straight to the shards
        after = self.fleet.controller_info()  # waits for the restarted controller (it re-adopts first)
        self._say_if(not wait_until(lambda: self.fleet.client.controller_outage()["unreachable_since"] is None, 60),
                     "gave up waiting for the client to reach the restarted controller after 60 s")
        outage = self.fleet.client.controller_outage()
        self._say_if(after["generation"] <= info["generation"],
                     f"the controller answered at generation {after['generation']} after its kill: not restarted?")
        return {**done, "after": {"pid": after["pid"], "generation": after["generation"]},
                "outage": {"outages": outage["outages"] - outage0["outages"],
                           "down_s": round(outage["down_s_total"] - outage0["down_s_total"], 3),
                           "completed_while_down": outage["completed_while_down"] - outage0["completed_while_down"],
                           "submitted_while_down": waiting}}

    # ------------------------------------------------------------------ trainer's faults
    def _trainer_fault(self, f: Firing) -> dict:
        if self.trainer is None:
            raise ValueError(f"{f.what} at {f.where} needs the trainer's weight source; this driver gave none")
        if f.what.startswith("corrupt_"):
            return self._corrupt_update(f.what.removeprefix("corrupt_"))
        if f.what == "stale_version":
            return self._stale_version()
        if f.what == "kill_sender":
            return self._kill_sender()
        if f.what == "refit_under_load":
            return refit_under_load(self.fleet, lambda: self._sync(self.trainer.new_version()))
        if f.what == "poison_request":
            return poison_request(self.fleet, self.log or print)
        if f.what == "poison_in_batch":
            return poison_in_batch(self.fleet, self.log or print)
        if f.what == "operator_resume_mid_refit":
            return operator_resume_mid_refit(self.fleet, lambda: self._sync(self.trainer.new_version()), self.log or print)
        if f.what == "controller_kill_under_keep_pause":
            return controller_kill_under_keep_pause(self.fleet, self.log or print)
        if f.what == "loop_error_then_kill":
            return loop_error_then_kill(self.fleet, self.log or print)
        if f.what == "relay_commit_lost":
            done = relay_commit_lost(self.fleet, self.log or print)
            self.trainer.skip_to(int(done["fleet_version"]))  # the RL surface numbered two versions of its own
            return done
        if f.what == "admission_hold_across_refit":
            return admission_hold_across_refit(self.fleet, self.trainer.new_version, self._sync, self.log or print)
        if f.what in READMIT_SCENARIOS:
            return READMIT_SCENARIOS[f.what](self.fleet, self.trainer.new_version, self._sync, self.log or print)
        if f.what == "resize_under_load":
            rec = resize_under_load(self.fleet, lambda: self._sync(self.trainer.new_version()))
            self._say_if(True, f"resize under load: added {rec['added']}, removed {rec['removed']}, new engine "
                               f"{rec['new_engine']}, drained {rec['resizes'][1]['summary'].get('drained')}, "
                               f"{rec['completed']} of {rec['submitted']} requests completed")
            return rec
        return self._concurrent_refits()

    def _sync(self, version: int) -> dict:
        """One ``sync_weights`` from the trainer's source; a refusal or a stop is recorded, not raised."""
        began = time.monotonic()
        outcome, error = "committed", None
        try:
            self.fleet.sync_weights(version, self.trainer.source)
        except (RefitRefused, RefitNotDelivered, FleetStopped) as exc:
            outcome = "refused" if isinstance(exc, RefitRefused) else "rolled_back" if isinstance(exc, RefitNotDelivered) \
                else "stopped"
            error = f"{type(exc).__name__}: {exc}"
        return {"version": version, "outcome": outcome, "error": error, "began": round(began, 6),
                "ended": round(time.monotonic(), 6)}

    def _serving(self) -> dict:
        status = self.fleet.status()
        return {"gate_open": status["gate_open"], "version": status["version"], "states": slot_states(status),
                "in_flight": status["requests"]["in_progress"]}

    def _corrupt_update(self, kind: str) -> dict:
        before = self._serving()
        version = self.trainer.new_version()
        self.trainer.corrupt_next_update(kind, TENSOR)
        try:
            call = self._sync(version)
        finally:
            self.trainer.corrupt_next_update(None, TENSOR)
        return {"tensor": TENSOR, "calls": [call], "before": before, "after": self._serving()}

    def _kill_sender(self) -> dict:
        before = self._serving()
        version = self.trainer.new_version()
        sender = repr(self.trainer.source)
        self.trainer.kill_source_at_next_send()
        try:
            call = self._sync(version)
        finally:
            state = self.trainer.replace_source()  # the next step's refit comes from a new sender
        return {"calls": [call], "before": before, "after": self._serving(), "sender": sender, "sender_state": state}

    def _stale_version(self) -> dict:
        before = self._serving()
        return {"calls": [self._sync(before["version"])], "before": before, "after": self._serving()}

    def _concurrent_refits(self) -> dict:
        versions = [self.trainer.new_version(), self.trainer.new_version()]
        together = threading.Barrier(len(versions))

        def go(version: int) -> dict:
            together.wait(timeout=60)
            return self._sync(version)

        with ThreadPoolExecutor(len(versions)) as pool:
            calls = list(pool.map(go, versions))
        return {"calls": calls}
