"""Simulate fleets of 64, 256 and 1,024 engines under real failure rates, with the production controller.

Each fleet runs ``--hours`` of async training in simulated time (``sim.run``): the real
``SingleController`` with its lifecycle, health core, admission and recovery, driven
through a simulated door (``sim.door``) and a virtual-time event loop, against
simulated shards with the latencies of a 70B-class model (``sim.shard.Timings``,
``sim.transfer.TransferModel``: 140 GB broadcast at 8 GB/s, engine start 5 minutes, 8
engines per node) and the Llama 3 report's interruption rate scaled to the fleet
(``sim.faults``), plus one controller death per run.

Every run but one per size uses the configuration recommended at this scale,
``stage_ahead``: the refit moves the update into each engine's staging area while the
fleet serves, then closes the gate only to pause, apply (``--apply-gbps``: 1,000 GB/s,
a device-to-device copy; 50 models a host-memory staging area), stamp and resume.

Runs, all measured here and now:

1. each size at the default failure rate (the table's rows);
2. each size without any fault, same hours: the gate's duty cycle, what the refits
   alone cost (``availability_fault_free``), the baseline the faulty run is compared
   against (``availability_lost_to_faults_N`` is the difference);
3. each size at the default rate with ``stage_ahead`` off, the gate closed for the whole
   transfer (``availability_transfer_closed_N``): what staging ahead buys;
4. the largest size under ``--stress`` times the rate, without and with warm spares
   (``spare_engines`` = one node's worth), on the same fault schedule: how long capacity
   takes to come back after a failure, and what spares change.

Every run charges the controller CPU per control call that Ray's client side costs
(``--call-cpu-us``; default ``sim.door.CALL_CPU_US``, measured on real Ray by
``scripts/bench_lifecycle.py``: the output names the source): the controller sends its
calls one after another, so a refit's gate-closed time grows with the fleet. Each size
also runs once more at the default rate with calls free (``availability_calls_free_N``,
``gate_closed_s_per_refit_calls_free_N``): what that cost takes away.

5. a sharded refit of Qwen3-235B-A22B, 128 trainer GPUs into 32 inference GPUs at TP 8 over 50 GB/s
   links (``sim.refit_235b``: the parameters and their sources), three ways: today's broadcast, a sharded
   refit with vLLM 0.32's destination-layout resolution, and one with every parameter resolved; each
   through the production lifecycle on 4 engines, fault-free, staged and in place: its refit time and
   gate-closed time beside the published figures (``--refit-235b-only`` runs this alone).

Writes ``--plot`` (availability and serving capacity over simulated time, 1,024 engines)
and prints a markdown table; the last line is one JSON object with, for each size N,
``availability_N``, ``availability_fault_free_N``, ``availability_transfer_closed_N``,
``gate_closed_s_per_refit_N`` (seconds the gate was closed per refit, mean),
``capacity_mean_share_N``, ``capacity_min_share_N``, ``refit_s_N`` (the whole
``sync_weights``, staging included), ``controller_cpu_s_per_refit_N`` (real CPU seconds
of this process while a refit ran), ``refits_stopped_N``, ``call_cpu_s_per_refit_N`` (controller CPU
charged for calls while a refit ran), ``phases_s_per_refit_N`` and ``gate_phase_dominant_N`` (the
refit phase with the gate closed that took longest, mean), the stress run's figures, and
``call_cpu_us`` with its ``call_cpu_source``, and ``refit_235b`` (per layout: the plan's bytes, the busiest
link's seconds, ``refit_s`` and ``gate_closed_s`` staged and ``_in_place``, the fallback share) with
``refit_235b_anchors``.

Usage: ``python scripts/simulate_fleet.py [--sizes 64,256,1024] [--hours 6] [--step-s 600]
[--stress 100] [--stress-hours 3] [--seed 0] [--apply-gbps 1000] [--call-cpu-us 1023.2] [--plot docs/scale.png]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rlfleet.health.faultplan import REFIT_PHASES  # noqa: E402
from rlfleet.sim.door import CALL_CPU_SOURCE, CALL_CPU_US  # noqa: E402  (the path line above makes the repo importable)
from rlfleet.sim.faults import FaultSpec, schedule  # noqa: E402
from rlfleet.sim import refit_235b  # noqa: E402
from rlfleet.sim.run import Scenario, simulate  # noqa: E402
from rlfleet.sim.transfer import TransferModel  # noqa: E402

KEYS = ("availability", "capacity_mean_share", "capacity_min_share", "refits_stopped", "controller_cpu_s_per_refit")


def door_cpu_s_per_refit(n: int, mix: dict[str, float], rounds: int = 5) -> float:
    """The simulated door's own CPU for one refit's calls: ``mix`` (calls per refit by method, as the
    run counted them) replayed as fan-outs to ``n`` healthy shards, with no controller. The part of
    the measured CPU per refit that production's door would replace with Ray's cost."""
    import asyncio

    from rlfleet.sim.clock import run_virtual
    from rlfleet.sim.door import SimDoor
    from rlfleet.sim.shard import Timings

    args = {"set_route": (1, True, 0), "fence": (1,), "begin_refit": (1, 1), "set_weight_version": (1,),
            "abort": ([],)}

    async def go() -> float:
        door = SimDoor(n, Timings(), call_cpu_us=0.0)  # the simulator's own CPU, not the charged one
        handles = [door.spawn_shard(None, s, 1) for s in range(n)]
        for h in handles:
            h.state = "ready"
        t0 = time.process_time()
        for _ in range(rounds):
            for method, count in mix.items():
                if method in ("start", "shutdown"):
                    continue
                k = round(count)
                calls = {i: (handles[i % n], method, args.get(method, ()), {}) for i in range(k)}
                await door.fan_out(calls, timeout=600.0)
        await asyncio.sleep(0)
        return (time.process_time() - t0) / rounds

    return round(run_virtual(go()), 4)


GATE_CLOSED_PHASES = REFIT_PHASES  # every refit phase runs with the gate closed (``stage`` does not)


def call_cost_figures(n: int, charged: dict, free: dict) -> dict:
    """What charging the controller's CPU per call changed at ``n`` engines, and the refit phase with the gate
    closed that took longest (``stage`` runs with the gate open under ``stage_ahead``)."""
    phases = charged["phases_s_per_refit"]
    closed = {p: s for p, s in phases.items() if p in GATE_CLOSED_PHASES}
    dominant = max(closed, key=closed.get) if closed else None
    return {f"availability_calls_free_{n}": free["availability"],
            f"gate_closed_s_per_refit_calls_free_{n}": free["gate_closed_s_per_refit"],
            f"call_cpu_s_per_refit_{n}": charged["call_cpu_s_per_refit"],
            f"phases_s_per_refit_{n}": phases,
            f"gate_phase_dominant_{n}": f"{dominant} ({closed[dominant]} s)" if dominant else None}


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def row(name: str, r: dict) -> str:
    ttfc = r["time_to_full_capacity_s"]
    faults = r["faults"]
    return (f"| {name} | {r['engines']} | {r['spare_engines']} | {r['horizon_h']:g} | {r['refits']} "
            f"| {faults['die']}/{faults['hang']}/{faults['node']}/{faults['controller']} "
            f"| {r['availability']:.4f} | {r['capacity_mean_share']:.4f} | {r['capacity_min_share']:.4f} "
            f"| {r['refit_s_mean']} | {r['refit_s_max']} | {r['gate_closed_s_per_refit']} "
            f"| {median(ttfc) if ttfc else '-'} "
            f"| {r['refits_stopped']} | {r['controller_cpu_s_per_refit'] * 1e3:.0f} "
            f"| {r['controller_cpu_s_per_hour_between_refits']:.1f} | {r['calls_per_refit']:.0f} "
            f"| {r['kv_puts_per_refit']:g} | {r['real_s']} |")


HEADER = ("| run | engines | spares | hours | refits | faults die/hang/node/ctl | availability | capacity mean "
          "| capacity min | refit s | refit s max | gate closed s / refit | time to full capacity s (median) "
          "| refits that stopped | controller CPU ms / refit | controller CPU s / h between refits "
          "| door calls / refit | KV writes / refit | real s |\n" + "|---" * 19 + "|")


def plot(path: pathlib.Path, runs: list[tuple[str, object]], engines: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    window = 1800.0
    for i, (label, run) in enumerate(runs):
        series = run.series(every_s=window)
        hours = [t / 3600 for t, *_ in series] + [series[-1][0] / 3600 + window / 3600]
        color, style = f"C{i}", ("-", "--", ":")[i % 3]
        axes[0].step(hours, [s[1] for s in series] + [series[-1][1]], where="post", color=color, ls=style, label=label)
        axes[1].step(hours, [s[2] for s in series] + [series[-1][2]], where="post", color=color, label=f"{label}: mean")
        axes[1].step(hours, [s[3] for s in series] + [series[-1][3]], where="post", color=color, ls=":", alpha=0.5)
        faults = [f for f in run.fired if f["kind"] != "controller"]
        axes[1].scatter([f["t"] / 3600 for f in faults], [1.0] * len(faults), marker="v", s=22, color=color)
    axes[0].set_ylabel("gate open share\n(per 30 min)")
    axes[1].set_ylabel("serving capacity share\n(per 30 min: mean, dotted min)")
    axes[1].set_xlabel("simulated hours (triangles: engine faults)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
    fig.suptitle(f"{engines:,} simulated engines, production controller: availability and capacity")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="fleet sizes (engines), comma-separated")
    ap.add_argument("--hours", type=float, default=6.0, help="simulated hours per run at the default rate")
    ap.add_argument("--step-s", type=float, default=600.0, help="seconds of one training step")
    ap.add_argument("--stress", type=float, default=100.0, help="failure-rate multiplier of the stress runs (0: none)")
    ap.add_argument("--stress-hours", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--apply-gbps", type=float, default=1000.0,
                    help="GB/s of the staged apply (1000: device-to-device copy; 50: from host memory)")
    ap.add_argument("--call-cpu-us", type=float, default=CALL_CPU_US,
                    help=f"controller CPU per control call, microseconds (default: {CALL_CPU_SOURCE})")
    ap.add_argument("--plot", type=pathlib.Path, default=None, help="write the plot here (PNG)")
    ap.add_argument("--refit-235b-only", action="store_true",
                    help="run only the sharded refit of a 235B model (section 5), not the fleet sizes")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be integers separated by commas, got {args.sizes!r}")
    if not sizes or min(sizes) < 8 or args.hours <= 0 or args.step_s <= 0 or args.stress < 0:
        ap.error("--sizes must be >= 8 engines, --hours and --step-s > 0, --stress >= 0")
    if args.apply_gbps <= 0:
        ap.error(f"--apply-gbps must be > 0, got {args.apply_gbps:g}")
    if not args.call_cpu_us >= 0:
        ap.error(f"--call-cpu-us must be >= 0 microseconds, got {args.call_cpu_us:g}")
    source = CALL_CPU_SOURCE if args.call_cpu_us == CALL_CPU_US else "--call-cpu-us"
    print(f"controller CPU per control call: {args.call_cpu_us:g} us ({source})", flush=True)

    t0 = time.perf_counter()
    transfer = TransferModel(apply_Bps=args.apply_gbps * 1e9)
    # the configuration recommended at this scale
    ahead = {"stage_ahead": True, "transfer": transfer, "call_cpu_us": args.call_cpu_us}
    out: dict = {"step_s": args.step_s, "hours": args.hours, "seed": args.seed, "stage_ahead": True,
                 "apply_gbps": args.apply_gbps, "call_cpu_us": args.call_cpu_us, "call_cpu_source": source}
    lines = [HEADER]
    plotted = []
    for n in ([] if args.refit_235b_only else sizes):
        base = Scenario(engines=n, step_s=args.step_s, horizon_s=args.hours * 3600, faults=FaultSpec(seed=args.seed),
                        **ahead)
        run, r = simulate(base)
        _, ff = simulate(Scenario(engines=n, step_s=args.step_s, horizon_s=args.hours * 3600,
                                  faults=FaultSpec(rate_multiplier=0, controller_deaths=0), **ahead))
        closed_run, closed = simulate(Scenario(engines=n, step_s=args.step_s, horizon_s=args.hours * 3600,
                                               faults=FaultSpec(seed=args.seed), stage_ahead=False, transfer=transfer,
                                               call_cpu_us=args.call_cpu_us))
        _, free = simulate(Scenario(engines=n, step_s=args.step_s, horizon_s=args.hours * 3600,
                                    faults=FaultSpec(seed=args.seed), **{**ahead, "call_cpu_us": 0.0}))
        lines += [row("default rate", r), row("no faults", ff), row("gate closed for the transfer", closed),
                  row("default rate, calls free", free)]
        out.update(call_cost_figures(n, r, free))
        for k in KEYS:
            out[f"{k}_{n}"] = r[k]
        out[f"availability_fault_free_{n}"] = ff["availability"]
        out[f"availability_lost_to_faults_{n}"] = round(ff["availability"] - r["availability"], 5)
        out[f"availability_transfer_closed_{n}"] = closed["availability"]
        out[f"gate_closed_s_per_refit_{n}"] = r["gate_closed_s_per_refit"]
        out[f"gate_closed_s_per_refit_transfer_closed_{n}"] = closed["gate_closed_s_per_refit"]
        out[f"refits_not_staged_{n}"] = r["refits_not_staged"]
        out[f"refit_s_{n}"] = r["refit_s_mean"]
        out[f"refit_s_fault_free_{n}"] = ff["refit_s_mean"]
        out[f"faults_{n}"] = r["faults"]
        out[f"controller_cpu_s_per_hour_between_refits_{n}"] = r["controller_cpu_s_per_hour_between_refits"]
        out[f"door_calls_per_refit_{n}"] = r["calls_per_refit"]
        out[f"kv_puts_per_refit_{n}"] = r["kv_puts_per_refit"]
        door_s = door_cpu_s_per_refit(n, ff["calls_by_method_per_refit"])
        out[f"sim_door_cpu_s_per_refit_{n}"] = door_s
        out[f"controller_cpu_s_per_refit_net_{n}"] = round(ff["controller_cpu_s_per_refit"] - door_s, 4)
        for k in ("kv_bytes_per_put", "routing_publications_per_refit", "routing_state_bytes_without_handles",
                  "event_records_per_refit", "calls_by_method_per_refit"):
            out[f"{k}_{n}"] = ff[k]
        print(f"{n} engines: availability {r['availability']:.4f} (fault-free {ff['availability']:.4f}, gate closed "
              f"for the transfer {closed['availability']:.4f}, calls free {free['availability']:.4f}), {r['refits']} "
              f"refits of {r['refit_s_mean']} s with the gate closed {r['gate_closed_s_per_refit']} s (calls free "
              f"{free['gate_closed_s_per_refit']} s; longest phase with the gate closed: "
              f"{out[f'gate_phase_dominant_{n}']}), faults {r['faults']}, {r['real_s']} s real", flush=True)
        if n == max(sizes):
            plotted.append((f"default rate ({sum(r['faults'].values())} faults)", run))
            plotted.append(("default rate, gate closed for the transfer", closed_run))
    if args.stress > 0 and not args.refit_235b_only:
        n = max(sizes)
        spec = FaultSpec(seed=args.seed, rate_multiplier=args.stress)
        faults = tuple(schedule(spec, n, args.stress_hours * 3600))
        for spares in (0, 8):
            sc = Scenario(engines=n, spare_engines=spares, step_s=args.step_s, horizon_s=args.stress_hours * 3600,
                          faults=spec, fault_list=faults, **ahead)
            run, r = simulate(sc)
            lines.append(row(f"x{args.stress:g} rate", r))
            tag = "spares" if spares else "no_spares"
            out[f"stress_availability_{tag}_{n}"] = r["availability"]
            out[f"stress_capacity_mean_share_{tag}_{n}"] = r["capacity_mean_share"]
            out[f"stress_capacity_min_share_{tag}_{n}"] = r["capacity_min_share"]
            out[f"stress_time_to_full_capacity_s_{tag}_{n}"] = median(r["time_to_full_capacity_s"])
            out[f"stress_refits_stopped_{tag}_{n}"] = r["refits_stopped"]
            out[f"stress_gate_closed_s_per_refit_{tag}_{n}"] = r["gate_closed_s_per_refit"]
            print(f"x{args.stress:g} rate, {spares} spares: availability {r['availability']:.4f}, capacity mean "
                  f"{r['capacity_mean_share']:.4f}, time to full capacity {r['time_to_full_capacity_s']}", flush=True)
            plotted.append((f"x{args.stress:g} rate, {spares} warm spares ({sum(r['faults'].values())} faults)", run))
        out["stress"] = args.stress
    if args.plot and plotted:
        plot(args.plot, plotted, max(sizes))
        out["plot"] = str(args.plot)
    out["refit_235b"] = refit_235b.simulate_layouts(transfer, min(args.hours, 2.0), args.step_s, args.call_cpu_us)
    out["refit_235b_anchors"] = refit_235b.ANCHORS
    for layout, f in out["refit_235b"].items():
        lines_235 = (f"235B refit, {layout}: busiest link {f['busiest_link_gb']} GB ({f['wire_s']} s at 50 GB/s), "
                     f"fallback share {f['fallback_share']}; refit {f['refit_s']} s with the gate closed "
                     f"{f['gate_closed_s']} s staged, {f['gate_closed_s_in_place']} s in place")
        print(lines_235, flush=True)
    print(f"published: {json.dumps(refit_235b.ANCHORS)}", flush=True)
    if lines[1:]:
        print("\n".join(lines))
    out["real_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
