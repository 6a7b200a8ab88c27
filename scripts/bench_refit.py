"""Refit transport benchmark on real vLLM-CPU engines: bucketed vs per-tensor vs a raw broadcast baseline.

For each model preset ("100m": ~100M parameters in ~110 large tensors; "many-small":
435 small tensors) and for 1 and 2 engines, one run measures, interleaved round by
round so that machine noise hits every mode alike (medians reported):

- raw: one already-packed flat float32 buffer of the model's size, one broadcast
  with the same backend into a reused buffer on every engine (the transport ceiling);
- bucketed / per_tensor: a full refit through ``WeightSynchronizer`` (validation,
  header, transfer, apply through ``reload_weights``), inside pause ... resume;
- bucketed_verify: bucketed with ``verify="checksum"`` (the sender and every engine
  digest the update; an engine is complete only if the digests agree). Its cost is
  ``verify_checksum_overhead`` in the JSON line: refit time with / without, same run.

Reported per mode: the sender's broadcast time and payload MB/s (model bytes / send
time; with 2 engines the wire carries twice that), the transfer call (receive +
apply), and end to end (pause to resume). Before the timed rounds, the engine worker's
resident memory after every refit of ``--rss-refits`` (default 100) bucketed refits,
measured before the raw baseline allocates its own buffer: ``worker_rss_growth_mb_2_to_100``
is the growth from refit 2 (one warm-up refit done) to refit 100 (receive buffers are
reused and freed memory goes back to the system, so it must stay flat);
``worker_rss_growth_mb_1_to_20`` is the older figure (refit 1 to refit 20).
The last line of output is one JSON object.

Run: python scripts/bench_refit.py [--repeats 7] [--bucket-mb 16] [--presets 100m,many-small] [--engines 1,2] [--rss-refits 100]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from rlfleet.fleet.cluster import ray_door

MODEL_CACHE = Path(os.environ.get("RLFLEET_MODEL_CACHE", Path.home() / ".cache" / "rlfleet" / "models"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="100m,many-small")
    p.add_argument("--engines", default="1,2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--direct-mb", type=float, default=4.0)
    p.add_argument("--rss-refits", type=int, default=100, help="refits of the memory measurement (at least 2)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p.parse_args()


async def worker_rss(shards) -> list[float]:
    out = []
    for h in shards:
        infos = await ray_door.call_async(h, "worker_rpc", "rlfleet_worker_info", [], {}, 60)
        out.extend(i["rss_mb"] for i in infos)
    return out


async def refit_e2e(sync, shards, parts, version: int, epoch: int) -> tuple[object, float]:
    """Pause every participant, refit, stamp the shard version, resume. Returns (report, seconds)."""
    t0 = time.monotonic()
    await asyncio.gather(*(ray_door.call_async(h, "pause", mode="keep", clear_cache=True) for h in shards))
    report = await sync.refit(parts, version, epoch)
    await asyncio.gather(*(ray_door.call_async(h, "set_weight_version", version) for h in shards))
    await asyncio.gather(*(ray_door.call_async(h, "resume") for h in shards))
    if not report.ok:
        raise RuntimeError(report.summary())
    return report, time.monotonic() - t0


def growth(trace: list[list[float]], first: int, last: int) -> float:
    """Largest RSS growth (MB) of any worker from refit ``first + 1`` to refit ``last`` (1-based)."""
    return max(b - a for a, b in zip(trace[first], trace[last - 1]))


async def raw_round(trainer, shards, rid: int, nbytes: int, timeout: float) -> float:
    calls = [ray_door.call_async(trainer, "send_raw", rid, nbytes, timeout)]
    calls += [ray_door.call_async(h, "worker_rpc", "rlfleet_receive_raw", [], {"refit_id": rid, "numel": nbytes // 4, "timeout_s": timeout}, timeout) for h in shards]
    sent, *received = await asyncio.gather(*calls)
    bad = [r for rr in received for r in rr if not r.get("ok")]
    if not sent["ok"] or bad:
        raise RuntimeError(f"raw broadcast failed: {sent} {bad}")
    return float(sent["send_s"])


async def bench_preset(preset: str, args, counter) -> dict:
    from rlfleet.faults.source import WeightSource
    from rlfleet.fleet.config.engine import EngineConfig
    from rlfleet.recipe.tinymodel import build_model
    from rlfleet.refit import Participant, RefitConfig, WeightSynchronizer

    model = str(build_model(MODEL_CACHE / preset, preset=preset, seed=0))
    cfg = EngineConfig(model=model, max_model_len=256, kv_cache_memory_bytes=32 << 20, call_timeout_s=args.timeout_s)
    n_max = max(int(n) for n in args.engines.split(","))
    shards = [ray_door.spawn_shard(cfg, slot=i, incarnation=1) for i in range(n_max)]
    # seed 0; torch threads left as Ray sets them; the group's store on loopback (one machine)
    trainer = ray_door.spawn_actor(WeightSource, model, 0, None, "127.0.0.1", num_cpus=0)
    out: dict = {"preset": preset, "engines": {}}
    try:
        await asyncio.gather(*(ray_door.call_async(h, "start") for h in shards))
        base = RefitConfig(timeout_s=args.timeout_s, apply_timeout_s=args.timeout_s, bucket_mb=args.bucket_mb, direct_mb=args.direct_mb)
        sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), base)
        configs = {
            "bucketed": base,
            "per_tensor": dataclasses.replace(base, transfer="per_tensor"),
            "bucketed_verify": dataclasses.replace(base, verify="checksum"),
        }
        for n in (int(x) for x in args.engines.split(",")):
            members = shards[:n]
            parts = {Participant(i, 1, (i + 1,)): ray_door.ShardReceiverPort(h) for i, h in enumerate(members)}
            epoch = next(counter)
            sync.config = base
            # Memory first, before the baselines allocate their own buffers: RSS after every refit (refit 1 builds the group).
            trace: list[list[float]] = []  # per refit, the RSS of every worker
            for _ in range(args.rss_refits):
                report, _ = await refit_e2e(sync, members, parts, next(counter), epoch)
                trace.append(await worker_rss(members))
            nbytes = report.bytes_sent
            samples: dict[str, dict[str, list[float]]] = {m: {"send_s": [], "transfer_s": [], "apply_s": [], "e2e_s": []} for m in configs}
            samples["raw"] = {"send_s": []}
            for _ in range(args.repeats):
                samples["raw"]["send_s"].append(await raw_round(trainer, members, next(counter), nbytes, args.timeout_s))
                for mode, c in configs.items():
                    sync.config = c
                    report, e2e = await refit_e2e(sync, members, parts, next(counter), epoch)
                    s = samples[mode]
                    s["send_s"].append(report.timings.send_s)
                    s["transfer_s"].append(report.timings.transfer_s)
                    s["apply_s"].append(report.timings.apply_s)
                    s["e2e_s"].append(e2e)
            sync.config = base
            med = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}
            for m in med.values():
                m["mb_per_s"] = nbytes / 1e6 / m["send_s"]
            out["engines"][n] = {
                "bytes": nbytes,
                "modes": med,
                "rss_after_1_mb": trace[0],
                "rss_after_last_mb": trace[-1],
                "rss_refits": len(trace),
                "rss_growth_mb": growth(trace, 1, len(trace)),  # refit 2 (warm) to the last
                "rss_growth_1_to_20_mb": growth(trace, 0, 20) if len(trace) >= 20 else None,
                "rss_trace_mb": [round(max(r), 1) for r in trace],
            }
            print(f"[{preset}, {n} engine(s)] done: " + ", ".join(f"{m} {v['send_s'] * 1000:.0f} ms" for m, v in med.items()), flush=True)
            print(f"[{preset}, {n} engine(s)] worker RSS MB after refit 1, 2, 10, 20, ...: "
                  + " ".join(f"{max(trace[i]):.0f}" for i in sorted({0, 1, *range(9, len(trace), 10)})), flush=True)
        await sync.close()
    finally:
        await asyncio.gather(*(ray_door.call_async(h, "shutdown") for h in shards), return_exceptions=True)
        for h in shards:
            ray_door.kill(h)
        ray_door.kill(trainer)
    return out


def table(results: list[dict]) -> str:
    head = f"{'model':<11}{'eng':>4}{'MB':>8} | {'mode':<11}{'send ms':>9}{'MB/s':>8}{'xfer+apply ms':>15}{'apply ms':>10}{'pause..resume ms':>18}"
    lines = [head, "-" * len(head)]
    for r in results:
        for n, e in r["engines"].items():
            for mode in ("raw", "bucketed", "bucketed_verify", "per_tensor"):
                m = e["modes"][mode]
                xfer = f"{m['transfer_s'] * 1000:.0f}" if "transfer_s" in m else "-"
                app = f"{m['apply_s'] * 1000:.0f}" if "apply_s" in m else "-"
                e2e = f"{m['e2e_s'] * 1000:.0f}" if "e2e_s" in m else "-"
                lines.append(f"{r['preset']:<11}{n:>4}{e['bytes'] / 1e6:>8.1f} | {mode:<11}{m['send_s'] * 1000:>9.1f}{m['mb_per_s']:>8.0f}{xfer:>15}{app:>10}{e2e:>18}")
            b, p, w = e["modes"]["bucketed"], e["modes"]["per_tensor"], e["modes"]["raw"]
            lines.append(f"{'':<23} | bucketed/raw speed {w['send_s'] / b['send_s']:.2f}x, bucketed/per-tensor speed {p['send_s'] / b['send_s']:.2f}x; "
                         f"worker RSS {max(e['rss_after_1_mb']):.0f} MB after 1 refit, growth refit 2 -> {e['rss_refits']} {e['rss_growth_mb']:+.1f} MB")
    return "\n".join(lines)


async def main_async(args) -> dict:
    import itertools

    ray_door.init_local(num_cpus=8, log_to_driver=False)
    counter = itertools.count(1)
    results = []
    try:
        for preset in args.presets.split(","):
            results.append(await bench_preset(preset, args, counter))
    finally:
        ray_door.shutdown()
    print(table(results))
    by = {r["preset"]: r["engines"] for r in results}
    summary: dict = {}

    def speed(preset, n, a, b):  # how many times faster mode a is than mode b
        e = by.get(preset, {}).get(n)
        return round(e["modes"][b]["send_s"] / e["modes"][a]["send_s"], 3) if e else None

    n2 = max(int(x) for x in args.engines.split(","))
    summary["bucketed_vs_raw"] = speed("100m", n2, "bucketed", "raw")
    summary["bucketed_vs_raw_small"] = speed("many-small", n2, "bucketed", "raw")
    summary["bucketed_vs_per_tensor_large"] = speed("100m", n2, "bucketed", "per_tensor")
    summary["bucketed_vs_per_tensor_small"] = speed("many-small", n2, "bucketed", "per_tensor")
    for preset in by:
        for n, e in by[preset].items():
            summary[f"bucketed_vs_raw_{preset}_{n}_engines"] = speed(preset, n, "bucketed", "raw")
            summary[f"bucketed_vs_per_tensor_{preset}_{n}_engines"] = speed(preset, n, "bucketed", "per_tensor")
            summary[f"refit_s_{preset}_{n}_engines"] = round(e["modes"]["bucketed"]["e2e_s"], 3)
            summary[f"bucketed_mb_per_s_{preset}_{n}_engines"] = round(e["modes"]["bucketed"]["mb_per_s"], 1)
    summary["refit_s_100m_2_engines"] = summary.get(f"refit_s_100m_{n2}_engines")
    verify_preset = "100m" if "100m" in by else next(iter(by))
    e = by[verify_preset][n2]["modes"]
    summary["verify_checksum_overhead"] = round(e["bucketed_verify"]["e2e_s"] / e["bucketed"]["e2e_s"], 3)
    summary["verify_checksum_added_s"] = round(e["bucketed_verify"]["e2e_s"] - e["bucketed"]["e2e_s"], 3)
    summary["verify_checksum_preset"] = f"{verify_preset}, {n2} engine(s)"
    grown = [e["rss_growth_mb"] for p in by.values() for e in p.values()]
    summary[f"worker_rss_growth_mb_2_to_{args.rss_refits}"] = round(max(grown), 1) if grown else None
    old = [e["rss_growth_1_to_20_mb"] for p in by.values() for e in p.values() if e["rss_growth_1_to_20_mb"] is not None]
    summary["worker_rss_growth_mb_1_to_20"] = round(max(old), 1) if old else None
    summary["rss_refits"] = args.rss_refits
    summary["bucket_mb"] = args.bucket_mb
    summary["repeats"] = args.repeats
    return summary


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = parse()
    if args.rss_refits < 2 or args.repeats < 1:
        raise SystemExit("--rss-refits must be at least 2 and --repeats at least 1")
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
