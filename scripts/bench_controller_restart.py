"""What a controller death costs, on real vLLM-CPU engines under continuous load.

A fleet of ``--engines`` engines serves ``--threads`` client threads that submit and
collect requests without pause. First ``--baseline-refits`` ordinary refits under that
load give ``refit_s_baseline`` (median ``sync_weights`` wall time). Then ``--kills`` times,
between refits: the controller's process is killed with ``SIGKILL`` (from outside, by
the pid ``Fleet.controller_info`` reports), and the trainer calls ``sync_weights`` for
the next version right after the kill. Per kill:

- ``death_to_refit_s``: the kill to that ``sync_weights`` returning (Ray restarts the
  controller, the restarted one re-adopts the shards, ``Fleet`` re-sends the call, the
  refit runs);
- ``controller_down_s``: the outage the client logged (``controller_back``'s ``down_s``:
  its first failed poll to the restarted controller's first answer);
- ``readopt_s``: the ``adopted`` record's ``seconds`` (re-adoption inside the restarted
  controller); ``restarted_after_s``: the kill to the restarted controller's first record
  (Ray noticing the death and starting a new process); ``noticed_after_s``: the kill to
  the client's first failed poll;
- ``completed_while_down``: requests that completed during the outage, by the client's
  counter (``controller_outage()``), and cross-checked by the results' own completion
  times inside the outage window (``completed_while_down_by_time``).

At the end every accepted request must have come back (``lost`` = accepted - completed
- returned, 0), and the event log (one file across controller generations) must pass
``faults.invariants``.

    python scripts/bench_controller_restart.py [--kills 3] [--engines 2] [--threads 3]
                                               [--baseline-refits 3] [--max-tokens 48]

Human lines first; the last line of output is one JSON object (``death_to_refit_s``,
``controller_down_s``, ``readopt_s`` medians; ``completed_while_down`` total;
``refit_s_baseline``, ``death_to_refit_vs_refit``, ``kills``, ``lost``, per-kill lists).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

from rlfleet.faults import invariants
from rlfleet.faults.load import PairLoad
from rlfleet.faults.source import WeightSource
from rlfleet.faults.timeline import read_log
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.records import Adopted, ControllerBack, ControllerRestarted, ControllerUnreachable
from rlfleet.recipe.tinymodel import build_model, default_model_dir

PROMPTS = [[1, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(8)]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--threads", type=int, default=3, help="client threads submitting continuously")
    p.add_argument("--baseline-refits", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="per request: long enough to span the outage")
    p.add_argument("--settle-s", type=float, default=2.0, help="load runs this long between kills")
    return p.parse_args()


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.05):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    args = parse()
    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))
    log_path = os.path.join(tempfile.mkdtemp(prefix="bench_controller_restart_"), "events.jsonl")
    ray_door.init_local(log_to_driver=False)
    source = ray_door.spawn_actor(WeightSource, model, num_cpus=0)
    t0 = time.monotonic()
    fleet = Fleet.start({
        "engine": {"model": model, "kv_cache_memory_bytes": 32 << 20},
        "num_engines": args.engines,
        "min_healthy_engines": 1,
        "refit_timeout_s": 15,
        "controller_max_restarts": args.kills + 1,
        "controller_restart_wait_s": 120,
        "event_log_path": log_path,
    })
    print(f"fleet {fleet.name}: {args.engines} engines up in {time.monotonic() - t0:.1f} s; log {log_path}", flush=True)
    version = 0

    def next_weights() -> int:
        nonlocal version
        version += 1
        ray_door.ask(source, "perturb", version, 0.02, timeout=60)
        return version

    fleet.sync_weights(next_weights(), source)
    load = PairLoad(fleet, args.threads, {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0}, PROMPTS)
    kills: list[dict] = []
    baseline: list[float] = []
    try:
        wait_for(lambda: load.count() >= 2 * args.threads, 120, "load flowing")
        for _ in range(args.baseline_refits):
            v = next_weights()
            t = time.monotonic()
            fleet.sync_weights(v, source)
            baseline.append(time.monotonic() - t)
            print(f"baseline refit v{v}: {baseline[-1]:.3f} s", flush=True)
            time.sleep(args.settle_s / 2)

        for k in range(args.kills):
            time.sleep(args.settle_s)
            v = next_weights()  # the source is ready before the kill: the trainer refits right after it
            info = fleet.controller_info()
            outage0 = fleet.client.controller_outage()
            t_kill = time.monotonic()
            os.kill(info["pid"], signal.SIGKILL)
            summary = fleet.sync_weights(v, source)
            death_to_refit = time.monotonic() - t_kill
            # the client's own outage ends at its first answer from the restarted controller (it may lag the
            # trainer's re-sent call by one poll)
            wait_for(lambda: fleet.client.controller_outage()["outages"] > outage0["outages"]
                     and fleet.client.controller_outage()["unreachable_since"] is None, 120, "the client's outage to end")
            outage = fleet.client.controller_outage()
            after = fleet.controller_info()
            client_log = fleet.client.events()
            down = ControllerUnreachable.first(client_log, lambda e: e.t >= t_kill)
            back = ControllerBack.first(client_log, lambda e: e.t > down.t)
            mine = fleet.events(kinds=[Adopted, ControllerRestarted])
            adopted = Adopted.among(mine, generation=after["generation"])
            # the restarted controller's first record: Ray has started its new process (host-wide monotonic clock)
            restarted = ControllerRestarted.among(mine, generation=after["generation"])
            # requests that finished inside the window, by the results' own completion times
            time.sleep(0.5)  # results that completed in the window but were still being collected
            with load._lock:
                by_time = sum(1 for r in load.results if r.ok and down.t <= r.accepted_at + r.latency_s <= back.t)
            row = {
                "kill": k + 1,
                "version": v,
                "complete": summary.get("complete"),
                "generation": after["generation"],
                "death_to_refit_s": round(death_to_refit, 3),
                "controller_down_s": round(back.down_s, 3),
                "noticed_after_s": round(down.t - t_kill, 3),
                "restarted_after_s": round(restarted[0].t - t_kill, 3) if restarted else None,
                "readopt_s": adopted[-1].seconds if adopted else None,
                "completed_while_down": outage["completed_while_down"] - outage0["completed_while_down"],
                "completed_while_down_by_time": by_time,
            }
            kills.append(row)
            print(f"kill {k + 1}: death->refit {row['death_to_refit_s']:.3f} s, controller down "
                  f"{row['controller_down_s']:.3f} s (noticed after {row['noticed_after_s']:.3f} s, new process "
                  f"after {row['restarted_after_s']} s), re-adoption "
                  f"{row['readopt_s']} s, completed while down {row['completed_while_down']} "
                  f"(by completion time {by_time}), generation {row['generation']}, refit v{v} on {row['complete']}",
                  flush=True)
        time.sleep(args.settle_s)
    finally:
        results = load.stop()
    counters = fleet.client.counters()
    status = fleet.status()
    problems = invariants.check_all(read_log(log_path), fleet.config.lifecycle_deadline_s)
    versions = sorted({r.result.weight_version for r in results if r.ok})
    fleet.shutdown()
    ray_door.kill(source)
    lost = counters["accepted"] - counters["completed"] - counters["returned"]
    print(f"requests: {counters['accepted']} accepted, {counters['completed']} completed, "
          f"{counters['returned']} returned, {lost} lost; versions served {versions}; final version "
          f"{status['version']}; load errors {load.errors[:3]}; invariant problems {problems[:5]}", flush=True)
    refit_s = median(baseline)
    d2r = median([r["death_to_refit_s"] for r in kills])
    print(json.dumps({
        "kills": len(kills),
        "engines": args.engines,
        "threads": args.threads,
        "death_to_refit_s": d2r,
        "controller_down_s": median([r["controller_down_s"] for r in kills]),
        "readopt_s": median([r["readopt_s"] for r in kills if r["readopt_s"] is not None]),
        "restarted_after_s": median([r["restarted_after_s"] for r in kills if r["restarted_after_s"] is not None]),
        "noticed_after_s": median([r["noticed_after_s"] for r in kills]),
        "completed_while_down": sum(r["completed_while_down"] for r in kills),
        "completed_while_down_by_time": sum(r["completed_while_down_by_time"] for r in kills),
        "refit_s_baseline": refit_s,
        "death_to_refit_vs_refit": round(d2r / refit_s, 2) if d2r and refit_s else None,
        "lost": lost,
        "returned": counters["returned"],
        "accepted": counters["accepted"],
        "load_errors": len(load.errors),
        "invariant_problems": len(problems),
        "per_kill": kills,
        "refit_s_baseline_all": [round(x, 3) for x in baseline],
    }))


if __name__ == "__main__":
    main()
