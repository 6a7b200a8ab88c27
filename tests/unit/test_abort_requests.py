"""Ending requests early (vLLM's ``/abort_requests``, ``Dispatcher.end``): a request the caller ends answers with
the output made so far and ``finish_reason`` ``abort``, wherever it is (on an engine, waiting for one, between
attempts), and is never sent again, whereas an abort the caller did not ask for (a refit, a pause) is continued.

Scripted shards drive the dispatcher here; ``tests/integration/test_trl.py`` ends requests on real engines
over HTTP.
"""

from __future__ import annotations

import asyncio
import random

from rlfleet.fleet.data.dispatch import Dispatcher
from rlfleet.fleet.data.routing_state import Member, RoutingState
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.outcome import DIED, OK, Outcome
from rlfleet.fleet.types import Chunk, Completion, GenerationResult, Piece
from rlfleet.fleet.wire import decode_request
from tests.unit.fleet_fakes import StateView
from tests.unit.tapped_door import TAPPED, TappedShards


class SlowDoor:
    """Each shard makes a token every 10 ms until aborted (its result then ends ``abort`` with what it made) or
    until ``die`` is set for its slot (it streams what it made, then fails as a dead actor)."""

    def __init__(self) -> None:
        self.aborted: set[str] = set()
        self.sent: list[tuple[int, str]] = []
        self.die: set[int] = set()
        self.lose_aborts = False  # the abort never reaches the engine (it died first)
        self.engine_aborts: dict[str, int] = {}  # request id -> after this many tokens its engine aborts it, once
        self.tapped = TappedShards(self.script, key=lambda h: h)

    async def call(self, handle, method, *args, timeout):
        if method == "abort":
            if not self.lose_aborts:
                self.aborted.update(args[0])
            return Outcome(OK, value=True)
        if method in TAPPED:
            return await self.tapped.answer(handle, method, args, timeout)
        last = None
        async for out in self.script(handle, args[0], timeout):
            last = out
        return last

    async def script(self, handle, request, timeout):
        r = decode_request(request)
        prompt, sampling, rid = r.prompt, r.sampling, r.request_id
        self.sent.append((handle, rid))
        made = []
        own = self.engine_aborts.pop(rid, None)
        while rid not in self.aborted and len(made) < sampling["max_tokens"] and len(made) != own:
            await asyncio.sleep(0.01)
            made.append(len(made) + 100)
            yield Outcome(OK, value=Chunk((Piece(0, (made[-1],), (-0.5,), f"<{made[-1]}>", 0),),
                                          tuple(prompt) if len(made) == 1 else None))
            if handle in self.die and len(made) >= 3:
                yield Outcome(DIED, error=RuntimeError(f"slot {handle} died"))
                return
        finish = "abort" if rid in self.aborted or len(made) == own else "length"
        c = Completion(tuple(made), tuple(-0.5 for _ in made), finish, "".join(f"<{t}>" for t in made))
        yield Outcome(OK, value=GenerationResult(rid, tuple(prompt), (c,), 0, 0, handle, 1,
                                                 version_spans=((0, 0, len(made)),)))


class ClosedView(StateView):
    async def newer_routing(self, epoch, timeout):  # nothing changes: the wait runs its whole time
        await asyncio.sleep(timeout)
        return self.state


def fleet(gate_open: bool = True) -> tuple[SlowDoor, StateView, Dispatcher]:
    door = SlowDoor()
    view = ClosedView(door, RoutingState(1, gate_open, 0, (Member(0, 1, 0), Member(1, 1, 1))))
    return door, view, Dispatcher(view, EventLog(), request_timeout_s=30, max_redispatch=3, rng=random.Random(0),
                                  stream_min_tokens=0)


def test_an_ended_request_answers_with_what_its_engine_made_and_is_not_sent_again():
    async def go():
        door, _, d = fleet()
        running = asyncio.ensure_future(d.submit([1, 2], {"max_tokens": 500}, "cmpl-a-0"))
        await asyncio.sleep(0.08)
        assert d.end(None) == ["cmpl-a-0"]
        r = await asyncio.wait_for(running, 5)
        c = r.result.completions[0]
        assert r.ok and c.finish_reason == "abort" and 3 <= len(c.token_ids) < 50 and len(c.logprobs) == len(c.token_ids)
        assert door.aborted == {"cmpl-a-0"} and len(door.sent) == 1  # aborted on its engine, never re-sent
        assert [e["reason"] for e in d._log.records() if e["event"] == "ended"] == ["ended by the caller"]
        assert d.in_progress == 0 and d.end(None) == []

    asyncio.run(go())


def test_an_abort_the_caller_did_not_ask_for_is_still_continued():
    async def go():
        door, _, d = fleet()
        door.engine_aborts["r"] = 5  # e.g. a refit's staleness abort: the engine ends it, the caller did not
        r = await asyncio.wait_for(d.submit([1, 2], {"max_tokens": 20}, "r"), 5)
        assert r.ok and r.result.finish_reason == "length"
        assert len(door.sent) == 2 and r.continued == 1 and len(r.result.completions[0].token_ids) == 20

    asyncio.run(go())


def test_a_request_waiting_for_an_engine_ends_at_once_with_no_tokens_and_its_prompt():
    async def go():
        door, view, d = fleet(gate_open=False)  # a refit or a pause holds the gate closed: it waits
        waiting = asyncio.ensure_future(d.submit([1, 2, 3], {"max_tokens": 5}, "w"))
        await asyncio.sleep(0.05)
        assert d.end(["w"]) == ["w"]
        r = await asyncio.wait_for(waiting, 1.5)  # its wait for a newer routing state is at most 1 s
        assert r.ok and r.result.completions[0].token_ids == () and r.result.finish_reason == "abort"
        assert r.result.prompt_token_ids == (1, 2, 3) and r.result.slot == -1 and door.sent == []

    asyncio.run(go())


def test_an_id_ends_its_choices_and_no_other_request():
    async def go():
        door, _, d = fleet()
        runs = {rid: asyncio.ensure_future(d.submit([1], {"max_tokens": 300}, rid))
                for rid in ("cmpl-x-0", "cmpl-x-1", "cmpl-xy-0")}
        await asyncio.sleep(0.05)
        assert sorted(d.end(["cmpl-x"])) == ["cmpl-x-0", "cmpl-x-1"]
        for rid in ("cmpl-x-0", "cmpl-x-1"):
            assert (await asyncio.wait_for(runs[rid], 5)).result.finish_reason == "abort"
        assert not runs["cmpl-xy-0"].done()
        d.end(["cmpl-xy-0"])
        assert (await asyncio.wait_for(runs["cmpl-xy-0"], 5)).result.finish_reason == "abort"

    asyncio.run(go())


def test_a_request_ended_while_its_engine_dies_completes_with_what_it_held_instead_of_going_on():
    async def go():
        door, _, d = fleet()
        door.die, door.lose_aborts = {0, 1}, True
        running = asyncio.ensure_future(d.submit([1, 2], {"max_tokens": 50}, "r", on_tokens=lambda delta: None))
        await asyncio.sleep(0.015)
        d.end(["r"])  # the abort is on its way when the engine dies
        r = await asyncio.wait_for(running, 5)
        assert r.ok and r.result.finish_reason == "abort" and len(door.sent) == 1
        assert r.result.completions[0].token_ids == (100, 101, 102)  # what it streamed before its engine died

    asyncio.run(go())


def test_the_front_ends_a_request_by_the_ids_its_caller_knows():
    """A response's id ends every choice; vLLM's per-prompt ``id-j`` ends prompt j's; the fleet's own ids pass."""
    from types import SimpleNamespace

    from rlfleet.serve.front import Front

    front = SimpleNamespace(_names=__import__("collections").OrderedDict())
    Front.name_request(front, "cmpl-one", "http-1", 1, 1)
    Front.name_request(front, "cmpl-batch", "http-2", 2, 6)  # 2 prompts x n=3, prompt-major
    ids = lambda names: Front.fleet_ids(front, names)  # noqa: E731
    assert ids(["cmpl-one"]) == ["http-1"] and ids(["cmpl-batch"]) == ["http-2"]
    assert ids(["cmpl-batch-1"]) == ["http-2-3", "http-2-4", "http-2-5"] and ids(["cmpl-batch-2"]) == []
    assert ids(["http-9-0", "cmpl-unknown"]) == ["http-9-0", "cmpl-unknown"]


def test_a_request_a_refit_aborted_and_holds_for_the_gate_ends_with_the_tokens_it_made_and_is_not_sent_again():
    async def go():
        door, view, d = fleet()
        door.engine_aborts["r"] = 5  # the refit's abort on its engine (its version policy), after 5 tokens
        running = asyncio.ensure_future(d.submit([1, 2], {"max_tokens": 50}, "r"))
        await asyncio.sleep(0.02)
        view.state = RoutingState(2, False, 0, view.state.members)  # the refit closed the gate meanwhile
        await asyncio.sleep(0.15)  # aborted there, held at the client for the gate, holding its 5 tokens
        assert not running.done() and len(door.sent) == 1
        assert d.end(["r"]) == ["r"]
        r = await asyncio.wait_for(running, 1.5)
        c = r.result.completions[0]
        assert r.ok and c.finish_reason == "abort" and c.token_ids == (100, 101, 102, 103, 104)
        view.state = RoutingState(3, True, 0, view.state.members)  # the gate reopens: nothing is sent again
        await asyncio.sleep(0.05)
        assert len(door.sent) == 1 and d.in_progress == 0

    asyncio.run(go())


def test_ending_every_request_of_one_client_leaves_another_clients_requests_on_the_same_engines_alone():
    async def go():
        door = SlowDoor()
        view = ClosedView(door, RoutingState(1, True, 0, (Member(0, 1, 0), Member(1, 1, 1))))
        mine, theirs = (Dispatcher(view, EventLog(), request_timeout_s=30, max_redispatch=3, rng=random.Random(i),
                                   id_prefix=name, stream_min_tokens=0) for i, name in enumerate(("mine", "theirs")))
        a = [asyncio.ensure_future(mine.submit([1], {"max_tokens": 300})) for _ in range(3)]
        b = [asyncio.ensure_future(theirs.submit([1], {"max_tokens": 12})) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert mine.end(["theirs-0", "theirs"]) == []  # another client's ids name nothing here
        assert sorted(mine.end(None)) == ["mine-0", "mine-1", "mine-2"]
        ended, served = await asyncio.wait_for(asyncio.gather(asyncio.gather(*a), asyncio.gather(*b)), 5)
        assert all(r.ok and r.result.finish_reason == "abort" for r in ended)
        assert all(r.ok and r.result.finish_reason == "length" and len(r.result.completions[0].token_ids) == 12
                   for r in served)
        assert door.aborted == {"mine-0", "mine-1", "mine-2"}  # only this client's reached the engines
        assert theirs.counters()["completed"] == 3 and mine.counters()["completed"] == 3

    asyncio.run(go())


def test_a_closing_client_returns_every_request_its_loop_will_not_end_and_counts_none_twice():
    """``Dispatcher.return_unsettled``: a client closing while its loop is held (a call into a cluster that
    a signal took down) would stop the loop with requests accepted and never ended. Each is returned and logged
    at once; when its task runs again, it finds it settled: no second record, no second count, and no abort
    sent to an abandoned cluster."""
    async def go():
        door, _, d = fleet()
        runs = [asyncio.ensure_future(d.submit([1], {"max_tokens": 300}, f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        assert d.in_progress == 3
        d.abandoned = True
        assert d.return_unsettled("cancelled by the caller: the client closed") == 3
        assert d.in_progress == 0 and d.returned == 3
        for r in runs:  # the loop goes on after all: each task ends, and counts nothing again
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        ends = [e for e in d._log.records() if e["event"] in ("returned", "completed")]
        assert sorted(e["request_id"] for e in ends) == ["r0", "r1", "r2"] and d.returned == 3 and d.completed == 0
        assert door.aborted == set() and d.return_unsettled("again") == 0

    asyncio.run(go())
