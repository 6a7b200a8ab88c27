"""A short fleet job across every node of a launcher-started Ray cluster (the CI's two-node driver).

Run on the head by the launcher:

    sbatch slurm/rlfleet.sbatch python slurm/examples/fleet_check.py --nodes 2

It connects to the job's Ray (``RAY_ADDRESS``, exported by the launcher, so it never
attaches to another Ray on a shared host), checks that ``--nodes`` nodes are alive,
builds the tiny model on the shared filesystem, pins one ``EngineShard`` to each node
(``NodeAffinitySchedulingStrategy``, hard), starts them, generates on each, runs the
real refit (new weights from a trainer-side source, broadcast over one
gloo group spanning the nodes, checked by logprob agreement), generates again, and prints one line:

    RLFLEET_FLEET_CHECK {"nodes": [...], "shards": [{"node_id": ..., ...}], ...}

Exit code 0 only when every check passed; any failure raises (non-zero exit), after
the shards are shut down. ``--hold S`` keeps the shards alive S seconds after the
summary (the cancel test cancels the job during this window).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.recipe.tinymodel import build_model

PROMPT = [1, 20, 30, 40, 50]
SAMPLING = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0, "seed": 3}
T = 300.0


def run_refit(shards: list, model_dir: str) -> dict:
    """One real refit across the nodes: new weights from a trainer-side source into every shard.

    The lifecycle a refit makes, over the pinned shards: pause each (keep in-flight
    requests, clear the cache), broadcast the source's perturbed weights through
    refit's ``WeightSynchronizer`` (gloo, one group spanning both nodes), stamp
    version 1, resume. Every ack must be exactly True and every engine COMPLETE.
    """
    import asyncio

    from rlfleet.faults.source import WeightSource
    from rlfleet.refit.outcome import assign_ranks
    from rlfleet.refit.synchronizer import RefitConfig, WeightSynchronizer

    source = ray_door.spawn_actor(WeightSource, model_dir, num_cpus=0)
    try:
        ray_door.ask(source, "perturb", 1, 0.05, timeout=120)
        paused = [ray_door.ask(s, "pause", mode="keep", clear_cache=True, timeout=60) for s in shards]
        keys = assign_ranks({(i, 1): 1 for i in range(len(shards))})
        sync = WeightSynchronizer(ray_door.ActorSenderPort(source), RefitConfig(timeout_s=120.0))

        async def refit():
            try:
                return await sync.refit({k: ray_door.ShardReceiverPort(shards[k.slot]) for k in keys}, 1, 1)
            finally:
                await sync.close()

        report = asyncio.run(refit())
        if not report.ok:
            raise RuntimeError("refit failed:\n" + report.summary())
        stamped = [ray_door.ask(s, "set_weight_version", 1, timeout=60) for s in shards]
        resumed = [ray_door.ask(s, "resume", timeout=60) for s in shards]
        if paused + stamped + resumed != [True] * (3 * len(shards)):
            raise RuntimeError(f"refit acks were not all True: pause {paused}, stamp {stamped}, resume {resumed}")
        after = [ray_door.ask(s, "generate", PROMPT, SAMPLING, timeout=T) for s in shards]
        gap = 0.0
        for res in after:
            c = res.completions[0]
            ref = ray_door.ask(source, "logprobs", list(res.prompt_token_ids), list(c.token_ids), timeout=60)
            gap = max(gap, max(abs(x - y) for x, y in zip(ref, c.logprobs)))
        if gap > 1e-4 or any(r.weight_version != 1 for r in after):
            raise RuntimeError(f"engines do not serve the new weights: logprob gap {gap:.2e}, versions {[r.weight_version for r in after]}")
        return {
            "kind": "weights", "version": 1, "paused": len(paused), "resumed": len(resumed),
            "complete": len(report.results), "bytes_sent": report.bytes_sent,
            "transfer_s": round(report.timings.total_s, 3), "logprob_gap": gap,
        }
    finally:
        ray_door.kill(source)


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes that must be alive (one shard each)")
    ap.add_argument("--model-dir", help="where to build the tiny model (shared filesystem); default <log dir>/tiny-model")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to keep the shards after the summary")
    args = ap.parse_args(argv)

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        print("RAY_ADDRESS is not set: run me through the rlfleet launcher", file=sys.stderr)
        return 2
    ray.init(address=address, log_to_driver=True, logging_level="WARNING")
    nodes = alive_nodes()
    if len(nodes) != args.nodes:
        raise RuntimeError(f"expected {args.nodes} alive Ray nodes, found {len(nodes)}: {[n['NodeID'] for n in nodes]}")

    model_dir = args.model_dir or os.path.join(os.environ.get("RLFLEET_LOG_DIR", "."), "tiny-model")
    model = str(build_model(model_dir, preset="tiny", seed=0))
    cfg = EngineConfig(model=model, kv_cache_memory_bytes=32 << 20, max_model_len=256, num_cpus=1)

    t0 = time.monotonic()
    shards = [
        ray_door.spawn_shard(
            cfg, slot=i, incarnation=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
        )  # fmt: skip
        for i, n in enumerate(nodes)
    ]
    try:
        starts = [ray_door.ask(s, "start", timeout=T) for s in shards]
        located = [ray_door.ask(s, "__ray_call__", lambda self: ray.get_runtime_context().get_node_id(), timeout=30) for s in shards]
        before = [ray_door.ask(s, "generate", PROMPT, SAMPLING, timeout=T) for s in shards]
        refit = run_refit(shards, model)
        after = [ray_door.ask(s, "generate", PROMPT, SAMPLING, timeout=T) for s in shards]
        for res in before + after:
            if len(res.completions[0].token_ids) != SAMPLING["max_tokens"]:
                raise RuntimeError(f"shard slot {res.slot} returned {len(res.completions[0].token_ids)} tokens")
        summary = {
            "ray_address": address,
            "nodes": [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "port": n["NodeManagerPort"]} for n in nodes],
            "shards": [
                {
                    "slot": st["slot"],
                    "pid": st["pid"],
                    "node_id": node_id,
                    "start_s": round(st.start_s, 2),
                    "tokens_before": len(b.completions[0].token_ids),
                    "tokens_after": len(a.completions[0].token_ids),
                }
                for st, node_id, b, a in zip(starts, located, before, after)
            ],
            "refit": refit,
            "elapsed_s": round(time.monotonic() - t0, 2),
        }
        if sorted(located) != sorted(n["NodeID"] for n in nodes):
            raise RuntimeError(f"shards are on {located}, not one per node {[n['NodeID'] for n in nodes]}")
        print("RLFLEET_FLEET_CHECK " + json.dumps(summary, sort_keys=True), flush=True)
        if args.hold > 0:
            print(f"holding the shards for {args.hold:.0f} s", flush=True)
            time.sleep(args.hold)
    finally:
        for s in shards:
            ray_door.try_ask(s, "shutdown", timeout=60)
            ray_door.kill(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
