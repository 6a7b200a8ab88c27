"""The preparing pool (``serve.prepare_pool``): one hostile request cannot hold the others.

Threads and short limits; the real hostile template (a request's own chat template that loops) is the last test.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlfleet.serve.prepare_pool import PoolBusy, PreparePool, PrepareTimeout


def _pool(**kw) -> tuple[PreparePool, list]:
    kits = []

    def make():
        kits.append(f"kit-{len(kits) + 1}")
        return kits[-1]

    return PreparePool("kit-0", make, **kw), kits


def test_a_job_past_the_limit_is_given_up_and_a_fresh_worker_serves_the_ones_behind_it():
    pool, kits = _pool(limit_s=0.2)
    release = threading.Event()

    async def go():
        stuck = asyncio.ensure_future(pool.run(lambda kit: release.wait(5.0)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        quick = await pool.run(lambda kit, x: (kit, x * 2), 21)  # queued behind the stuck one
        waited = time.monotonic() - t0
        with pytest.raises(PrepareTimeout, match="longer than 0.2 s"):
            await stuck
        return quick, waited

    quick, waited = asyncio.run(go())
    assert quick == ("kit-1", 42) and kits == ["kit-1"]  # answered by the replacement, with its own kit
    assert waited < 2.0 and pool.timed_out == 1 and pool.replaced == 1
    release.set()
    pool.close()


def test_what_a_job_raises_reaches_its_caller_and_the_worker_goes_on():
    pool, _ = _pool(limit_s=5.0)

    def bad(kit):
        raise ValueError("prompt is empty")

    async def go():
        with pytest.raises(ValueError, match="prompt is empty"):
            await pool.run(bad)
        return await pool.run(lambda kit: kit)

    assert asyncio.run(go()) == "kit-0"
    pool.close()


def test_a_full_queue_and_a_pool_of_stuck_workers_answer_busy_at_once():
    pool, _ = _pool(limit_s=0.1, max_waiting=2, max_stuck=1)
    release = threading.Event()

    async def go():
        held = [asyncio.ensure_future(pool.run(lambda kit: release.wait(5.0))) for _ in range(2)]
        await asyncio.sleep(0.02)
        with pytest.raises(PoolBusy, match="2 requests are waiting"):
            await pool.run(lambda kit: 1)
        with pytest.raises(PrepareTimeout):
            await held[0]
        # the one stuck worker is the bound: no new job is taken until it ends
        with pytest.raises(PoolBusy, match="held by a request that ran past"):
            await pool.run(lambda kit: 1)
        release.set()
        await asyncio.gather(*held[1:], return_exceptions=True)
        for _ in range(100):
            try:
                return await pool.run(lambda kit: "served again")
            except PoolBusy:
                await asyncio.sleep(0.02)

    assert asyncio.run(go()) == "served again"
    pool.close()


def test_a_hostile_request_template_is_refused_and_other_requests_are_rendered_meanwhile(tiny_model):
    """A trusted request template that loops for seconds: the request gets a 400 naming ``messages`` after the
    limit, while a plain chat request sent after it is rendered by a fresh worker (its own tokenizer copy)."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from rlfleet.serve.app import build_app
    from rlfleet.serve.front import Front
    from rlfleet.serve.render import ChatOptions, ChatRenderer
    from tests.unit.test_serve import _Capturing

    tok = AutoTokenizer.from_pretrained(tiny_model)
    front = Front(_Capturing(), tok, "m", 512,
                  chat=ChatRenderer(tiny_model, 512, tok, ChatOptions(trust_request_chat_template=True)))
    front.prepare_pool.limit_s = 1.0
    hostile = ("{% set ns = namespace(n=0) %}{% for i in range(700) %}{% for j in range(700) %}"
               "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}")  # about 4 s of the sandbox's time
    http = TestClient(build_app(front))
    out: dict = {}

    def send_hostile():
        out["hostile"] = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "chat_template": hostile, "max_tokens": 1})

    t = threading.Thread(target=send_hostile)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    plain = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    plain_s = time.monotonic() - t0
    t.join(60)
    assert plain.status_code == 200, plain.text
    r = out["hostile"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "took too long" in r.json()["error"]["message"]
    assert front.prepare_pool.timed_out == 1 and plain_s < 30, plain_s
    front.prepare_pool.close()
