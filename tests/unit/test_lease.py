"""A shard's lease on its routing state (``fleet.shard.lease``, issue 47): a shard cut off from the controller, still
reached by a lagging client, stopped serving requests bound to a version (``latest``, ``max_staleness``) from weights
a refit elsewhere replaced. Its committed version, floor and membership never changed once the controller's words
stopped reaching it.

- the lease alone, on a hand-moved clock: never granted, never lapses; a term passes with no word, it lapses; any
  word renews it; a bad term is refused naming it;
- the shard's gate: a lapsed lease refuses ``latest`` and ``max_staleness=k`` (``unheard``), never ``any`` or an
  operator's untagged call; ``set_route``, ``fence`` and ``heard`` renew it;
- a fleet in virtual time (the controller over the unit fakes): the monitor's heartbeat keeps every lease of a
  healthy fleet for many terms; a shard cut off from the controller, evicted (its kill cannot reach it) while a
  refit commits on the others, refuses a lagging client's ``latest`` requests once its lease lapsed, and the client
  sends them to another shard: each completes on the committed version, none is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from rlfleet.fleet.data.dispatch import Dispatcher
from rlfleet.fleet.data.routing_state import ANY, LATEST, MAX_STALENESS, Ticket, VersionPolicy
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.shard.lease import RoutingLease
from rlfleet.fleet.shard.request_gate import UNHEARD, ShardGate
from tests.unit.fleet_fakes import LoopClock, StateView, client
from tests.unit.test_controller import make, run


class HandClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------ the lease
def test_a_lease_lapses_once_its_term_passes_with_no_word_and_any_word_renews_it():
    clock = HandClock()
    lease = RoutingLease(clock)
    clock.t += 1e6
    assert not lease.lapsed() and lease.silent_s() is None  # never granted: a shard driven by hand never lapses
    lease.renew(30.0)  # the controller's word, granting a 30 s term
    clock.t += 30.0
    assert not lease.lapsed() and lease.silent_s() == 30.0  # at the term, still good
    clock.t += 0.5
    assert lease.lapsed() and lease.lapsed() and lease.lapses == 1  # counted once per lapse
    assert "nothing heard from the controller for 30.5 s, past its lease on the routing state (30 s)" in lease.describe()
    lease.renew()  # a later word keeps the term
    assert not lease.lapsed() and lease.term_s == 30.0
    clock.t += 31.0
    assert lease.lapsed() and lease.facts() == {"term_s": 30.0, "silent_s": 31.0, "lapsed": True, "lapses": 2}


@pytest.mark.parametrize("term", [0, -1.0, float("inf"), float("nan"), True, "30"])
def test_a_lease_term_that_is_not_a_finite_number_of_seconds_is_refused_naming_it(term):
    with pytest.raises(ValueError, match="term_s"):
        RoutingLease(HandClock()).renew(term)


# ------------------------------------------------------------------ the shard's gate
def test_a_lapsed_lease_refuses_work_bound_to_a_version_and_runs_the_rest():
    clock = HandClock()
    gate = ShardGate(RoutingLease(clock))
    gate.route(3, True, 2, lease_s=10.0)
    latest, stale, anything = (Ticket(3, VersionPolicy(LATEST)), Ticket(3, VersionPolicy(MAX_STALENESS, 5)),
                               Ticket(3, VersionPolicy(ANY)))
    assert [gate.refusal(t, 2) for t in (latest, stale, anything)] == [None, None, None]
    clock.t += 10.5
    assert [gate.admit(t, 2) for t in (latest, stale, anything)] == [UNHEARD, UNHEARD, None]
    assert gate.admit(None, 2) is None  # an operator's direct call carries no policy
    assert gate.counters()["refused"] == {UNHEARD: 2} and gate.counters()["lease"]["lapsed"]
    assert "policy latest is bound to it" in gate.detail(UNHEARD, latest, 2, 0, ())
    for word in (lambda: gate.heard(), lambda: gate.fence(4), lambda: gate.route(2, True, 2)):  # an old epoch too
        clock.t += 10.5
        assert gate.refusal(Ticket(4, VersionPolicy(LATEST)), 2) == UNHEARD
        word()
        assert gate.refusal(Ticket(4, VersionPolicy(LATEST)), 2) is None


def test_every_request_policy_but_any_is_bound_to_a_version():
    assert VersionPolicy(LATEST).bound and VersionPolicy(MAX_STALENESS, 0).bound
    assert VersionPolicy(MAX_STALENESS, 1000).bound  # any number of refits may have committed unheard
    assert not VersionPolicy(ANY).bound


# ------------------------------------------------------------------ the real shard, in virtual time
def test_the_engine_shard_refuses_latest_once_its_lease_lapses_and_every_controller_word_renews_it(model_dir):
    """``EngineShard`` over the null backend, its clock the virtual loop's: the lease ``set_route`` granted lapses
    after its term with no word; a ``latest`` request is then refused (``RouteRefused``, ``unheard``, naming the
    silence and the term) without reaching the engine, an ``any`` one runs; the monitor's ``ping`` with the
    routing epoch, a ``fence``, a refit's ``begin_refit`` and ``end_refit`` each renew it. A ping without the epoch
    (a probe by hand) does not."""
    from rlfleet.fleet.errors import RouteRefused
    from rlfleet.fleet.shard.engine_shard import EngineShard
    from rlfleet.sim.clock import run_virtual

    async def go():
        shard = EngineShard({"model": model_dir, "backend": "null"}, 0, 1)
        shard._now = asyncio.get_running_loop().time  # the shard's clock (its progress watch's too)
        await shard.start()
        shard.set_route(3, True, 0, 10.0)
        latest = Ticket(3, VersionPolicy(LATEST))
        assert (await shard.generate([1, 2], {}, "r1", ticket=latest)).weight_version == 0
        await asyncio.sleep(10.5)
        await shard.ping()  # no epoch: not the controller's heartbeat
        with pytest.raises(RouteRefused) as err:
            await shard.generate([1, 2], {}, "r2", ticket=latest)
        assert err.value.reason == UNHEARD, err.value
        assert "nothing heard from the controller for 10.5 s, past its lease on the routing state (10 s)" in str(err.value)
        assert (await shard.generate([1, 2], {}, "r3", ticket=Ticket(3, VersionPolicy(ANY)))).completions
        renewed = []
        for word in (lambda: shard.ping(3), lambda: shard.fence(3), lambda: shard.begin_refit(4, 1),
                     lambda: shard.end_refit(1)):
            assert shard.gate.lease.lapsed()
            answer = word()
            if asyncio.iscoroutine(answer):
                await answer
            renewed.append(not shard.gate.lease.lapsed())
            await asyncio.sleep(10.5)
        counters = shard.counters()
        await shard.shutdown()
        return renewed, counters

    renewed, counters = run_virtual(go())
    assert renewed == [True, True, True, True]
    assert counters.refused == {UNHEARD: 1} and counters.admitted == 2


# ------------------------------------------------------------------ a fleet in virtual time
class LaggingView(StateView):
    """A client that routes by an old routing state until a shard's refusal makes it ask for a newer one, then
    follows the controller (``FleetClient`` whose long poll lags)."""

    def __init__(self, ctl, state) -> None:
        super().__init__(ctl.door, state, VersionPolicy(LATEST))
        self._ctl = ctl

    async def newer_routing(self, epoch, timeout):
        self.state = self._ctl.publisher.current
        return self.state


def test_a_shard_cut_off_from_the_controller_stops_serving_latest_once_its_lease_lapses_and_nothing_is_lost(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, request_timeout_s=600.0)
        await ctl.start()
        term = ctl.cfg.routing_lease_s
        assert term == ctl.cfg.controller_restart_wait_s + ctl.cfg.monitor_interval_s + ctl.cfg.probe_timeout_s
        old = ctl.publisher.current  # what a lagging client keeps routing by: slots 0, 1, 2 serve version 0
        leases = [door.shards[(s, 1)].gate.lease for s in range(3)]
        assert {lease.term_s for lease in leases} == {term}  # granted with the word that made them members

        await asyncio.sleep(3 * term)  # a healthy fleet, quiet: the monitor's pings are the heartbeat
        assert not any(lease.lapsed() for lease in leases)
        healthy = [await client(ctl).generate([1], policy=VersionPolicy(LATEST)) for _ in range(6)]

        door.cut_off.add((0, 1))  # the controller cannot reach slot 0 (nor kill it); a lagging client can
        for _ in range(100):
            await asyncio.sleep(0.5)
            if ctl.slots.handles[0][0] == 2 and ctl.gate.is_open:
                break
        assert ctl.slots.handles[0][0] == 2, "slot 0 was not replaced"  # evicted, restarted as incarnation 2
        await ctl.sync_weights(1)  # committed on the others: slot 0's first incarnation still holds version 0
        await asyncio.sleep(term)  # past its lease

        lagging = []
        for seed in range(8):  # each a client that still routes by the old state
            d = Dispatcher(LaggingView(ctl, old), EventLog(), 600.0, 3, LoopClock(), rng=random.Random(seed))
            lagging.append((await d.submit([1], policy=VersionPolicy(LATEST)), d))
        only_slot0 = dataclasses.replace(old, members=tuple(m for m in old.members if m.slot == 0))
        d_any = Dispatcher(StateView(door, only_slot0, VersionPolicy(ANY)), EventLog(), 600.0, 3, LoopClock())
        anything = await d_any.submit([1])  # any weights meet ``any``: the cut-off shard still serves it
        cut = door.shards[(0, 1)]
        await ctl.shutdown()
        return healthy, lagging, anything, cut

    healthy, lagging, anything, cut = run(go())
    assert all(r.ok for r in healthy) and {r.result.slot for r in healthy} == {0, 1, 2}
    results = [r for r, _ in lagging]
    assert all(r.ok for r in results), [r.reason for r in results]  # nothing lost
    # every one ran on the committed version, none on the cut-off shard's old weights
    assert {(r.result.weight_version, r.result.version_start) for r in results} == {(1, 1)}
    assert not any((r.result.slot, r.result.incarnation) == (0, 1) for r in results)
    refused = sum(d.refused.get(UNHEARD, 0) for _, d in lagging)
    assert refused > 0 and cut.gate.refused[UNHEARD] == refused  # some went there first: refused, sent elsewhere
    assert sum(d.requeued for _, d in lagging) == 0  # a refusal is no failure: nothing re-sent, nothing reported
    assert anything.ok and (anything.result.slot, anything.result.incarnation, anything.result.weight_version) == (0, 1, 0)
