"""The chaos soak: random recoverable faults at a set rate on a live fleet, for a bounded time.

Each step runs generation across a refit, as the fault runner does; before a step,
with probability ``rate_per_min * step_s / 60``, one random fault (kill at a step
boundary, in pause, transfer or resume; engine-core crash in generation; freeze in
transfer) hits a random slot, but only while every slot serves, so the fleet stays
above quorum by construction and every fault must be recovered from. Restarts are on.

Reported from the event log: faults, recoveries (the hit slot serves again, on a
new incarnation), time to recover (fault -> the replacement is stamped with the
current weights) and time to reopen (fault -> next gate opening) percentiles, and
every DESIGN invariant.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

from faults import invariants
from fleet.errors import FleetStopped
from faults.runner import PROMPT, SAMPLING, FaultRunner
from health.faultplan import Firing, load_plan

RECOVERABLE = (
    ("step_boundary", "kill"),
    ("pause", "kill"),
    ("transfer", "kill"),
    ("resume", "kill"),
    ("generate", "crash_engine"),
    ("transfer", "freeze"),
)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 3)


def _serves_again(x: dict, slot: int, incarnation: int) -> bool:
    """A replacement incarnation was stamped with weights, or the same one answered its probes again."""
    if x["kind"] == "stamp":
        return any(s == slot and inc > incarnation for s, inc in x["members"])
    return x["kind"] == "health" and x["slot"] == slot and x["incarnation"] == incarnation and x["after"] == "healthy"


def recovery_times(events: list[dict]) -> tuple[list[float], list[float], int]:
    """(time to recover, time to reopen, unrecovered) per slot that left healthy because of a fault."""
    recover, reopen, unrecovered = [], [], 0
    for i, e in enumerate(events):
        if not (e["kind"] == "health" and e["before"] == "healthy" and e["after"] in ("dead", "suspect", "hung")):
            continue
        slot, inc0, t0 = e["slot"], e["incarnation"], e["t"]
        back = next((x["t"] for x in events[i + 1:] if _serves_again(x, slot, inc0)), None)
        opened = next((x["t"] for x in events[i:] if x["kind"] == "gate" and x["open"]), None)
        if back is None:
            unrecovered += 1
        else:
            recover.append(back - t0)
        if opened is not None:
            reopen.append(opened - t0)
    return recover, reopen, unrecovered


def soak(model_dir: str, duration_s: float = 600.0, rate_per_min: float = 3.0, seed: int = 0,
         groups: int = 3, log: Callable = print) -> dict:
    rng = random.Random(seed)
    runner = FaultRunner(model_dir, groups=groups, log=log)
    plan = load_plan({"name": "chaos-soak", "expect": "recovers", "fleet": {"restart_budget": 10_000}})
    t_start = time.monotonic()
    fired: list[tuple[str, str, int]] = []
    steps, stopped = 0, None
    try:
        fleet = runner.fleet_for(plan)
        n = fleet.config.num_engines
        last = time.monotonic()
        while time.monotonic() - t_start < duration_s:
            step_s = max(0.5, time.monotonic() - last)
            last = time.monotonic()
            pending = [fleet.submit(PROMPT, 2, SAMPLING) for _ in range(groups)]
            states = runner.states(fleet)
            if all(v == "healthy" for v in states.values()) and rng.random() < rate_per_min * step_s / 60.0:
                where, what = RECOVERABLE[rng.randrange(len(RECOVERABLE))]
                slot = rng.randrange(n)
                runner.fire(fleet, Firing(0, where, what, slot))
                fired.append((where, what, slot))
                log(f"[soak] t={time.monotonic() - t_start:6.1f}s fault {len(fired)}: {what} at {where} on slot {slot}")
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
        events = fleet.events()
        status = fleet.status()
    finally:
        runner.close()
    recover, reopen, unrecovered = recovery_times(events)
    violations = invariants.check_all(events, fleet.config.lifecycle_deadline_s, slack_s=fleet.config.probe_timeout_s + 2.0)
    req = status["requests"]
    return {
        "duration_s": round(time.monotonic() - t_start, 1),
        "steps": steps,
        "faults": len(fired),
        "fault_kinds": sorted({f"{w}:{a}" for w, a, _ in fired}),
        "recoveries": len(recover),
        "unrecovered": unrecovered,
        "recover_p50_s": _pct(recover, 50),
        "recover_p95_s": _pct(recover, 95),
        "reopen_p50_s": _pct(reopen, 50),
        "reopen_p95_s": _pct(reopen, 95),
        "prompts_accepted": req["accepted"],
        "prompts_lost": req["accepted"] - req["completed"] - req["returned"] - req["in_progress"],
        "prompts_returned": req["returned"],
        "wrong_version_tags": len(invariants.version_tags_match_stamps(events))
        + len(invariants.open_gate_serves_current_version(events)),
        "invariants_held": not violations and stopped is None,
        "violations": violations[:20],
        "stopped": stopped,
    }
