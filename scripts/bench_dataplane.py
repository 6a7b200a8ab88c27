"""Requests per second through the fleet's API versus direct calls to the shard actors.

Both arms run in one process against ``NullBackend`` shards (real ``EngineShard``
Ray actors, no engine: a request costs only the data path), with 1, 8 and 32
shards and the same in-flight window:

- ``direct``: the driver calls ``generate`` on the shard actors itself, round robin,
  keeping ``--window`` calls in flight (the floor: one Ray call per request);
- ``api``: ``Fleet.submit``/``collect``, the path a trainer uses, with the same window.

Then, one request at a time, the p50 latency of each arm; ``added_p50_us`` is the
API's p50 minus the direct p50 (what the fleet adds to one request).

    python scripts/bench_dataplane.py [--requests 3000] [--window 64] [--sizes 1,8,32]

The last line of output is one JSON object (``api_vs_direct_1``, ``api_vs_direct_8``,
``api_vs_direct_32``, ``added_p50_us``, and the rates per arm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.recipe.tinymodel import build_model, default_model_dir

PROMPT = [1, 2, 3]
SAMPLING = {"max_tokens": 1}


def fleet_config(model: str, n: int) -> dict:
    return {
        "engine": {"model": model, "backend": "null", "num_cpus": 0},
        "num_engines": n,
        "min_healthy_engines": 1,
        "metrics": False,
        "admission": {"enabled": False},
    }


def windowed(start, finish, requests: int, window: int) -> float:
    """Requests per second with ``window`` calls in flight, oldest settled first."""
    pending: deque = deque()
    t0 = time.perf_counter()
    for i in range(requests):
        if len(pending) >= window:
            finish(pending.popleft())
        pending.append(start(i))
    while pending:
        finish(pending.popleft())
    return requests / (time.perf_counter() - t0)


def latencies_us(start, finish, requests: int) -> list[float]:
    out = []
    for i in range(requests):
        t0 = time.perf_counter()
        finish(start(i))
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def direct_arm(handles: list):
    def start(i: int):
        return ray_door.submit(handles[i % len(handles)], "generate", PROMPT, SAMPLING)

    def finish(pending) -> None:
        r = ray_door.result(pending, 60)
        assert r.completions, r

    return start, finish


def api_arm(fleet: Fleet):
    def start(i: int):
        return fleet.submit(PROMPT, 1, SAMPLING)

    def finish(pending) -> None:
        (r,) = fleet.collect(pending)
        assert r.ok, r.reason

    return start, finish


def measure(model: str, n: int, requests: int, window: int, latency_requests: int) -> dict:
    cfg = EngineConfig.model_validate(fleet_config(model, n)["engine"])
    handles = [ray_door.spawn_shard(cfg, 1000 + i, 1) for i in range(n)]
    ray_door.results([ray_door.submit(h, "start") for h in handles], 120)
    fleet = Fleet.start(fleet_config(model, n))
    try:
        direct, api = direct_arm(handles), api_arm(fleet)
        windowed(*direct, min(requests, 300), window)  # warm both paths
        windowed(*api, min(requests, 300), window)
        rates = {"direct": [], "api": []}
        for _ in range(2):  # interleave the arms so drift hits both
            rates["direct"].append(windowed(*direct, requests, window))
            rates["api"].append(windowed(*api, requests, window))
        lat_direct = latencies_us(*direct, latency_requests)
        lat_api = latencies_us(*api, latency_requests)
    finally:
        fleet.shutdown()
        for h in handles:
            ray_door.kill(h)
    direct_rps, api_rps = max(rates["direct"]), max(rates["api"])
    row = {
        "shards": n,
        "direct_rps": round(direct_rps, 1),
        "api_rps": round(api_rps, 1),
        "api_vs_direct": round(api_rps / direct_rps, 3),
        "p50_direct_us": round(statistics.median(lat_direct), 1),
        "p50_api_us": round(statistics.median(lat_api), 1),
    }
    row["added_p50_us"] = round(row["p50_api_us"] - row["p50_direct_us"], 1)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--latency-requests", type=int, default=300)
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = args.model or str(build_model(default_model_dir()))
    ray_door.init_local(num_cpus=64, log_to_driver=False)
    rows = [measure(model, int(n), args.requests, args.window, args.latency_requests) for n in args.sizes.split(",")]
    out: dict = {"window": args.window, "requests": args.requests}
    for r in rows:
        n = r["shards"]
        out[f"api_vs_direct_{n}"] = r["api_vs_direct"]
        out[f"direct_rps_{n}"] = r["direct_rps"]
        out[f"api_rps_{n}"] = r["api_rps"]
        out[f"added_p50_us_{n}"] = r["added_p50_us"]
    out["added_p50_us"] = statistics.median(r["added_p50_us"] for r in rows)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
