"""A ``FleetClient`` rides through an outage of its controller (no Ray: a fake door, real threads).

The controller restarts (Ray restarts its actor; the new one re-adopts the shards and
publishes higher epochs). Meanwhile calls to it fail ``unavailable`` (or ``died``), and
the client must keep serving on the last routing state it holds:

- requests go on completing on that state's shards, counted as ``completed_while_down``;
  once the controller answers again the client adopts its newer state and logs
  ``controller_back`` with how long it was down;
- only a controller silent for ``controller_restart_wait_s`` is gone: the client then
  stops and returns its held requests (none lost);
- a failure report the controller cannot take (or a door that raises on it) changes
  nothing: the request is re-sent elsewhere and no task exception is left behind.
"""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import asyncio

import pytest

from rlfleet.fleet.data.client import FleetClient
from rlfleet.fleet.outcome import DIED, OK, UNAVAILABLE, Outcome
from rlfleet.fleet.records import ControllerBack, ControllerGone, ControllerUnreachable, Record
from rlfleet.fleet.data.routing_state import Member, RoutingState
from tests.unit.fleet_fakes import ActorDiedError, FakeDoor

ANSWER = "answer"


class FakeController:
    """The controller's handle: the door recognises it and answers for it."""


class ControllerDoor(FakeDoor):
    """``FakeDoor`` for the shards, plus a controller that answers ``watch_routing`` with ``state``
    while ``mode`` is ``answer`` and otherwise fails every call as ``mode`` says (``unavailable``:
    restarting; ``died``). A poll pending when it goes down fails at once, as Ray fails calls
    to an actor whose process died. ``report_mode`` scripts ``report_failure`` alone (``raise``: the
    door itself raises, which a real door never does)."""

    def __init__(self) -> None:
        super().__init__(gen_delay=0.02)
        self.ctl = FakeController()
        self.mode = ANSWER
        self.report_mode = ANSWER
        self.state: RoutingState | None = None
        self.polls = 0
        self.reports: list[tuple] = []

    def down(self) -> Outcome:
        if self.mode == DIED:
            return Outcome(DIED, error=ActorDiedError("the controller's process died"))
        return Outcome(UNAVAILABLE, error=ConnectionError("the controller is restarting"))

    async def call(self, handle, method, *args, timeout: float, **kw) -> Outcome:
        if handle is not self.ctl:
            return await super().call(handle, method, *args, timeout=timeout, **kw)
        if method == "report_failure":
            self.reports.append(args)
            if self.report_mode == "raise":
                raise RuntimeError("the door broke")
            return self.down() if self.report_mode != ANSWER else Outcome(OK, value=True)
        assert method == "watch_routing"
        self.polls += 1
        after, wait = args
        until = time.monotonic() + min(wait, timeout)
        while self.mode == ANSWER and self.state.epoch <= after and time.monotonic() < until:
            await asyncio.sleep(0.005)
        return Outcome(OK, value=self.state) if self.mode == ANSWER else self.down()


def config(**kw) -> SimpleNamespace:
    return SimpleNamespace(max_staleness=None, kv_policy="none", request_timeout_s=30.0, max_redispatch=3,
                           poison_window_s=600.0, event_log_path=None, continuation=True,
                           stream_interval_s=0.05, hold_interval_s=0.25, stream_min_tokens=32, data_link=False, **kw)


def fleet_of(door: ControllerDoor, epoch: int, slots=(0, 1), gate_open: bool = True) -> RoutingState:
    """The controller's published state at ``epoch``: ``slots`` serve (their gates told first)."""
    members = []
    for slot in slots:
        shard = door.shards.get((slot, 1)) or door.spawn_shard(None, slot, 1)
        shard.gate.route(epoch, True, 0)
        members.append(Member(slot, 1, shard))
    return RoutingState(epoch, gate_open, 0, tuple(members))


def wait_until(what, timeout: float = 3.0) -> None:
    until = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < until, "timed out waiting"
        time.sleep(0.005)


def events(client: FleetClient, kind: type[Record]) -> list:
    return kind.among(client.events())


@pytest.fixture
def door():
    return ControllerDoor()


@pytest.fixture
def make_client(door):
    made = []

    def make(cfg) -> FleetClient:
        c = FleetClient(door.ctl, cfg, door=door, name="t")
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("down_as", [UNAVAILABLE, DIED])
def test_requests_keep_completing_on_the_last_state_while_the_controller_restarts(door, make_client, down_as):
    door.state = fleet_of(door, 1)
    client = make_client(config())  # no controller_restart_wait_s: the default (60 s)
    assert client.wait_routing(-1, 5).epoch == 1
    door.mode = down_as  # the controller's process dies; Ray restarts it
    wait_until(lambda: client.controller_outage()["unreachable_since"] is not None)
    down_at = time.monotonic()
    results = []
    while time.monotonic() - down_at < 1.5:
        results += client.submit([1, 2], n=2).result(5)
        assert client.routing().epoch == 1 and client.routing().stopped is None  # still routing on the last state
    assert results and all(r.ok for r in results)
    assert {r.result.slot for r in results} <= {0, 1}
    polls_while_down = door.polls
    out = client.controller_outage()
    assert out["completed_while_down"] == len(results) and out["outages"] == 1
    # the restarted controller re-adopted the shards and publishes a higher epoch
    door.state = fleet_of(door, 7, slots=(1,))
    door.mode = ANSWER
    assert client.wait_routing(1, 5).epoch == 7
    back = events(client, ControllerBack)
    assert len(back) == 1 and back[0].down_s >= 1.4
    (gone,) = events(client, ControllerUnreachable)
    assert gone.outcome == down_as and gone.t <= back[0].t
    assert 4 <= polls_while_down <= 40  # it kept asking, with a backoff (0.2 s doubling), not a spin
    later = client.submit([1], n=3).result(5)
    assert all(r.ok and r.result.slot == 1 for r in later)
    out = client.controller_outage()
    assert out["unreachable_since"] is None and out["down_s_total"] >= 1.4
    assert out["completed_while_down"] == len(results)  # nothing counted once it was back
    assert client.counters()["accepted"] == client.counters()["completed"] == len(results) + 3


def test_a_controller_gone_longer_than_the_restart_wait_stops_the_client_and_returns_held_requests(door, make_client):
    door.state = fleet_of(door, 1, gate_open=False)  # a refit under way: requests are held
    client = make_client(config(controller_restart_wait_s=1.0))
    assert client.wait_routing(-1, 5).epoch == 1
    held = [client.submit([1], n=2) for _ in range(3)]
    time.sleep(0.05)
    door.mode = DIED  # and it never answers again
    wait_until(lambda: client.controller_outage()["unreachable_since"] is not None)
    time.sleep(0.3)
    assert client.routing().stopped is None and not any(f.done() for f in held)  # still waiting for it
    results = [r for f in held for r in f.result(5)]
    assert all(not r.ok and "the fleet's controller is gone" in r.reason for r in results)
    state = client.routing()
    assert state.stopped and "died" in state.stopped and state.epoch == 2
    (gone,) = events(client, ControllerGone)
    assert 1.0 <= gone.down_s < 3.0
    c = client.counters()
    assert c["accepted"] == 6 == c["completed"] + c["returned"] and c["in_progress"] == 0
    polls = door.polls
    time.sleep(0.3)
    assert door.polls <= polls + 1  # after giving up it asks only at the slow rate (5 s), not a spin


@pytest.mark.parametrize("epoch_back", [1, 9])
def test_a_client_that_gave_up_follows_the_controller_again_when_it_answers(door, make_client, monkeypatch,
                                                                               epoch_back):
    """Giving up is not for good: it keeps asking at a slow rate and adopts the controller's state when it
    answers, a restarted one's higher epoch (9) or the same controller's own epoch (1: it was only slow)."""
    import rlfleet.fleet.data.client as client_mod

    monkeypatch.setattr(client_mod, "RETRY_GAVE_UP_S", 0.1)
    door.state = fleet_of(door, 1)
    client = make_client(config(controller_restart_wait_s=0.5))
    assert client.wait_routing(-1, 5).epoch == 1
    door.mode = UNAVAILABLE
    wait_until(lambda: client.routing().stopped is not None)
    (gone,) = events(client, ControllerGone)
    assert not client.submit([1], n=1).result(5)[0].ok  # given up: requests come back at once, none lost
    door.state = fleet_of(door, epoch_back)
    door.mode = ANSWER
    wait_until(lambda: client.routing().stopped is None)
    assert client.routing().epoch == epoch_back and client.routing().gate_open
    back = events(client, ControllerBack)
    assert len(back) == 1 and back[0].t >= gone.t and back[0].after_giving_up
    assert all(r.ok for r in client.submit([1, 2], n=3).result(5))
    door.state = fleet_of(door, epoch_back + 1, slots=(1,))  # and it follows the long poll as before
    assert client.wait_routing(epoch_back, 5).epoch == epoch_back + 1


def test_a_failure_report_the_controller_cannot_take_changes_nothing_and_leaves_no_task_exception(door, make_client):
    door.state = fleet_of(door, 1)
    door.shards[(0, 1)].sticky["generate"] = "error"  # every request sent to slot 0 fails there
    client = make_client(config())
    assert client.wait_routing(-1, 5).epoch == 1
    problems: list[dict] = []
    client._loop.set_exception_handler(lambda loop, context: problems.append(context))
    door.report_mode = "raise"
    results = []
    for _ in range(40):  # until one request landed on slot 0 (each does with probability 1/2)
        results += client.submit([1], n=1).result(5)
        if door.reports:
            break
    door.report_mode = UNAVAILABLE
    # a report the controller does not take (it is restarting): nothing else happens
    client._loop.call_soon_threadsafe(client.report, 0, 1, Outcome(DIED, error=ActorDiedError("gone")), 1)
    wait_until(lambda: len(door.reports) == 2 and not getattr(client, "_reports", ()))
    time.sleep(0.05)
    gc.collect()  # an exception nobody retrieved is reported when its task is collected
    time.sleep(0.05)
    assert problems == []
    assert all(r.ok and r.result.slot == 1 for r in results[-1:])  # re-sent to the other shard
    assert client.counters()["requeued"] == 1
    assert client.routing().stopped is None and client.controller_outage()["outages"] == 0
