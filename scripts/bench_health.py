"""Benchmark the health decision core: random events over a large fleet.

Applies ``--events`` (default 1,000,000) random events to a ``--slots`` (default
1,024) slot ledger with ``health.step`` (decide + apply) and reports events per
second. Events are generated from the ledger's current state so they exercise real
transitions (deaths, unavailability, probes, hangs, lies, restarts, refit reports,
late events from replaced incarnations, refit cycles with commits, clock ticks)
rather than being mostly ignored as late. Lifecycle calls (pause, transfer,
resume) and refit reports happen inside refit windows, ordinary traffic outside;
a refit is committed only if nothing aborted it, as a controller would.

The last line of output is one JSON object:

- ``events_per_s``: events / wall seconds of the whole loop (event generation,
  decide, apply, bookkeeping): the conservative headline figure;
- ``core_events_per_s``: events / wall seconds spent inside ``step`` only;
- ``cpu_events_per_s``: events / CPU seconds of this process (robust when other
  processes share the machine);
- ``events``, ``slots``, ``seconds``, ``cpu_seconds``, ``seed``, ``refits``, and
  counts of decisions by class, actions by type and final states, and the
  machine's 1-minute load average (a loaded machine lowers the wall-clock rates).

Usage: ``python scripts/bench_health.py [--events N] [--slots N] [--seed N]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rlfleet.health import (  # noqa: E402  (the path line above makes the repo importable)
    CallKind,
    EngineReady,
    FailureClass,
    HealthConfig,
    Ledger,
    Observed,
    RefitFinished,
    RefitReport,
    RefitResult,
    RefitStarted,
    SlotPhase,
    Tick,
    VersionCommitted,
    step,
)

LAUNCHING, LIVE, SUSPECT, HUNG, DEAD, RETIRED = (
    SlotPhase.LAUNCHING, SlotPhase.LIVE, SlotPhase.SUSPECT,
    SlotPhase.HUNG, SlotPhase.DEAD, SlotPhase.RETIRED,
)
LIFECYCLE = (CallKind.PAUSE, CallKind.REFIT, CallKind.REFIT, CallKind.RESUME)
REFIT_EVERY = 4_000      # events between refit starts
REFIT_LENGTH = 2_000     # events a refit stays open before commit + finish
TICK_EVERY = 50          # events between ticks
DT = 0.001               # seconds of fake time per event


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def slot_event(rng: random.Random, ledger: Ledger, slot: int) -> object:
    """A plausible event for ``slot`` given its stored phase."""
    rec = ledger._records[slot]
    inc = rec.incarnation
    r = rng.random()
    if r < 0.05 and inc > 1:  # late event from a replaced incarnation
        return Observed(slot, inc - 1, CallKind.GENERATE, FailureClass.DEAD, "late death")
    phase = rec.phase
    if phase is LIVE:
        if ledger.refit_version is None:
            return live_event_outside_refit(r, slot, inc)
        return live_event_during_refit(rng, r, slot, inc, ledger.refit_version)
    if phase is SUSPECT or phase is HUNG:
        failure = FailureClass.OK if r < 0.6 else (
            FailureClass.SUSPECT if r < 0.85 else (FailureClass.HUNG if r < 0.95 else FailureClass.DEAD))
        return Observed(slot, inc, CallKind.PROBE, failure, "probe")
    if phase is LAUNCHING:
        if r < 0.9:
            return EngineReady(slot, inc)
        return Observed(slot, inc, CallKind.START, FailureClass.ERROR, "start failed")
    # DEAD or RETIRED: a duplicate report about the condemned incarnation.
    return Observed(slot, inc, CallKind.GENERATE, FailureClass.DEAD, "duplicate")


def live_event_outside_refit(r: float, slot: int, inc: int) -> object:
    """Serving traffic: mostly fine, sometimes unreachable, hung, failing or dead."""
    generate = CallKind.GENERATE
    if r < 0.70:
        return Observed(slot, inc, generate, FailureClass.OK)
    if r < 0.85:
        return Observed(slot, inc, generate, FailureClass.SUSPECT, "ActorUnavailableError")
    if r < 0.90:
        return Observed(slot, inc, generate, FailureClass.HUNG, "deadline passed")
    if r < 0.93:
        return Observed(slot, inc, generate, FailureClass.ERROR, "ValueError: bad prompt")
    if r < 0.96:
        return Observed(slot, inc, generate, FailureClass.DEAD, "ActorDiedError")
    return Observed(slot, inc, CallKind.PROBE, FailureClass.OK)


def live_event_during_refit(rng: random.Random, r: float, slot: int, inc: int, version: int) -> object:
    """A refit: pause/transfer/resume outcomes and per-participant refit reports;
    rarely a hung pause or a lie, which abort the refit."""
    if r < 0.55:
        return RefitReport(slot, inc, version, RefitResult.COMPLETE)
    if r < 0.57:
        return RefitReport(slot, inc, version, RefitResult.PARTIAL)
    if r < 0.59:
        return RefitReport(slot, inc, version, RefitResult.NOT_STARTED)
    if r < 0.75:
        return Observed(slot, inc, rng.choice(LIFECYCLE), FailureClass.OK)
    if r < 0.88:
        return Observed(slot, inc, rng.choice(LIFECYCLE), FailureClass.SUSPECT, "ActorUnavailableError")
    if r < 0.93:
        return Observed(slot, inc, CallKind.REFIT, FailureClass.HUNG, "transfer deadline passed")
    if r < 0.9303:
        return Observed(slot, inc, CallKind.PAUSE, FailureClass.HUNG, "pause deadline passed")
    if r < 0.9305:
        return Observed(slot, inc, CallKind.RESUME, FailureClass.LIED, "ack=None")
    if r < 0.96:
        return Observed(slot, inc, rng.choice(LIFECYCLE), FailureClass.DEAD, "ActorDiedError")
    return Observed(slot, inc, CallKind.PROBE, FailureClass.OK)


def run(events: int, slots: int, seed: int) -> dict[str, object]:
    config = HealthConfig(
        num_engines=slots,
        min_healthy_engines=1,
        unhealthy_threshold=3,
        suspect_timeout_s=2.0,
        restart_budget=10**9,
        backoff_base_s=0.01,
        backoff_cap_s=1.0,
    )
    rng = random.Random(seed)
    ledger = Ledger(config)
    now = 0.0
    version = 0
    refit_open_at = None
    outcomes: collections.Counter[str] = collections.Counter()
    actions: collections.Counter[str] = collections.Counter()
    randrange = rng.randrange
    core = 0.0  # seconds inside step() (decide + apply) only
    clock = time.perf_counter
    started, cpu_started = clock(), time.process_time()
    for i in range(events):
        now += DT
        if i % TICK_EVERY == 0:
            event = Tick()
        elif i % REFIT_EVERY == 1 and ledger.refit_version is None:
            event = RefitStarted(version)
            refit_open_at = i
        elif refit_open_at is not None and i - refit_open_at == REFIT_LENGTH:
            # A controller commits only a refit that was not aborted.
            event = Tick() if ledger.fleet.halted else VersionCommitted(version)
        elif refit_open_at is not None and i - refit_open_at == REFIT_LENGTH + 1:
            event = RefitFinished(version)
            refit_open_at = None
            version += 1
        else:
            event = slot_event(rng, ledger, randrange(slots))
        t0 = clock()
        decision = step(ledger, event, now)
        core += clock() - t0
        outcomes[decision.failure.value] += 1
        for action in decision.actions:
            actions[type(action).__name__] += 1
    seconds = clock() - started
    cpu_seconds = time.process_time() - cpu_started
    states = collections.Counter(s.state.value for s in ledger.records())
    return {
        "events_per_s": round(events / seconds),
        "core_events_per_s": round(events / core),
        "cpu_events_per_s": round(events / cpu_seconds),
        "events": events,
        "slots": slots,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "seed": seed,
        "refits": version,
        "decisions": dict(sorted(outcomes.items())),
        "actions": dict(sorted(actions.items())),
        "final_states": dict(sorted(states.items())),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.events < 1 or args.slots < 1:
        raise SystemExit(f"--events and --slots must be >= 1, got {args.events} and {args.slots}")
    result = run(args.events, args.slots, args.seed)
    print(
        f"{result['events']:,} events over {result['slots']:,} slots in "
        f"{result['seconds']} s: {result['events_per_s']:,} events/s"
    )
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
