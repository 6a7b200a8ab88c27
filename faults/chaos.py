"""The chaos soak: random recoverable faults at a set rate on a live fleet, for a bounded time.

Each step runs generation across a refit, as the fault runner does; before a step,
with probability ``rate_per_min * step_s / 60``, one random fault (kill at a step
boundary, in pause, transfer or resume; engine-core crash in generation; freeze in
transfer) hits a random slot, or the controller is killed (its process SIGKILLed from
outside with the step's requests in flight, or crashing itself at a random phase of
the step's refit), but only while every slot serves, so the fleet stays above quorum
by construction and every fault must be recovered from. The first two faults of a
soak are the two controller kills (so even a short soak has both); every later one
is drawn from all of them. A soak whose duration ends before both went off (its slots
were not all serving when one was due) goes on, for at most ``overtime_s``, firing
them at the first steps where every slot serves; ``held_back`` counts the steps that
waited, by the states seen. Restarts are on, the controller's too.

Reported from the records (``faults.evidence``: the fault journal and the event
log): the faults that went off, those that went off and did nothing, those
recovered from (the slot serves again: a new incarnation stamped with weights, or
the same one healthy again; the controller: restarted and re-adopted the fleet) and
not, time to recover (departure -> serving again; the controller: kill -> re-adopted)
and time to reopen (firing -> next gate opening) percentiles, and every DESIGN
invariant. A fault armed but not gone off by the end is counted, not judged.
"""

from __future__ import annotations

import random
import time
from typing import Callable

from rlfleet.faults import invariants
from rlfleet.faults.evidence import describe, had_effect, prove
from rlfleet.faults.firing import FaultFiring, slot_states
from rlfleet.faults.runner import PROMPT, SAMPLING, FaultRunner
from rlfleet.faults.timeline import percentile
from rlfleet.fleet.errors import FleetStopped
from rlfleet.health.faultplan import REFIT_PHASES, Firing, load_plan

AT_A_PHASE = "<a refit phase>"  # drawn at random from REFIT_PHASES when the fault is fired
CONTROLLER_KILLS = (("between_refits", "kill_controller"), (AT_A_PHASE, "kill_controller"))
RECOVERABLE = (
    ("step_boundary", "kill"),
    ("pause", "kill"),
    ("transfer", "kill"),
    ("resume", "kill"),
    ("generate", "crash_engine"),
    ("transfer", "freeze"),
) + CONTROLLER_KILLS


def due(elapsed_s: float, fired: int, duration_s: float, overtime_s: float) -> bool:
    """Whether the soak takes another step: within its duration, or past it (by at most
    ``overtime_s``) while the controller kills every soak must have are still to fire."""
    if elapsed_s < duration_s:
        return True
    return fired < len(CONTROLLER_KILLS) and elapsed_s < duration_s + overtime_s


def soak(model_dir: str, duration_s: float = 600.0, rate_per_min: float = 3.0, seed: int = 0,
         groups: int = 3, log: Callable = print, overtime_s: float = 240.0) -> dict:
    rng = random.Random(seed)
    runner = FaultRunner(model_dir, groups=groups, log=log)
    plan = load_plan({"name": "chaos-soak", "expect": "recovers",
                      "fleet": {"restart_budget": 10_000, "controller_max_restarts": 10_000}})
    steps, stopped = 0, None
    held_back: dict[str, int] = {}  # steps with a fault due that waited for every slot to serve: the states seen
    try:
        fleet = runner.fleet_for(plan)
        t_start = time.monotonic()  # the soak's duration starts once the fleet is up (its start is not soak time)
        pending: list = []

        def load() -> int:  # a batch sent while the controller is down (killed from outside)
            batch = [fleet.submit(PROMPT, 2, SAMPLING) for _ in range(groups)]
            pending.extend(batch)
            return len(batch)

        firing = FaultFiring(fleet, log=runner.say, t0=t_start, load=load)
        n = fleet.config.num_engines
        last = time.monotonic()
        while due(time.monotonic() - t_start, len(firing.fired), duration_s, overtime_s):
            step_s = max(0.5, time.monotonic() - last)
            last = time.monotonic()
            pending[:] = [fleet.submit(PROMPT, 2, SAMPLING) for _ in range(groups)]
            states = slot_states(fleet.status())
            serving = all(v == "healthy" for v in states.values())
            mandatory = len(firing.fired) < len(CONTROLLER_KILLS)  # still owed: forced once the duration is up
            if not serving and mandatory:
                seen = ",".join(f"{s}:{v}" for s, v in sorted(states.items()) if v != "healthy")
                held_back[seen] = held_back.get(seen, 0) + 1
            overtime = time.monotonic() - t_start >= duration_s
            if serving and ((mandatory and overtime) or rng.random() < rate_per_min * step_s / 60.0):
                k = len(firing.fired)
                where, what = CONTROLLER_KILLS[k] if k < len(CONTROLLER_KILLS) else RECOVERABLE[rng.randrange(len(RECOVERABLE))]
                where = REFIT_PHASES[rng.randrange(len(REFIT_PHASES))] if where == AT_A_PHASE else where
                slot = None if what == "kill_controller" else rng.randrange(n)
                firing.fire(Firing(0, where, what, slot))
                on = "the controller" if slot is None else f"slot {slot}"
                log(f"[soak] t={time.monotonic() - t_start:6.1f}s fault {len(firing.fired)}: {what} at {where} on {on}")
            try:
                runner.refit(fleet)
            except FleetStopped as exc:
                stopped = str(exc)
                break
            for p in pending:
                fleet.collect(p)
            steps += 1
        if not stopped:
            runner.heal(fleet)
        events = runner.events()  # from the file: the records of every controller generation
        status = fleet.status()
        journal = runner.journal_since(t_start)
    finally:
        runner.close()
    fired, _ = prove(firing.fired, events, journal)  # armed but not gone off by the end: counted below, not judged
    recover = [f["recover_s"] for f in fired if f["left_for"]]
    violations = invariants.check_all(events, fleet.config.lifecycle_deadline_s, slack_s=fleet.config.probe_timeout_s + 2.0)
    req = status["requests"]
    return {
        "duration_s": round(time.monotonic() - t_start, 1),
        "steps": steps,
        "faults": len(firing.fired),
        "held_back": held_back,
        "controller_kills": sum(1 for f in firing.fired if f["what"] == "kill_controller"),
        "faults_fired": len(fired),
        "fault_kinds": sorted({f"{f['point']}:{f['action']}" for f in fired}),
        "faults_without_effect": [describe(f) for f in fired if not had_effect(f)],
        "recoveries": sum(r is not None for r in recover),
        "unrecovered": sum(r is None for r in recover),
        "recover_p50_s": percentile(recover, 0.5, 3),
        "recover_p95_s": percentile(recover, 0.95, 3),
        "reopen_p50_s": percentile((f["fault_to_reopen_s"] for f in fired), 0.5, 3),
        "reopen_p95_s": percentile((f["fault_to_reopen_s"] for f in fired), 0.95, 3),
        "prompts_accepted": req["accepted"],
        "prompts_lost": req["accepted"] - req["completed"] - req["returned"] - req["in_progress"],
        "prompts_returned": req["returned"],
        "wrong_version_tags": len(invariants.version_tags_match_stamps(events))
        + len(invariants.open_gate_serves_current_version(events)),
        "invariants_held": not violations and stopped is None,
        "violations": violations[:20],
        "stopped": stopped,
    }
