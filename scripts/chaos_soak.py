"""Chaos soak: random faults on a real fleet for a bounded time; the last line is one JSON object.

    python scripts/chaos_soak.py --duration-s 600 --rate-per-min 3 --seed 0

Exits non-zero if any invariant broke, a fault was not recovered from, or a prompt was lost.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlfleet.fleet.cluster import ray_door
from rlfleet.faults.chaos import soak
from rlfleet.recipe.tinymodel import build_model, default_model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--rate-per-min", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = args.model or str(build_model(default_model_dir("tiny")))
    ray_door.init_local(log_to_driver=False)
    try:
        result = soak(model, args.duration_s, args.rate_per_min, args.seed, log=lambda m: print(m, flush=True))
    finally:
        ray_door.shutdown()
    print(json.dumps(result))
    ok = result["invariants_held"] and result["unrecovered"] == 0 and result["prompts_lost"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
