"""The data path at GPU token rates, on real Ray actors (issue 51): 256 streamed requests on two shards of the
token-rate engine (vLLM's own output processor, no GPU: ``fleet.shard.token_rate``), one shard killed while
every request is mid-stream. Each caller is told every token exactly once and in order: what it was told is
the result's completion, of its whole budget, and the requests that ran on the killed shard went on from
the tokens they held (continued, their tokens reused, not generated again). The kill is proven to have
fired: the slot's incarnation died and was replaced, and its requests were in flight there when it did. Both
engines had their pace before the requests came (a warm-up), so each sent the first requests' tokens several an
output (``fleet.shard.stream_pace``): tokens the killed engine still held back were lost with it, and made again.

All of them share one data link per client and shard (``fleet.link``), whose answers carry every request's
output at once: the test also reads that the client took its output over the links, a few hundred answers
(not one message per request and answer), and made no poll by actor call.
"""

from __future__ import annotations

import pytest

from rlfleet.fleet.api import Fleet
from tests.integration.fleet_helpers import wait_for

pytestmark = pytest.mark.integration

REQUESTS, TOKENS = 256, 512


@pytest.fixture(scope="module")
def fleet(ray_local, tiny_model):
    f = Fleet.start({
        "engine": {"model": tiny_model, "backend": "token_rate", "token_rate_per_s": 100, "token_rate_batch": 256,
                   "max_model_len": 1024, "num_cpus": 0},
        "num_engines": 2, "min_healthy_engines": 1, "metrics": False, "admission": {"enabled": False},
        "stream_interval_s": 0.2,  # at 100 steps a second each engine may gather up to 8 tokens an output
    })  # fmt: skip
    try:
        yield f
    finally:
        f.shutdown()


def test_a_shard_killed_mid_stream_at_256_requests_loses_no_token_and_repeats_none(fleet):
    client = fleet.client
    told: dict[int, list[int]] = {i: [] for i in range(REQUESTS)}
    sampling = {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0}
    warm = [client.spawn(client.generate_async([9, i], {**sampling, "max_tokens": 24}, None, None, lambda d: None))
            for i in range(16)]  # both engines step a while: each shard has their pace
    assert all(f.result(120).ok for f in warm)
    futures = [client.spawn(client.generate_async([3 + i % 50, 5, 7], {**sampling, "seed": i}, None, None,
                                                  lambda d, i=i: told[i].extend(d.token_ids)))
               for i in range(REQUESTS)]  # fmt: skip
    wait_for(lambda: min(len(t) for t in told.values()) >= 40, 240, 0.1, "every request 40 tokens in")
    held = {slot: set(rids) for slot, rids in client.dispatcher.outstanding.items()}
    victim = max(held, key=lambda s: len(held[s]))
    before = {r["slot"]: r["incarnation"] for r in fleet.status()["ledger"]["slots"]}
    assert len(held[victim]) > 50 and min(len(t) for t in told.values()) < TOKENS  # mid-stream, many on it
    # its engine held tokens back as the kill came: the first requests came to the pace the warm-up measured (a
    # loaded machine slows the steps as the rest arrive, and those may start at one token an output)
    gathered = fleet.shard_counters()[victim]["gathered"]
    assert sum(n for k, n in gathered.items() if int(k) > 1) >= 8, gathered
    assert fleet.fault_injector().kill_shard(victim)

    results = [f.result(600) for f in futures]
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok][:3]
    for i, r in enumerate(results):
        completion = r.result.completions[0]
        assert list(completion.token_ids) == told[i], f"request {i}: told != result"
        assert len(completion.token_ids) == TOKENS and len(completion.logprobs) == TOKENS
    continued = [r for r in results if r.continued]
    assert len(continued) >= len(held[victim]) // 2, (len(continued), len(held[victim]))
    assert all(r.tokens_reused > 0 for r in continued)

    # the kill fired: that slot's incarnation is gone and a newer one took its place
    wait_for(lambda: {r["slot"]: r["incarnation"] for r in fleet.status()["ledger"]["slots"]}[victim] > before[victim],
             120, 0.2, "the killed slot's replacement")  # fmt: skip
    counters = client.counters()
    assert counters["links"] >= 2 and counters["polls"] == 0, counters  # over the links, not by actor calls
    assert 0 < counters["link_answers"] < REQUESTS * 20, counters  # one answer for every request on a shard
