"""Suspects (issue 47): requests an engine died under, over the unit fakes in virtual time.

A dying engine core names every request it ran; each becomes a suspect. Where suspects run, when a death counts
toward ``poison``, and how long a suspect may wait are ``fleet.data.suspects``'s: a suspect's wait for a shard it
may run on does not spend its request timeout (bounded); suspects share a shard when many wait; a death counts
only against a request that ran as the only suspect on its engine (or as none); and a shard actor that dies with
one request of its client in flight counts against that request (``fleet.data.poison.actor_took_down``).
"""

from __future__ import annotations

import asyncio
import random

from rlfleet.fleet.data.client import InProcessClient
from rlfleet.fleet.data.suspects import SUSPECT_ROUNDS, Evidence, SuspectBook, allowance, may_join
from rlfleet.fleet.errors import EngineCrashedError
from tests.unit.test_controller import make, run
from tests.unit.test_poison import POISON, crashing_cores


def outcomes(prompts, outs):
    """(innocents that did not complete with their reasons, the poison's results)."""
    lost = [(p, o.reason[:100]) for p, o in zip(prompts, outs) if p != POISON and not o.ok]
    return lost, [o for p, o in zip(prompts, outs) if p == POISON]


def test_innocents_behind_a_poisons_suspects_do_not_spend_their_timeout_waiting_for_a_shard_they_may_run_on(model_dir):
    """A poison in a batch of 48 on three engines: its engine dies and names the 15 or 16 requests it ran, each a
    suspect, run one per shard on the others (each a generation of 0.5 s) while the request timeout is 1.5 s.
    The last of them start some 2 s in: a suspect's wait for a shard it may run on moves its deadline on, so
    every innocent completes and the poison is found, after two engines. (Before: 6 innocents and the poison
    itself came back "no serving shard within the request timeout".)"""
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60,
                            request_timeout_s=1.5)
        crashed = crashing_cores(door)
        await ctl.start()
        c = InProcessClient(ctl, rng=random.Random(3))
        prompts = [[1, 2, i] for i in range(47)]
        prompts.insert(24, POISON)
        outs = await asyncio.wait_for(asyncio.gather(*(c.generate_async(p, {"max_tokens": 4}) for p in prompts)), 60)
        lost, [poison] = outcomes(prompts, outs)
        assert not lost, lost
        assert poison.reason.startswith("poison: ") and len(crashed) == 2, (poison.reason, crashed)
        assert any(o.ok and o.attempts > 1 and o.latency_s > 1.5 for o in outs), \
            "no innocent waited past its request timeout: the test shows nothing"
        await ctl.shutdown()

    run(go())


def crash_cores_at(door, when: dict[int, float]) -> list[tuple[int, int, int]]:
    """Each slot in ``when`` has its first incarnation's engine core die at that virtual time, whatever it runs (a
    crash of its own, no poison): every request there ends with ``EngineCrashedError`` naming itself. Returns
    (slot, incarnation, suspects it ran) for each crash, filled as they happen."""
    door.gen_delay = 0.5
    untouched = door._generate
    crashed: list[tuple[int, int, int]] = []

    async def crash(slot: int, at: float) -> None:
        await asyncio.sleep(at)
        s = door.shards[(slot, 1)]
        crashed.append((slot, 1, len(s.suspects)))
        s.core_dead = True

    for slot, at in when.items():
        asyncio.ensure_future(crash(slot, at))

    async def generate(s, prompt, sampling=None, request_id=None, *args, **kw):
        run_ = asyncio.ensure_future(untouched(s, prompt, sampling, request_id, *args, **kw))
        while not run_.done():
            if getattr(s, "core_dead", False):
                run_.cancel()
                s.dead = True
                raise EngineCrashedError(f"engine core died during request {request_id}", request_id=request_id)
            await asyncio.sleep(0.01)
        return run_.result()

    door._generate = generate
    return crashed


def test_many_suspects_share_a_shard_and_a_death_among_several_of_them_counts_against_none(model_dir):
    """Two unrelated engine crashes under a batch of 90 on three engines (no poison): the first leaves some 30
    suspects, too many to run one per shard in ``SUSPECT_ROUNDS`` generations, so they run two to a shard; the
    second engine dies while two of them run there. Only one of several suspects can be the culprit: that death
    counts against neither (each stays suspect and runs alone from then on), and every request completes.
    (Before: one suspect per shard, and the one on the second engine was returned as poison, its fingerprint
    refused for the window.)"""
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        await ctl.start()
        crashed = crash_cores_at(door, {0: 0.1, 1: 0.3})
        c = InProcessClient(ctl, rng=random.Random(5))
        prompts = [[3, 4, i] for i in range(90)]
        outs = await asyncio.wait_for(asyncio.gather(*(c.generate_async(p, {"max_tokens": 4}) for p in prompts)), 60)
        lost = [(p, o.reason[:100]) for p, o in zip(prompts, outs) if not o.ok]
        assert not lost and c.dispatcher.returned_reasons.get("poison", 0) == 0, lost
        assert [(slot, inc) for slot, inc, _ in crashed] == [(0, 1), (1, 1)]
        assert crashed[1][2] >= 2, f"the second engine died with {crashed[1][2]} suspect(s): the test shows nothing"
        assert max(s.peak_suspects for s in door.shards.values()) >= 2
        await ctl.shutdown()

    run(go())


def test_a_poison_among_so_many_suspects_that_they_share_shards_is_isolated_by_halving_its_group(model_dir):
    """A poison in a batch of 150 on three engines: its engine dies with some 50 requests, which run four to a
    shard. The poison's group dies with it (a death among several suspects: it counts against none), and its
    members run two to a shard from then on, then alone; the poison's death alone among suspects is its second.
    It comes back poison after at most 2 + log2(4) engines, and every innocent completes."""
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=8, poison_window_s=60)
        crashed = crashing_cores(door)
        await ctl.start()
        c = InProcessClient(ctl, rng=random.Random(7))
        prompts = [[5, 6, i] for i in range(149)]
        prompts.insert(70, POISON)
        outs = await asyncio.wait_for(asyncio.gather(*(c.generate_async(p, {"max_tokens": 4}) for p in prompts)), 120)
        lost, [poison] = outcomes(prompts, outs)
        assert not lost, lost
        assert poison.reason.startswith("poison: ") and "among other suspects" in poison.reason, poison.reason
        assert 2 < len(crashed) <= 2 + 2, crashed
        await ctl.shutdown()

    run(go())


def test_a_suspects_wait_for_a_shard_moves_its_deadline_on_by_at_most_one_more_request_timeout():
    """Every shard runs a suspect that must run alone (another request of its client, forever): a suspect waits.
    Its wait moves its deadline on, but by one request timeout at most: it comes back after twice its timeout,
    saying it waited as a suspect, not never."""
    from rlfleet.fleet.data.dispatch import Dispatcher
    from rlfleet.fleet.data.poison import fingerprint
    from rlfleet.fleet.data.routing_state import Member, RoutingState
    from rlfleet.fleet.eventlog import EventLog
    from tests.unit.fleet_fakes import FakeDoor, LoopClock, StateView, run_virtual

    async def go():
        view = StateView(FakeDoor(), RoutingState(1, True, 0, (Member(0, 1, None), Member(1, 1, None))))
        d = Dispatcher(view, EventLog(), request_timeout_s=2.0, max_redispatch=3, clock=LoopClock(),
                       rng=random.Random(0))
        d._suspicion.mark(fingerprint([1, 2], {"max_tokens": 3}), 0.0)  # an engine died under one like it
        for key in ((0, 1), (1, 1)):
            d._suspects.start(key, 1)
        r = await asyncio.wait_for(d.submit([1, 2], {"max_tokens": 3}, "w"), 60)
        assert r.reason.startswith("no serving shard within the request timeout") and "as a suspect" in r.reason, r
        assert 4.0 <= r.latency_s < 4.6 and r.attempts == 0, r

    run_virtual(go())


def test_the_allowance_grows_with_the_suspects_waiting_and_shrinks_with_a_death_among_several():
    per_round = 2 * SUSPECT_ROUNDS  # two shards serving
    assert allowance(1, 2) == 1 and allowance(per_round, 2) == 1, "one per shard while they drain in the rounds"
    assert allowance(per_round + 1, 2) == 2 and allowance(3 * per_round, 2) == 3 and allowance(5, 0) == 1
    assert allowance(3 * per_round, 2, share=2) == 2 and allowance(1, 2, share=4) == 1
    assert may_join((), 1) and not may_join((1,), 3) and not may_join((3,), 1)
    assert may_join((3, 3), 3) and not may_join((3, 3, 3), 3) and not may_join((2, 4), 4) and not may_join((), 0)
    e = Evidence()
    assert e.fell("a", 0) and e.fell("b", 1) and e.deaths == ["a", "b"], "as no suspect, or the only one: counts"
    e = Evidence()
    assert not e.fell("a", 5) and e.suspect and not e.deaths and e.share == 2, "among several: none, and halves"
    assert not e.fell("b", 2) and e.share == 1 and e.fell("c", 1) and e.deaths == ["c"]
    assert e.describe() == "3 engines (c; and a, b, where it ran among other suspects)"
    book = SuspectBook(wait_bound_s=10.0)
    assert book.credit(0.0, 4.0) == 4.0 and book.credit(8.0, 4.0) == 2.0 and book.credit(10.0, 1.0) == 0.0
    book.start((0, 1), 2)
    assert book.fits((0, 1), 2, 0.0) and not book.fits((0, 1), 1, 0.0) and book.count() == 1
    book.hold((1, 1), until=5.0)
    assert not book.fits((1, 1), 2, 4.0) and book.fits((1, 1), 2, 5.0) and book.holds(5.0) == []
    book.crashed.add((2, 1))
    assert book.count(lambda key: 7 if key == (2, 1) else 0) == 8, "what still runs on a crashed engine counts"
    book.end((0, 1), 2)
    assert book.running == {} and book.count() == 0
