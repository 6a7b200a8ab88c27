"""One client's plain ``serve`` calls for one shard, ready at once, go as one ``serve_many`` (``fleet.data.batch``).

Each request must get back exactly the ``Outcome`` its own call would have come to: its result, the shard's
refusal or error for it alone, the whole call's failure when the shard died, its own deadline. A scripted
door stands in for the shards; ``tests/integration/test_trl.py`` sends TRL's batched completions through
``EngineShard.serve_many`` on real engines.
"""

from __future__ import annotations

import asyncio
import random

from rlfleet.fleet.data.batch import ServeBatcher
from rlfleet.fleet.data.dispatch import Dispatcher
from rlfleet.fleet.data.routing_state import Member, RoutingState
from rlfleet.fleet.errors import BadRequestError, DeadlineExceeded, RouteRefused
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.outcome import DIED, ERROR, OK, TIMED_OUT, Outcome
from rlfleet.fleet.types import Completion, GenerationResult
from rlfleet.fleet.wire import ServeRequest, decode_request
from tests.unit.fleet_fakes import StateView


def request(rid: str, prompt=(1, 2, 3)) -> bytes:
    """``EngineShard.serve``'s request on the wire (only the prompt and the id matter to the scripted door)."""
    return ServeRequest(list(prompt), {"max_tokens": 2}, rid, None, 1, "any", 0, None, False, 0.25, None, 0).encode()


class ScriptedDoor:
    """Answers ``serve`` and ``serve_many`` after ``delay`` s: each request its result, or what ``fail`` scripts
    for its id (an exception the shard raises for that request alone, once); ``whole``: the call fails as a whole."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self.calls: list[tuple[str, object, list[str]]] = []
        self.fail: dict[str, BaseException] = {}
        self.whole: Outcome | None = None

    def result(self, handle, req: bytes) -> GenerationResult | BaseException:
        r = decode_request(req)
        rid = r.request_id
        if rid in self.fail:
            return self.fail.pop(rid)  # once: a request sent again is served
        return GenerationResult(rid, tuple(r.prompt), (Completion((7,), (-0.1,), "length"),), 0, 0, handle, 1)

    async def call(self, handle, method, *args, timeout):
        reqs = args[0] if method == "serve_many" else [args[0]]
        self.calls.append((method, handle, [decode_request(r).request_id for r in reqs]))
        await asyncio.sleep(self.delay)
        if self.whole is not None:
            return self.whole
        if method == "serve":
            got = self.result(handle, reqs[0])
            if isinstance(got, BaseException):  # as Ray delivers a shard's own exception
                return Outcome(TIMED_OUT if isinstance(got, DeadlineExceeded) else ERROR, error=got)
            return Outcome(OK, value=got)
        assert method == "serve_many", method
        return Outcome(OK, value=[self.result(handle, r) for r in reqs])


class View:
    def __init__(self, door) -> None:
        self.door = door


async def send(batcher: ServeBatcher, jobs: list[tuple[int, str, float]]) -> list[Outcome]:
    """Each job (shard, request id, timeout) as its own task, all started in the same turn of the loop."""
    return await asyncio.gather(*(batcher.serve((shard, 1), shard, request(rid), timeout) for shard, rid, timeout in jobs))


def test_requests_ready_at_once_for_one_shard_go_as_one_call_and_each_gets_its_own_result():
    door = ScriptedDoor()
    batcher = ServeBatcher(View(door))
    jobs = [(i % 2, f"r{i}", 5.0) for i in range(16)]
    outs = asyncio.run(send(batcher, jobs))
    assert sorted((m, h, len(ids)) for m, h, ids in door.calls) == [("serve_many", 0, 8), ("serve_many", 1, 8)]
    assert [o.kind for o in outs] == [OK] * 16
    assert [(o.value.request_id, o.value.slot) for o in outs] == [(rid, shard) for shard, rid, _ in jobs]
    assert (batcher.calls, batcher.batched) == (2, 16)


def test_a_lone_request_goes_as_a_plain_serve_and_later_ones_start_a_new_batch():
    door = ScriptedDoor()
    batcher = ServeBatcher(View(door))

    async def go():
        first = await batcher.serve((0, 1), 0, request("a"), 5.0)
        rest = await send(batcher, [(0, "b", 5.0), (0, "c", 5.0)])
        return [first, *rest]

    outs = asyncio.run(go())
    assert [c[0] for c in door.calls] == ["serve", "serve_many"] and [o.kind for o in outs] == [OK] * 3


def test_each_request_gets_the_outcome_its_own_call_would_have_come_to():
    door = ScriptedDoor()
    door.fail = {"refused": RouteRefused("slot 0 refused refused (full)", "full"),
                 "bad": BadRequestError("empty prompt"),
                 "hung": DeadlineExceeded("generate hung past its deadline")}
    outs = asyncio.run(send(ServeBatcher(View(door)), [(0, rid, 5.0) for rid in ("ok", "refused", "bad", "hung")]))
    assert door.calls == [("serve_many", 0, ["ok", "refused", "bad", "hung"])]
    assert [o.kind for o in outs] == [OK, ERROR, ERROR, TIMED_OUT]
    assert outs[1].error.reason == "full" and isinstance(outs[2].error, BadRequestError)
    assert isinstance(outs[3].error, DeadlineExceeded)


def test_a_call_that_fails_as_a_whole_fails_every_request_in_it_the_same_way():
    door = ScriptedDoor()
    door.whole = Outcome(DIED, error=RuntimeError("slot 0 died"))
    outs = asyncio.run(send(ServeBatcher(View(door)), [(0, f"r{i}", 5.0) for i in range(3)]))
    assert [o.kind for o in outs] == [DIED] * 3 and all("slot 0 died" in str(o.error) for o in outs)


def test_each_request_keeps_its_own_deadline_and_a_caller_that_leaves_disturbs_no_other():
    door = ScriptedDoor(delay=0.3)
    batcher = ServeBatcher(View(door))

    async def go():
        short = asyncio.ensure_future(batcher.serve((0, 1), 0, request("short"), 0.05))
        leaving = asyncio.ensure_future(batcher.serve((0, 1), 0, request("leaving"), 5.0))
        long = asyncio.ensure_future(batcher.serve((0, 1), 0, request("long"), 5.0))
        timed_out = await short
        assert not long.done()  # the batch still runs for the others
        leaving.cancel()
        return timed_out, await long, leaving

    timed_out, long, leaving = asyncio.run(go())
    assert door.calls == [("serve_many", 0, ["short", "leaving", "long"])]
    assert timed_out.kind == TIMED_OUT and long.kind == OK and long.value.request_id == "long"
    assert leaving.cancelled()


def test_the_dispatcher_sends_a_clients_concurrent_short_requests_in_one_call_per_shard_and_accounts_each():
    door = ScriptedDoor()
    members = tuple(Member(slot, 1, slot) for slot in (0, 1))
    view = StateView(door, RoutingState(1, True, 0, members))
    d = Dispatcher(view, EventLog(), request_timeout_s=10.0, max_redispatch=2, rng=random.Random(0))
    door.fail = {"req-3": RouteRefused("slot refused req-3 (full)", "full")}  # refused: routed again, free

    async def go():
        return await asyncio.gather(*(d.submit([1, 2, 3], {"max_tokens": 2}) for _ in range(12)))

    results = asyncio.run(go())
    assert all(r.ok for r in results) and len({r.request_id for r in results}) == 12
    first_round = [c for c in door.calls if c[0] == "serve_many"]
    assert 1 <= len(first_round) <= 2 and sum(len(ids) for _, _, ids in first_round) == 12
    assert d.counters()["completed"] == 12 and d.counters()["in_progress"] == 0
    assert d.refused["full"] >= 1
