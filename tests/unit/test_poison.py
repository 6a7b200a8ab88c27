"""Poison requests (issue 29, hole 4), over the unit fakes in virtual time.

A request whose attempts took down two engines is returned with the reason ``poison``
and never sent a third time; its fingerprint (prompt and sampling, not the seed) is
logged and refused at once, by that client, for ``poison_window_s``. An engine death
counts against a request when the shard says its engine crashed during that request
(``EngineCrashedError`` with its ``request_id``), not when the engine was already dead when
it arrived; a shard's actor that died counts only against a request that was its client's only
one there (operators and lost nodes kill actors in groups). Where suspects run and when a death
counts: ``tests/unit/test_suspects.py``.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rlfleet.fleet.data.poison import actor_took_down, fingerprint, took_down
from rlfleet.fleet.errors import ConfigError, EngineCrashedError
from rlfleet.fleet.config.fleet import load_fleet_config
from rlfleet.fleet.outcome import DIED, ERROR, Outcome
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import Health, Request

POISON = [6, 6, 6]


def poisoned_door(door):
    """Every fake engine dies under a request for ``POISON`` (as a prompt that crashes the model would)."""
    untouched = door._generate
    received: list[tuple[int, int]] = []

    async def generate(s, prompt, sampling=None, request_id=None, *args, **kw):
        result = await untouched(s, prompt, sampling, request_id, *args, **kw)  # (raises ``RouteRefused`` if the shard refused it)
        if list(prompt) == POISON:  # admitted and run: its engine core dies under it, and the shard says so
            received.append((s.slot, s.incarnation))
            s.dead = True  # from now on the door answers ``died`` for this shard
            raise EngineCrashedError(f"engine core died during request {request_id}", request_id=request_id)
        return result

    door._generate = generate
    return received


def test_a_request_that_took_down_two_engines_is_returned_as_poison_and_never_sent_a_third_time(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        received = poisoned_door(door)
        await ctl.start()
        c = client(ctl)
        try:  # (before the fix it was re-sent until every engine had died, then waited at the closed gate)
            res = await asyncio.wait_for(c.generate_async(POISON, {"max_tokens": 4, "seed": 1}), 30)
        except asyncio.TimeoutError:
            pytest.fail(f"the poison request did not end; engines it reached: {received}")
        assert not res.ok and res.reason.startswith("poison: "), res
        assert res.attempts == 2 and len(received) == 2 and len({s for s, _ in received}) == 2
        assert sum(s.dead for s in door.shards.values()) == 2  # the third engine never saw it
        fp = fingerprint(POISON, {"max_tokens": 4, "seed": 1})
        assert fp in res.reason
        logged = [e for e in Request.among(ctl.log.records()) if e.event == "poison"]
        assert len(logged) == 1 and logged[0].fingerprint == fp and len(logged[0].engines) == 2
        # again, with another seed: refused at once, nothing sent anywhere
        again = await c.generate_async(POISON, {"max_tokens": 4, "seed": 2})
        assert not again.ok and again.reason.startswith("poison: ") and again.attempts == 0, again
        assert len(received) == 2
        # the fleet keeps serving other prompts (the dead slots restart meanwhile)
        others = [await c.generate_async([1, 2]) for _ in range(6)]
        assert all(r.ok for r in others)
        assert c.dispatcher.returned_reasons["poison"] == 2 and c.counters()["in_progress"] == 0
        # past the window it is a new request again (and is sent); a refit first brings the restarted slots back
        await asyncio.sleep(61)
        await ctl.sync_weights(1)
        late = await c.generate_async(POISON, {"max_tokens": 4, "seed": 3})
        assert late.reason.startswith("poison: ") and late.attempts == 2 and len(received) == 4
        await ctl.shutdown()

    run(go())


async def wait_serving(ctl, n: int, within_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while len(ctl.publisher.current.members) < n:
        assert loop.time() < end, f"{n} serving engines not reached: {ctl.publisher.current}"
        await asyncio.sleep(0.5)


def test_a_poison_one_client_found_is_refused_by_the_shards_to_another_client(model_dir):
    from rlfleet.fleet.data.client import InProcessClient
    from rlfleet.fleet.data.poison import POISON as REASON

    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        received = poisoned_door(door)
        await ctl.start()
        a, b = InProcessClient(ctl), InProcessClient(ctl)
        first = await a.dispatcher.submit(POISON, {"max_tokens": 4}, request_id="a-1")
        assert first.reason.startswith("poison: ") and len(received) == 2
        await asyncio.sleep(0.1)  # the serving shards were told (in the background)
        await wait_serving(ctl, 3)  # the two it killed restarted: a tells them as it next reads the routing state
        assert (await a.dispatcher.submit([1, 2], request_id="a-2")).ok
        await asyncio.sleep(0.1)
        other = await b.dispatcher.submit(POISON, {"max_tokens": 4, "seed": 5}, request_id="b-1")
        assert other.reason.startswith("poison: ") and "refused by slot" in other.reason, other
        assert other.attempts == 0 and len(received) == 2  # no third engine died, not even a restarted one
        assert sum(s.gate.refused.get(REASON, 0) for s in door.shards.values()) == 1
        restarted = [s for s in door.shards.values() if not s.dead and s.incarnation > 1]
        assert len(restarted) == 2 and all(s.gate.poison_refusal(lambda: fingerprint(POISON, {"max_tokens": 4}),
                                                                 asyncio.get_running_loop().time()) for s in restarted)
        assert b.dispatcher.returned_reasons["poison"] == 1 and b.dispatcher.requeued == 0
        assert (await b.dispatcher.submit([1, 2], request_id="b-2")).ok  # and nothing else is refused
        fp = fingerprint(POISON, {"max_tokens": 4})
        now = asyncio.get_running_loop().time
        assert sum(s.gate.poison_refusal(lambda: fp, now()) is not None for s in door.shards.values() if not s.dead)
        await asyncio.sleep(61)  # the shards forget it with the window
        assert not any(s.gate.poison_refusal(lambda: fp, now()) for s in door.shards.values())
        await ctl.shutdown()

    run(go())


def test_only_a_death_under_the_request_counts_against_it():
    died = Outcome(DIED, error=RuntimeError("actor died"))
    during = Outcome(ERROR, error=EngineCrashedError("engine core died during request r1", request_id="r1"))
    before = Outcome(ERROR, error=EngineCrashedError("engine core died: EngineDeadError()"))
    assert took_down(during, "r1")
    assert not took_down(died, "r1")  # an actor that died: ``actor_took_down``, with what ran beside it
    assert not took_down(before, "r1")  # it was dead when the request arrived: the request did nothing
    assert not took_down(during, "r2")
    again = pickle.loads(pickle.dumps(during.error))  # it crosses the Ray boundary with its request id
    assert isinstance(again, EngineCrashedError) and again.request_id == "r1"
    assert actor_took_down(died, 1)  # its client's only request there
    assert not actor_took_down(died, 3) and not actor_took_down(during, 1)  # others beside it; not an actor death


def test_requests_re_sent_across_two_engines_killed_one_after_the_other_with_others_beside_them_are_not_poison(model_dir):
    """Two actors killed a moment apart (an operator, a lost node), each running several of the client's requests,
    the first one's re-sent to the second: an actor death counts only against a request that was its client's
    only one there (``actor_took_down``), so none is to blame; they wait for the fleet and complete."""
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        door.gen_delay = 0.5
        untouched = door._generate
        killed: list[int] = []

        async def generate(s, prompt, *args, **kw):
            if list(prompt) == POISON and len(killed) < 2:  # the actor is killed under it (not its engine core)
                killed.append(s.slot)
                s.dead = True
            return await untouched(s, prompt, *args, **kw)

        door._generate = generate
        await ctl.start()
        c = client(ctl)
        prompts = [POISON] + [[1, 2, i] for i in range(11)]
        outs = await asyncio.wait_for(asyncio.gather(*(c.generate_async(p, {"max_tokens": 4}) for p in prompts)), 30)
        assert len(killed) == 2 and all(o.ok for o in outs), (killed, [o.reason[:80] for o in outs if not o.ok])
        assert outs[0].attempts == 3 and c.dispatcher.returned_reasons.get("poison", 0) == 0
        await ctl.shutdown()

    run(go())


def test_a_request_that_kills_its_shards_actor_alone_is_returned_as_poison_after_two_engines(model_dir):
    """A prompt that kills the shard's whole process (a segfault in the actor, a host's OOM killer after a huge
    answer), not only its engine core: the door says ``died`` and no shard names the request. Alone in flight
    there, the death counts against it: it comes back poison after two engines, the third never sees it. (Before:
    no actor death counted, and it was re-sent until its redispatch budget was spent, taking every engine down.)"""
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        untouched = door._generate
        killed: list[tuple[int, int]] = []

        async def generate(s, prompt, *args, **kw):
            if list(prompt) == POISON:  # admitted: the shard's process dies under it
                killed.append((s.slot, s.incarnation))
                s.dead = True
            return await untouched(s, prompt, *args, **kw)

        door._generate = generate
        await ctl.start()
        res = await asyncio.wait_for(client(ctl).generate_async(POISON, {"max_tokens": 4}), 30)
        assert res.reason.startswith("poison: its attempts took down 2 engines"), (res.reason, killed)
        assert res.attempts == 2 and len(killed) == 2 and len({slot for slot, _ in killed}) == 2, killed
        await ctl.shutdown()

    run(go())


def crashing_cores(door) -> list[tuple[int, int]]:
    """A poison that takes its engine core down 0.1 s into the batch it runs in, and with it every request that
    core ran, each ending with ``EngineCrashedError`` naming itself (a shard cannot tell which one broke it).
    Returns the list of (slot, incarnation) whose core crashed, filled as they do."""
    door.gen_delay = 0.5
    untouched = door._generate
    crashed: list[tuple[int, int]] = []

    async def generate(s, prompt, sampling=None, request_id=None, *args, **kw):
        run_ = asyncio.ensure_future(untouched(s, prompt, sampling, request_id, *args, **kw))
        await asyncio.sleep(0)  # admitted or refused by the shard's gate, before the poison acts
        if list(prompt) == POISON and not run_.done() and not getattr(s, "core_dead", False):
            async def crash():  # the core dies a moment into the batch the poison runs in
                await asyncio.sleep(0.1)
                if not s.core_dead:
                    crashed.append((s.slot, s.incarnation))
                    s.core_dead = True
            s.core_dead = False
            asyncio.ensure_future(crash())
        while not run_.done():
            if getattr(s, "core_dead", False):  # every request it ran ends naming itself
                run_.cancel()
                s.dead = True
                raise EngineCrashedError(f"engine core died during request {request_id}", request_id=request_id)
            await asyncio.sleep(0.01)
        return run_.result()

    door._generate = generate
    return crashed


def test_requests_that_shared_an_engine_with_a_poison_are_never_sent_beside_each_other_again_and_complete(model_dir):
    """An engine core that dies takes every request it ran with it, and the shard names each (they cannot tell
    which one broke it). Re-sent side by side, the ones that shared the poison's first engine could share its
    second as well, and be returned as poison with it (a batch of TRL's samples, refused for the window).
    A request an engine died under is sent where no other such request of its client runs: only the poison
    itself is under both deaths. Every ordinary request completes."""
    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        crashed = crashing_cores(door)
        await ctl.start()
        c = client(ctl)
        prompts = [[1, 2, i % 3] for i in range(11)] + [POISON]
        outs = await asyncio.wait_for(asyncio.gather(*(c.generate_async(p, {"max_tokens": 4}) for p in prompts)), 60)
        returned = [(p, o.reason) for p, o in zip(prompts, outs) if not o.ok]
        assert returned == [(POISON, outs[-1].reason)] and outs[-1].reason.startswith("poison: "), returned
        assert len(crashed) == 2 and len({slot for slot, _ in crashed}) == 2, crashed
        shared = [o for o in outs[:-1] if o.attempts > 1]  # some shared its first engine and were re-sent
        assert shared, [o.attempts for o in outs]
        await ctl.shutdown()

    run(go())


def test_another_clients_requests_that_shared_an_engine_with_a_poison_are_kept_apart_from_it_by_the_shards(model_dir):
    """Two clients on one fleet, one sending a poison: the other's requests that shared its first engine are
    re-sent by their own client, which cannot see the poison's re-send. The shard runs one request an engine
    died under at a time, from whichever client (``suspect`` on its ticket, refused as ``suspect`` beside
    another): the poison's second engine runs no other such request, so no request of either client but the
    poison is under both deaths, and all of them complete."""
    from rlfleet.fleet.data.client import InProcessClient
    from rlfleet.fleet.shard.request_gate import SUSPECT

    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        crashed = crashing_cores(door)
        await ctl.start()
        import random

        a, b = InProcessClient(ctl, rng=random.Random(1)), InProcessClient(ctl, rng=random.Random(2))
        a_prompts = [[1, 2, i % 3] for i in range(5)] + [POISON]
        b_prompts = [[3, 4, i] for i in range(20)]  # (without the shards' check, some came back poison: 8 seeds of 8)
        outs = await asyncio.wait_for(asyncio.gather(
            *(a.generate_async(p, {"max_tokens": 4}) for p in a_prompts),
            *(b.generate_async(p, {"max_tokens": 4}) for p in b_prompts)), 60)
        returned = [(p, o.reason) for p, o in zip(a_prompts + b_prompts, outs) if not o.ok]
        assert [p for p, _ in returned] == [POISON] and returned[0][1].startswith("poison: "), returned
        assert len(crashed) == 2 and len({slot for slot, _ in crashed}) == 2, crashed
        b_outs = outs[len(a_prompts):]
        assert any(o.attempts > 1 for o in b_outs), "the other client's requests must have shared the first engine"
        kept_apart = sum(s.gate.refused.get(SUSPECT, 0) for s in door.shards.values())
        assert kept_apart >= 1 and a.dispatcher.refused[SUSPECT] + b.dispatcher.refused[SUSPECT] == kept_apart
        await ctl.shutdown()

    run(go())


@pytest.mark.parametrize("late_s", [0.15, 0.3])
def test_a_poison_group_whose_later_copies_carry_no_death_takes_no_innocent_group_with_it(model_dir, late_s):
    """RL sends a prompt as a group of samples that differ only in their seeds (one fingerprint). Half of a
    poison group goes out with three innocent groups and takes down the engines it reaches; the other half,
    with three more innocent groups, arrives ``late_s`` after, carrying no death of its own. Those copies are
    suspect by their fingerprint (``Suspicion``): kept apart from the requests that count a death, and tried one
    at a time. Every innocent request completes, every copy of the poison comes back ``poison``, and no more
    engines die than the fleet has. (Without the fingerprint's suspicion: up to 8 engines down and 15 innocent
    requests returned as poison, whole groups refused with them, in 8 seeded runs.)"""
    import random

    from rlfleet.fleet.data.client import InProcessClient

    async def go(seed: int):
        ctl, door, _ = make(model_dir, min_healthy_engines=1, max_redispatch=5, poison_window_s=60)
        crashed = crashing_cores(door)
        await ctl.start()
        c = InProcessClient(ctl, rng=random.Random(seed))
        first = [POISON] * 4 + [[3, 4, g] for g in range(3) for _ in range(8)]
        second = [POISON] * 4 + [[5, 6, g] for g in range(3) for _ in range(8)]
        random.Random(seed).shuffle(first)
        random.Random(seed + 1).shuffle(second)

        async def send(prompts, after_s, seed0):
            await asyncio.sleep(after_s)
            return await asyncio.gather(*(c.generate_async(p, {"max_tokens": 4, "seed": seed0 + i})
                                          for i, p in enumerate(prompts)))

        outs = await asyncio.wait_for(asyncio.gather(send(first, 0, 0), send(second, late_s, 100)), 120)
        ends = list(zip(first + second, outs[0] + outs[1]))
        lost = [(p, o.reason[:80]) for p, o in ends if p != POISON and not o.ok]
        assert not lost, (seed, lost)
        copies = [o for p, o in ends if p == POISON]
        assert all(not o.ok and o.reason.startswith("poison: ") for o in copies), seed
        assert not [o for o in copies if "refused by slot" in o.reason], \
            ("the copies that waited behind the one tried are returned by their client, unsent", seed,
             [(o.attempts, o.reason[:60]) for o in copies])
        assert len(crashed) <= 3, (seed, crashed)
        assert any(o.attempts > 1 for p, o in ends if p != POISON), "innocent requests shared the poison's engines"
        await ctl.shutdown()

    for seed in range(3):
        run(go(seed))


def test_suspicion_of_a_fingerprint_ends_with_a_completion_or_its_window():
    from rlfleet.fleet.data.poison import Suspicion

    s = Suspicion(window_s=10)
    assert not s and not s.suspect("f", 0.0)
    s.mark("f", 0.0)
    s.mark("g", 0.0)
    assert s.suspect("f", 9.9) and s.take("f") and not s.take("f"), "one request of a suspect fingerprint at a time"
    s.release("f")
    assert s.take("f")
    s.clear("f")
    assert not s.suspect("f", 1.0) and s.suspect("g", 1.0) and not s.suspect("g", 10.0), "cleared, or its window ended"
    off = Suspicion(window_s=0)  # poison_window_s 0: nothing remembered
    off.mark("f", 0.0)
    assert not off and not off.suspect("f", 0.0)


def test_a_fingerprint_stays_suspect_until_a_request_with_it_runs_to_its_end():
    """Ended by its caller while it waited (``/abort_requests``), a request completes with nothing, which says
    nothing about its fingerprint; one that ran to its end clears it."""
    from tests.unit.test_abort_requests import fleet

    async def go(gate_open: bool, end: bool) -> bool:
        _, _, d = fleet(gate_open)
        fp = fingerprint([1, 2], {"max_tokens": 3})
        d._suspicion.mark(fp, d._clock.now())
        request = asyncio.ensure_future(d.submit([1, 2], {"max_tokens": 3}, "w"))
        await asyncio.sleep(0.05)
        if end:
            assert d.end(["w"]) == ["w"]
        assert (await request).ok
        return d._suspicion.suspect(fp, d._clock.now())

    assert asyncio.run(go(gate_open=False, end=True)), "ended unsent: still suspect"
    assert not asyncio.run(go(gate_open=True, end=False)), "ran to its end: cleared"


def test_a_client_report_that_a_live_shard_cannot_serve_is_probed_and_the_actor_killed_only_on_the_probes_answer(model_dir):
    """A dying engine core fails every request it ran, and those of one client may fail (and be reported) before
    the poison request of another answers. Killed on that report, the actor would leave the poison's own call a
    dead actor, no evidence against it, and the poison would go on to a third engine (the real matrix variant
    with a second client did exactly that). A report of a live shard that cannot serve (``unusable``) gets a
    probe instead; the shard answers it once the requests it ran have answered (``EngineShard.ping``), and that
    answer gets the actor killed. A dead actor's report (``died``) is taken at once, as before."""
    from rlfleet.fleet.outcome import UNUSABLE
    from rlfleet.fleet.records import Kill

    async def go():
        ctl, door, _ = make(model_dir, min_healthy_engines=1)
        await ctl.start()
        loop = asyncio.get_running_loop()
        crashed = door.shards[(0, 1)]
        pinged: list[float] = []
        untouched = door._ping

        async def ping(s, epoch=None):
            if s is crashed:
                pinged.append(loop.time())
                await asyncio.sleep(0.3)  # the shard lets the requests its dead core ran answer first
                raise EngineCrashedError("engine core died (its requests have answered)")
            return await untouched(s, epoch)

        door._ping = ping
        t0 = loop.time()
        detail = "error: EngineCrashedError: engine core died during request b-3"
        assert ctl.report_failure(0, 1, UNUSABLE, detail, ctl.publisher.current.epoch) is True
        await asyncio.sleep(0.2)
        assert pinged and pinged[0] - t0 < 0.05, "the report is probed at once"
        assert not crashed.dead and not Kill.among(ctl.log.records()), "killed on the report, before its requests answered"
        await asyncio.sleep(0.3)
        [kill] = [k for k in Kill.among(ctl.log.records()) if k.slot == 0]
        assert crashed.dead and "probe" in kill.reason and "engine core died" in kill.reason, kill
        assert ctl.report_failure(1, 1, DIED, "died: ActorDiedError: gone", ctl.publisher.current.epoch) is True
        assert door.shards[(1, 1)].dead, "a dead actor is taken as dead at once"
        await ctl.shutdown()

    run(go())


def test_the_fingerprint_is_the_prompt_and_sampling_but_not_the_seed():
    assert fingerprint([1, 2], {"max_tokens": 4, "seed": 1}) == fingerprint([1, 2], {"seed": 9, "max_tokens": 4})
    assert fingerprint([1, 2], {"max_tokens": 4}) != fingerprint([1, 2], {"max_tokens": 5})
    assert fingerprint([1, 2], {}) != fingerprint([2, 1], {}) and fingerprint("ab", {}) != fingerprint("ba", {})


@pytest.mark.parametrize("bad", [-1, float("nan"), "soon"])
def test_a_bad_poison_window_is_refused_naming_it(model_dir, bad):
    with pytest.raises(ConfigError, match="poison_window_s"):
        load_fleet_config({"engine": {"model": model_dir}, "poison_window_s": bad})


# ------------------------------------------------------------------ the fault action: a prompt that crashes its engine
def test_a_poison_fault_crashes_the_engine_under_a_matching_request_only(tmp_path, monkeypatch):
    from rlfleet.fleet.shard import fault_hooks
    from rlfleet.fleet.shard.fault_hooks import ArmedFault
    from rlfleet.fleet.shard.null_backend import NullBackend
    from rlfleet.fleet.shard.engine_shard import EngineShard

    monkeypatch.setattr(fault_hooks, "ENGINE_DEATH_WAIT_S", 0.05)  # the null engine has no core to see die
    for bad in (dict(point="generate", action="poison"), dict(point="generate", action="kill", match=(1,)),
                dict(point="pause", action="poison", match=(1,))):
        with pytest.raises(ValueError, match="match"):
            ArmedFault(**bad)

    async def go():
        (tmp_path / "config.json").write_text("{}")
        shard = EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1,
                            backend_factory=lambda cfg: NullBackend(cfg))
        await shard.start()
        shard.arm_fault("generate", "poison", match=POISON)
        assert (await shard.generate([1, 2], {}, "fine")).completions
        for rid in ("p1", "p2"):  # every matching request, not once
            with pytest.raises(EngineCrashedError) as err:
                await shard.generate([9, *POISON, 9], {}, rid)
            assert err.value.request_id == rid and "poison" in str(err.value)
        assert [f["action"] for f in shard.faults_fired()] == ["poison", "poison"]
        assert shard.in_flight() == []

    asyncio.run(go())


def test_the_poison_variant_proof_fails_when_a_third_engine_dies_the_repeat_is_sent_or_the_other_client_loses_one():
    from rlfleet.faults.poison import prove_poison_request

    first = {"version": 1, "outcome": "poison", "attempts": 2, "began": 10.0, "ended": 12.0,
             "reason": "poison: its attempts took down 2 engines"}
    again = {"version": 1, "outcome": "poison", "attempts": 0, "began": 12.0, "ended": 12.0,
             "reason": "poison: fingerprint f took down ... (poison_window_s); refused without sending it"}
    beside = {"n": 24, "ok": 24, "resent": 3, "reasons": []}
    record = {"other_client": beside, "others": {"n": 6, "ok": 6}, "after": {"gate_open": True}}

    def died(slot, t):
        return Health(t=t, slot=slot, incarnation=1, before="healthy", after="dead", reason="").as_dict()

    events = [died(0, 10.5), died(1, 11.5),
              Request(event="poison", request_id="p", t=12.0, fingerprint="f", engines=["slot 0", "slot 1"]).as_dict()]
    assert prove_poison_request(record, [first, again], events) == []
    assert any("exactly two" in p for p in prove_poison_request(record, [first, again], events + [died(2, 13.0)]))
    sent = {**again, "outcome": "poison", "attempts": 1, "reason": "poison: its attempts took down 2 engines"}
    assert any("not refused at once" in p for p in prove_poison_request(record, [first, sent], events))
    lost = {**record, "other_client": {**beside, "ok": 23, "reasons": ["poison: its attempts took down 2 engines"]}}
    assert any("23 of the other client's 24" in p for p in prove_poison_request(lost, [first, again], events))
    apart = {**record, "other_client": {**beside, "resent": 0}}
    assert any("never met" in p for p in prove_poison_request(apart, [first, again], events))


def test_a_shard_told_of_a_poison_refuses_it_from_anyone_and_runs_everything_else(tmp_path):
    from rlfleet.fleet.errors import RouteRefused
    from rlfleet.fleet.shard.null_backend import NullBackend
    from rlfleet.fleet.shard.engine_shard import EngineShard

    async def go():
        (tmp_path / "config.json").write_text("{}")
        shard = EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1,
                            backend_factory=lambda cfg: NullBackend(cfg))
        await shard.start()
        assert shard.refuse_poison(fingerprint(POISON, {"max_tokens": 4}), 60.0) is True
        with pytest.raises(RouteRefused) as err:
            await shard.generate(POISON, {"max_tokens": 4, "seed": 7}, "p")
        assert err.value.reason == "poison" and "two engines" in str(err.value)
        assert (await shard.generate(POISON, {"max_tokens": 5}, "q")).completions  # other sampling: another request
        assert shard.counters().refused == {"poison": 1} and shard.counters().admitted == 1

    asyncio.run(go())



def test_the_poison_in_batch_proof_fails_when_an_innocent_is_lost_a_third_engine_dies_or_the_poison_completes():
    from rlfleet.faults.poison import prove_poison_in_batch

    call = {"version": 1, "outcome": "poison", "attempts": 2, "began": 10.0, "ended": 14.0,
            "reason": "poison: its attempts took down 2 engines"}
    record = {"armed": [0, 1, 2], "innocents": {"n": 23, "ok": 23, "resent": 7, "reasons": []},
              "after": {"gate_open": True}}

    def died(slot, t):
        return Health(t=t, slot=slot, incarnation=1, before="healthy", after="dead", reason="").as_dict()

    events = [died(0, 10.5), died(1, 11.5),
              Request(event="poison", request_id="p", t=12.0, fingerprint="f", engines=["slot 0", "slot 1"]).as_dict()]
    assert prove_poison_in_batch(record, [call], events) == []
    assert any("at most two" in p for p in prove_poison_in_batch(record, [call], events + [died(2, 13.0)]))
    lost = {**record, "innocents": {**record["innocents"], "ok": 21, "reasons": ["no serving shard within the request"]}}
    assert any("only 21 of the batch's 23" in p for p in prove_poison_in_batch(lost, [call], events))
    done = {**call, "outcome": "completed", "attempts": 1}
    assert any("not as poison" in p for p in prove_poison_in_batch(record, [done], events[:1]))
    assert any("three engines" in p for p in prove_poison_in_batch({**record, "armed": [0, 2]}, [call], events))
