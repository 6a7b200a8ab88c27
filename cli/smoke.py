"""The smoke job: a local Ray, N engine shards, generate, pause (keep), resume, cache reset, stats.

Proves on any machine that the install works end to end. Returns a summary dict;
``ok`` is False if any step did not behave as specified.
"""

from __future__ import annotations

import time

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.config.engine import EngineConfig, validate
from rlfleet.fleet.errors import ConfigError


def run_smoke(engines: int = 2, model: str | None = None) -> dict:
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ConfigError("engines", "the smoke check needs at least one engine", engines)
    from rlfleet.recipe.tinymodel import build_model, default_model_dir

    model = model or str(build_model(default_model_dir("tiny")))
    cfg = validate(EngineConfig, {"model": model}, prefix="engine")
    t0 = time.monotonic()
    ray_door.init_local(num_cpus=max(4, engines * 2), log_to_driver=False)
    shards = [ray_door.spawn_shard(cfg, slot=i, incarnation=1) for i in range(engines)]
    try:
        starts = [ray_door.ask(s, "start", timeout=cfg.start_timeout_s + 30) for s in shards]
        sampling = {"max_tokens": 64, "ignore_eos": True, "seed": 0}
        held = [ray_door.submit(s, "generate", [1, 2, 3, 4], sampling) for s in shards]
        paused = [ray_door.try_ask(s, "pause", mode="keep", timeout=60, expect_ack=True).ok for s in shards]
        resumed = [ray_door.try_ask(s, "resume", timeout=60, expect_ack=True).ok for s in shards]
        results = ray_door.results(held, 300)
        resets = [ray_door.ask(s, "reset_prefix_cache", timeout=60) for s in shards]
        stats = [ray_door.ask(s, "stats", timeout=30) for s in shards]
        memory = [ray_door.ask(s, "memory_mb", timeout=30) for s in shards]
        tokens = [len(r.completions[0].token_ids) for r in results]
        ok = all(paused) and all(resumed) and all(resets) and tokens == [64] * engines
        return {
            "ok": ok,
            "engines": engines,
            "engine_start_s": [round(s.start_s, 2) for s in starts],
            "tokens_per_engine": tokens,
            "paused_ok": paused,
            "resumed_ok": resumed,
            "prefix_cache_reset": resets,
            "kv_cache_tokens": [s.kv_cache_tokens for s in stats],
            "resident_mb": [round(m["total"]) for m in memory],
            "wall_s": round(time.monotonic() - t0, 2),
        }
    finally:
        for s in shards:
            ray_door.try_ask(s, "shutdown", timeout=60)
            ray_door.kill(s)
        ray_door.shutdown()
