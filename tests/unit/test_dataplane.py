"""The data plane's pure pieces and the shard's gate, in-process (no Ray).

- ``VersionPolicy``: parsing (the error names ``version_policy``) and what each policy allows;
- ``ShardGate``: each refusal reason, and that membership changes raise the floor;
- ``EngineShard`` over ``NullBackend``: a refused request never reaches the engine, a re-sent id
  never runs twice (completed: the same result; running: joins), ``begin_refit`` aborts by policy;
- ``pick_two``: only members with room, the less loaded of two, reproducible with a seed;
- the controller's routing state: published with a new epoch on each change, closing at once,
  client timeouts during a refit not taken as shard failures.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from rlfleet.fleet.errors import RouteRefused
from rlfleet.fleet.shard.null_backend import NullBackend
from rlfleet.fleet.outcome import DIED, TIMED_OUT, Outcome
from rlfleet.fleet.data.shard_choice import pick_two
from rlfleet.fleet.data.routing_state import ANY, LATEST, MAX_STALENESS, Member, Ticket, VersionPolicy
from rlfleet.fleet.shard.engine_shard import EngineShard
from rlfleet.fleet.shard.request_gate import EPOCH, NOT_MEMBER, PAUSED, VERSION, RecentResults, ShardGate
from rlfleet.health import CallKind
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import Health, ReportIgnored, Routing
from rlfleet.fleet.wire import BeginRefit


# ------------------------------------------------------------------ version policy
@pytest.mark.parametrize("value,kind,k", [
    (None, ANY, 0), ("latest", LATEST, 0), ("any", ANY, 0), ("max_staleness=2", MAX_STALENESS, 2),
    ({"max_staleness": 3}, MAX_STALENESS, 3), ("max_staleness = 0", MAX_STALENESS, 0),
])
def test_version_policy_parses(value, kind, k):
    p = VersionPolicy.parse(value)
    assert (p.kind, p.k) == (kind, k)


@pytest.mark.parametrize("bad", ["newest", "max_staleness=-1", "max_staleness", 3, {"staleness": 1}, ["latest"]])
def test_a_bad_version_policy_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="version_policy"):
        VersionPolicy.parse(bad)


def test_what_each_policy_allows():
    latest, one, anything = VersionPolicy(LATEST), VersionPolicy(MAX_STALENESS, 1), VersionPolicy(ANY)
    assert latest.allows(5, 5) and not latest.allows(4, 5)
    assert one.allows(4, 5) and not one.allows(3, 5)
    assert anything.allows(0, 99)
    assert VersionPolicy.for_fleet(None) == anything and VersionPolicy.for_fleet(2) == VersionPolicy(MAX_STALENESS, 2)


# ------------------------------------------------------------------ the shard's gate
def member_gate(epoch: int = 3, committed: int = 2) -> ShardGate:
    g = ShardGate()
    g.route(epoch, True, committed)
    return g


def test_gate_refusal_reasons():
    g = member_gate()
    t = Ticket(3, VersionPolicy(LATEST))
    assert g.refusal(t, 2) is None
    assert g.refusal(Ticket(2), 2) == EPOCH  # routed before the shard joined
    assert g.refusal(t, 1) == VERSION  # weights behind the committed version, policy latest
    assert g.refusal(Ticket(3, VersionPolicy(ANY)), 1) is None
    g.paused = True
    assert g.refusal(t, 2) == PAUSED and g.refusal(None, 2) == PAUSED  # paused refuses even untagged calls
    g.paused = False
    g.route(7, False, 2)
    assert g.refusal(Ticket(9), 2) == NOT_MEMBER
    assert g.refusal(None, 2) is None  # an operator's direct call on a non-member


def test_the_gate_runs_one_request_an_engine_died_under_at_a_time_and_any_number_of_others():
    from rlfleet.fleet.shard.request_gate import SUSPECT

    g = member_gate()
    suspect, plain = Ticket(3, VersionPolicy(ANY), suspect=1), Ticket(3, VersionPolicy(ANY))
    assert g.admit(suspect, 2, in_flight=5, suspects=()) is None  # beside ordinary requests: admitted
    assert g.admit(suspect, 2, in_flight=6, suspects=(1,)) == SUSPECT  # beside another such one: refused
    assert g.admit(plain, 2, in_flight=6, suspects=(1,)) is None  # an ordinary one is not held back by it
    assert g.counters()["refused"] == {SUSPECT: 1} and g.admitted == 2


def test_the_gate_lets_suspects_share_an_engine_only_as_far_as_each_ones_allowance_admits():
    """When many suspects wait their client sends them with an allowance above 1 (``fleet.data.suspects``): the
    shard runs that many side by side, and never puts one beside a suspect that must run alone (allowance 1: its
    death is the one that counts toward poison), from whichever client."""
    from rlfleet.fleet.shard.request_gate import SUSPECT

    g = member_gate()

    def ticket(allowance):
        return Ticket(3, VersionPolicy(ANY), suspect=allowance)

    assert g.admit(ticket(3), 2, in_flight=4, suspects=(3,)) is None
    assert g.admit(ticket(3), 2, in_flight=5, suspects=(3, 3)) is None
    assert g.admit(ticket(3), 2, in_flight=6, suspects=(3, 3, 3)) == SUSPECT  # three of three
    assert g.admit(ticket(3), 2, in_flight=6, suspects=(2, 3)) == SUSPECT  # one there allows two only
    assert g.admit(ticket(1), 2, in_flight=6, suspects=(3,)) == SUSPECT  # it must run alone
    assert g.admit(ticket(4), 2, in_flight=6, suspects=(1,)) == SUSPECT  # the one there must
    assert g.admit(ticket(1), 2, in_flight=6, suspects=()) is None


def test_fence_and_rejoin_raise_the_floor():
    g = member_gate(epoch=3)
    g.fence(5)
    assert g.refusal(Ticket(4), 2) == EPOCH and g.refusal(Ticket(5), 2) is None
    g.route(6, True, 3)  # staying a member: the floor does not move
    assert g.floor == 5 and g.committed == 3
    g.route(8, False, 3)
    g.route(10, True, 3)  # rejoined at 10: work routed at 8 or 9 (when it was out) is refused
    assert g.refusal(Ticket(9), 3) == EPOCH and g.refusal(Ticket(10), 3) is None
    g.admit(Ticket(9), 3)
    g.admit(Ticket(10), 3)
    assert g.counters()["refused"] == {EPOCH: 1} and g.admitted == 1


def test_recent_results_are_bounded():
    r = RecentResults(size=3)
    for i in range(5):
        r.put(f"id{i}", i)
    assert len(r) == 3 and r.get("id0") is None and r.get("id4") == 4


# ------------------------------------------------------------------ the shard, in-process over NullBackend
class CountingBackend(NullBackend):
    def __init__(self, config=None, delay: float = 0.0) -> None:
        super().__init__(config)
        self.runs: Counter[str] = Counter()
        self.aborted: list[str] = []
        self.delay = delay
        self.release = asyncio.Event()

    async def generate(self, prompt_token_ids, sampling, request_id, cache_salt=None):
        self.runs[request_id] += 1
        if self.delay:
            try:
                await asyncio.wait_for(self.release.wait(), self.delay)
            except asyncio.TimeoutError:
                pass
        if request_id in self.aborted:
            from rlfleet.fleet.types import Completion

            return [Completion((), (), "abort")]
        return await super().generate(prompt_token_ids, sampling, request_id, cache_salt)

    async def abort(self, request_ids):
        self.aborted += list(request_ids)
        self.release.set()


def shard_with(backend: CountingBackend, tmp_path) -> EngineShard:
    (tmp_path / "config.json").write_text("{}")
    return EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1, backend_factory=lambda cfg: backend)


def test_a_refused_request_never_reaches_the_engine(tmp_path):
    async def go():
        b = CountingBackend()
        shard = shard_with(b, tmp_path)
        await shard.start()
        with pytest.raises(RouteRefused) as err:
            await shard.generate([1, 2], {}, "r1", ticket=Ticket(1))
        assert err.value.reason == NOT_MEMBER and "not in the serving set" in str(err.value)
        shard.set_route(4, True, 0)
        with pytest.raises(RouteRefused) as err:
            await shard.generate([1, 2], {}, "r2", ticket=Ticket(3))
        assert err.value.reason == EPOCH
        await shard.pause()
        with pytest.raises(RouteRefused) as err:
            await shard.generate([1, 2], {}, "r3", ticket=Ticket(4))
        assert err.value.reason == PAUSED
        await shard.resume()
        ok = await shard.generate([1, 2], {}, "r4", ticket=Ticket(4))
        assert ok.completions and b.runs == {"r4": 1}
        c = shard.counters()
        assert c.refused == {NOT_MEMBER: 1, EPOCH: 1, PAUSED: 1} and c.admitted == 1
        # the error survives pickling with its reason (it crosses the Ray boundary)
        import pickle

        again = pickle.loads(pickle.dumps(err.value))
        assert isinstance(again, RouteRefused) and again.reason == PAUSED

    asyncio.run(go())


def test_a_shard_refuses_a_second_request_an_engine_died_under_naming_the_first_and_admits_it_once_that_ended(tmp_path):
    """The data plane's request says whether an engine died under it before (``ServeRequest.suspect``): the shard
    holds one such request at a time (``fleet.data.poison``), whichever client sends it, and ordinary ones beside."""
    from rlfleet.fleet.shard.request_gate import SUSPECT

    from rlfleet.fleet.wire import ServeRequest

    def packed(rid: str, suspect: bool) -> bytes:
        return ServeRequest([1, 2], {"max_tokens": 2}, rid, None, 4, "any", 0, None, False, 0.0, None,
                            int(suspect)).encode()

    async def go():
        b = CountingBackend(delay=5.0)
        shard = shard_with(b, tmp_path)
        await shard.start()
        shard.set_route(4, True, 0)
        first = asyncio.ensure_future(shard.serve(packed("a-7", True)))
        await asyncio.sleep(0.01)
        with pytest.raises(RouteRefused) as err:
            await shard.serve(packed("b-3", True))
        assert err.value.reason == SUSPECT and "a-7" in str(err.value) and "b-3" in str(err.value), err.value
        plain = asyncio.ensure_future(shard.serve(packed("b-4", False)))
        await asyncio.sleep(0.01)
        b.release.set()
        assert (await first).completions and (await plain).completions
        assert (await shard.serve(packed("b-3", True))).completions  # the first one ended: admitted
        assert b.runs == {"a-7": 1, "b-4": 1, "b-3": 1} and shard.counters().refused == {SUSPECT: 1}

    asyncio.run(go())


def test_a_resent_request_id_never_runs_twice(tmp_path):
    async def go():
        b = CountingBackend(delay=0.2)
        shard = shard_with(b, tmp_path)
        await shard.start()
        first, second = await asyncio.gather(shard.generate([1], {}, "same"), shard.generate([1], {}, "same"))
        assert first is second and b.runs == {"same": 1}  # the second joined the running call
        third = await shard.generate([1], {}, "same")
        assert third is first and b.runs == {"same": 1} and shard.deduplicated == 2

    asyncio.run(go())


def test_begin_refit_aborts_only_what_the_policy_forbids(tmp_path):
    async def go():
        b = CountingBackend(delay=5.0)
        shard = shard_with(b, tmp_path)
        await shard.start()
        shard.set_route(1, True, 0)
        latest = asyncio.ensure_future(shard.generate([1], {}, "latest", ticket=Ticket(1, VersionPolicy(LATEST))))
        anyv = asyncio.ensure_future(shard.generate([1], {}, "any", ticket=Ticket(1, VersionPolicy(ANY))))
        await asyncio.sleep(0.05)
        out = await shard.begin_refit(2, 1)
        assert out == BeginRefit(aborted=1, in_flight=1) and b.aborted == ["latest"]
        assert (await latest).aborted
        assert shard.gate.floor == 2
        b.release.set()
        assert not (await anyv).aborted

    asyncio.run(go())


def test_a_latest_request_that_finishes_on_newer_weights_is_returned_as_aborted(tmp_path):
    async def go():
        b = CountingBackend(delay=5.0)
        shard = shard_with(b, tmp_path)
        await shard.start()
        shard.set_route(1, True, 0)
        latest = asyncio.ensure_future(shard.generate([1], {}, "l", ticket=Ticket(1, VersionPolicy(LATEST))))
        anyv = asyncio.ensure_future(shard.generate([1], {}, "a", ticket=Ticket(1, VersionPolicy(ANY))))
        await asyncio.sleep(0.05)
        await shard.set_weight_version(1)  # as if begin_refit's abort had missed it
        b.release.set()
        r = await latest
        assert r.aborted and shard.gate.refused["version_at_finish"] == 1
        assert not (await anyv).aborted
        assert shard._recent.get("l") is None  # a re-send runs it again

    asyncio.run(go())


# ------------------------------------------------------------------ power of two choices
def test_pick_two_only_members_with_room_and_the_less_loaded():
    small = [Member(s, 1, None) for s in range(3)]
    assert {pick_two(small, {0: 1, 1: 0, 2: 1}, {}, random.Random(s)).slot for s in range(20)} == {1}  # full scan
    members = [Member(s, 1, None) for s in range(6)]
    rng = random.Random(0)
    full = {s: 2 for s in range(6)}
    assert pick_two(members, full, full, rng) is None
    assert pick_two(members, {s: 2 for s in range(5)}, full, rng).slot == 5
    load = {0: 0, 1: 5, 2: 5, 3: 5, 4: 5, 5: 5}
    picks = Counter(pick_two(members, load, {}, rng).slot for _ in range(1500))
    # slot 0 wins every draw it is in (a third of all pairs); the others split the rest
    assert 400 < picks[0] < 600 and set(picks) == set(range(6))
    a = [pick_two(members, {}, {}, random.Random(7)).slot for _ in range(5)]
    assert len(set(a)) == 1  # seeded: reproducible


# ------------------------------------------------------------------ the controller publishes, clients follow
def test_routing_state_is_published_with_a_new_epoch_per_change(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        s0 = ctl.publisher.current
        assert s0.gate_open and [m.slot for m in s0.members] == [0, 1, 2] and s0.version == 0
        assert all(sh.gate.member for sh in door.shards.values())  # members were told before clients saw them
        assert (await ctl.watch_routing(s0.epoch, 0.5)).epoch == s0.epoch  # no change: the same state after the wait
        waiter = asyncio.ensure_future(ctl.watch_routing(s0.epoch, 60))
        await ctl.sync_weights(1)
        s1 = await waiter
        assert s1.epoch > s0.epoch  # the long poll answered on the first change (the gate closing)
        s2 = ctl.publisher.current
        assert s2.gate_open and s2.version == 1 and s2.epoch > s1.epoch
        closes = [e for e in Routing.among(ctl.log.records()) if not e.gate_open]
        assert closes and all(door.shards[(s, 1)].gate.floor >= closes[-1].epoch for s in range(3))

    run(go())


def test_a_closed_gate_is_seen_at_once_and_requests_wait(model_dir):
    async def go():
        # restarts held back: at version 0 a restarted engine would serve (and reopen the gate) at once
        ctl, door, _ = make(model_dir, request_timeout_s=3600, restart_backoff_s=60.0, restart_backoff_cap_s=60.0)
        await ctl.start()
        before = len(ctl.log.records())
        for slot in (1, 2):
            ctl.observe(slot, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("killed")))
        assert not ctl.publisher.current.gate_open  # published without waiting for any shard
        waiting = asyncio.ensure_future(client(ctl).generate([1]))
        await asyncio.sleep(5)
        assert not waiting.done()
        closed = next(e.epoch for e in Routing.among(ctl.log.records()[before:]) if not e.gate_open)
        assert door.shards[(0, 1)].gate.floor == closed  # the survivor was fenced at the close
        waiting.cancel()

    run(go())


def test_a_client_timeout_during_a_refit_is_not_a_sick_shard(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        await ctl.start()
        epoch = ctl.publisher.current.epoch
        await ctl.sync_weights(1)
        # a request routed before the refit timed out while the shard was paused: ignored
        assert ctl.report_failure(0, 1, TIMED_OUT, "timed out", epoch) is False
        assert ctl.ledger.state(0).value == "healthy"
        assert any(e.slot == 0 for e in ReportIgnored.among(ctl.log.records()))
        # the same timeout on a request routed after the refit is a health observation
        assert ctl.report_failure(0, 1, TIMED_OUT, "timed out", ctl.publisher.current.epoch) is True
        assert ctl.ledger.state(0).value != "healthy"

    run(go())


def test_a_restarted_shard_rejoins_routing_as_soon_as_it_serves_the_committed_version(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, readmit=False)  # the refit path; re-admission: test_readmission
        await ctl.start()
        await ctl.sync_weights(1)  # past the checkpoint: a restarted engine (on version 0) is stale
        ctl.observe(2, 1, CallKind.GENERATE, Outcome(DIED, error=RuntimeError("killed")))
        await asyncio.sleep(0.001)  # the next loop turn publishes it
        assert (2, 1) not in {(m.slot, m.incarnation) for m in ctl.publisher.current.members}
        await asyncio.sleep(1)  # virtual: incarnation 2 is up, stale until a refit lands on it
        assert ctl.ledger.state(2).value == "stale" and not door.shards[(2, 2)].gate.member
        await ctl.sync_weights(2)
        # the moment sync_weights returns, the published state routes to it, and it was told first
        assert (2, 2) in {(m.slot, m.incarnation) for m in ctl.publisher.current.members}
        assert door.shards[(2, 2)].gate.member
        res = [await client(ctl).generate([1]) for _ in range(12)]
        assert any(r.result.slot == 2 and r.result.incarnation == 2 and r.result.weight_version == 2 for r in res)

    run(go())


def test_the_client_reroutes_a_refusal_for_free_and_resends_after_a_death(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, max_redispatch=1)
        await ctl.start()
        door.shards[(0, 1)].gate.paused = True  # a shard that refuses everything (as if paused)
        door.shards[(1, 1)].script["generate"] = "die"  # and one that dies on its next request
        res = [await client(ctl).generate([1]) for _ in range(12)]
        assert all(r.ok for r in res)  # every request ended on a shard that could serve it
        assert all(r.result.slot != 0 for r in res)
        d = client(ctl).dispatcher
        assert d.refused.get("paused", 0) >= 1 and d.requeued >= 1
        assert door.shards[(0, 1)].gate.refused["paused"] == d.refused["paused"]  # nothing ran on the paused shard
        # the client's report of the death reached the controller (its replacement may serve already)
        assert any(e.slot == 1 and e.incarnation == 1 and e.after == "dead" for e in Health.among(ctl.log.records()))
        assert all(r.attempts <= 2 for r in res)  # refusals do not spend the redispatch budget

    run(go())


def test_a_request_whose_own_timeout_passes_while_it_generates_is_aborted_without_blaming_its_shard(model_dir):
    """``request_timeout_s`` shorter than a generation: the request came back after a re-send as "no serving
    shard within the request timeout", its healthy shard excluded and reported failed (then probed). The
    time ran out, nothing failed: it is returned saying so and aborted on the shard, which stays healthy."""

    async def go():
        ctl, door, _ = make(model_dir, request_timeout_s=2.0)
        door.gen_delay = 10.0
        untimed = door.call

        async def call(handle, method, *args, timeout, **kw):  # a call's deadline, as Ray's door keeps it
            try:
                return await asyncio.wait_for(untimed(handle, method, *args, timeout=timeout, **kw), timeout)
            except asyncio.TimeoutError:
                return Outcome(TIMED_OUT, error=TimeoutError(f"{method} timed out"))

        door.call = call
        await ctl.start()
        c = client(ctl)
        res = await c.generate_async([1, 2, 3], {"max_tokens": 4})
        assert not res.ok and res.attempts == 1, res
        assert res.reason.startswith("request timeout (2 s) passed while slot") and "aborted there" in res.reason
        await asyncio.sleep(0.1)
        assert [m for m, _, _ in door.calls].count("abort") == 1
        assert not any(s.in_flight for s in door.shards.values())  # the engine stopped spending on it
        assert {ctl.ledger.state(s).value for s in range(3)} == {"healthy"}
        assert c.counters()["requeued"] == 0 and c.dispatcher.returned_reasons[res.reason] == 1
        await ctl.shutdown()

    run(go())


# ------------------------------------------------------------------ the cap is the shard's (hole 5)
def test_the_gate_refuses_full_at_the_newest_published_cap():
    from rlfleet.fleet.shard.request_gate import FULL

    g = member_gate(epoch=3)
    assert g.admit(Ticket(3, cap=2), 2, in_flight=0) is None
    assert g.admit(Ticket(3, cap=2), 2, in_flight=1) is None
    assert g.admit(Ticket(3, cap=2), 2, in_flight=2) == FULL  # at its cap: whoever routed it
    assert g.admit(Ticket(4, cap=3), 2, in_flight=2) is None  # a newer state grew the cap
    assert g.admit(Ticket(3, cap=9), 2, in_flight=3) == FULL  # an older state's cap does not win
    assert g.admit(None, 2, in_flight=50) is None  # an operator's direct call carries no cap
    c = g.counters()
    assert c["cap"] == 3 and c["peak_in_flight"] == 51 and c["refused"] == {FULL: 2}


def test_two_clients_never_push_a_shard_past_its_cap_and_full_is_a_free_reroute(model_dir):
    """Two clients, each within the published cap by its own count, flood one fleet: each shard refuses
    past its cap (``full``), the clients re-route with no error and no health report, nothing is lost."""
    from rlfleet.fleet.data.client import InProcessClient

    async def go():
        ctl, door, _ = make(model_dir, admission={"ceiling": 2, "enabled": False}, request_timeout_s=600)
        door.gen_delay = 0.5
        await ctl.start()
        assert ctl.publisher.current.cap_map == {0: 2, 1: 2, 2: 2}
        peak: Counter = Counter()
        untimed = door._generate

        async def generate(s, *args, **kw):
            task = asyncio.ensure_future(untimed(s, *args, **kw))
            await asyncio.sleep(0)  # admitted (or refused) by now
            peak[s.slot] = max(peak[s.slot], len(s.in_flight))
            return await task

        door._generate = generate
        clients = [InProcessClient(ctl, rng=random.Random(i)) for i in range(2)]
        res = await asyncio.gather(*(c.dispatcher.submit([1, 2], request_id=f"c{i}-{j}")
                                     for i, c in enumerate(clients) for j in range(20)))
        assert all(r.ok for r in res) and len(res) == 40
        assert max(peak.values()) == 2, peak  # never more than the cap on any shard
        full = sum(c.dispatcher.refused.get("full", 0) for c in clients)
        assert full > 0  # each client alone would have sent 6 at once: the shards turned the excess away
        assert [c.dispatcher.requeued for c in clients] == [0, 0]  # a refusal is no failure
        assert {ctl.ledger.state(s).value for s in range(3)} == {"healthy"}
        assert all(r.attempts == 1 for r in res)
        counters = await ctl.shard_counters()
        assert all(c["cap"] == 2 and c["peak_in_flight"] == 2 for c in counters.values()), counters
        await ctl.shutdown()

    run(go())
