"""A client's watched requests on a shard: the shard's outbox (``fleet.shard.outbox``) and the client's poll
(``fleet.data.taps``). Virtual time."""

from __future__ import annotations

import asyncio

from rlfleet.fleet.data.taps import Taps
from rlfleet.fleet.errors import EngineCrashedError
from rlfleet.fleet.outcome import DIED, ERROR, OK, TIMED_OUT, Outcome
from rlfleet.fleet.shard.outbox import ORPHAN_S, Outbox, Outboxes
from rlfleet.fleet.types import Chunk, Completion, GenerationResult, Piece
from rlfleet.sim.clock import run_virtual


def piece(token: int) -> Piece:
    return Piece(0, (token,), (-0.5,), f"<{token}>", 0)


def result(rid: str, tokens: tuple[int, ...]) -> GenerationResult:
    return GenerationResult(rid, (1,), (Completion(tokens, tuple(-0.5 for _ in tokens), "length"),), 0, 0, 0, 1)


def tokens_of(answer) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rid, item in answer:
        if isinstance(item, Chunk):
            out.setdefault(rid, []).extend(t for p in item.pieces for t in p.token_ids)
    return out


def test_every_requests_output_leaves_in_one_answer_per_interval_the_first_a_caller_waits_on_at_once():
    async def go():
        loop = asyncio.get_running_loop()
        box, answers = Outbox(), []
        for rid in ("a", "b", "c"):
            box.start(rid, 0.05)

        async def engine():
            for step in range(10):  # every 10 ms, a token for each of the three requests
                for rid in ("a", "b", "c"):
                    box.offer(rid, [piece(step)], (9,) if step == 0 else None, 0, urgent=rid == "a" and step == 0)
                await asyncio.sleep(0.01)

        async def client():
            while sum(len(t) for _, a in answers for t in tokens_of(a).values()) < 30:
                answer = await box.take(1.0)
                answers.append((round(loop.time(), 3), answer))

        await asyncio.gather(engine(), client())
        return answers

    answers = run_virtual(go())
    assert answers[0][0] == 0.0 and set(tokens_of(answers[0][1])) == {"a", "b", "c"}  # at once, all of them
    assert answers[0][1][0][1].prompt_token_ids == (9,)
    gaps = [round(b[0] - a[0], 3) for a, b in zip(answers, answers[1:])]
    assert all(g >= 0.05 for g in gaps), gaps  # then no more than one answer per interval
    assert len(answers) <= 4  # 30 tokens of three requests in 4 answers, not 30 messages
    joined: dict[str, list[int]] = {}
    for _, a in answers:
        for rid, toks in tokens_of(a).items():
            joined.setdefault(rid, []).extend(toks)
    assert joined == {rid: list(range(10)) for rid in ("a", "b", "c")}  # in order, none twice


def test_an_end_leaves_at_once_a_result_drops_what_was_held_and_a_failure_keeps_it_ahead_of_its_error():
    async def go():
        box = Outbox()
        box.start("ok", 0.25)
        box.start("bad", 0.25)
        box.offer("ok", [piece(1)], (9,), 0, urgent=False)
        box.offer("bad", [piece(2)], (9,), 0, urgent=False)
        crash = EngineCrashedError("engine core died")
        box.end("ok", result("ok", (1,)))
        box.end("bad", crash)
        t0 = asyncio.get_running_loop().time()
        answer = await box.take(1.0)
        return answer, asyncio.get_running_loop().time() - t0, crash

    answer, waited, crash = run_virtual(go())
    assert waited == 0.0  # ends do not wait for the interval
    assert [(rid, type(item).__name__) for rid, item in answer] == [("bad", "Chunk"), ("ok", "GenerationResult"),
                                                                      ("bad", "EngineCrashedError")]
    assert answer[0][1].prompt_token_ids == (9,) and answer[2][1] is crash


def test_a_take_with_nothing_to_answer_comes_back_empty_after_its_wait():
    async def go():
        box = Outbox()
        t0 = asyncio.get_running_loop().time()
        answer = await box.take(1.0)
        return answer, asyncio.get_running_loop().time() - t0

    assert run_virtual(go()) == ([], 1.0)


def test_a_client_that_stops_polling_leaves_its_requests_to_be_aborted():
    async def go():
        boxes = Outboxes()
        kept, gone = boxes.open("kept"), boxes.open("gone")
        kept.start("k1", 0.05)
        gone.start("g1", 0.05)
        gone.start("g2", 0.05)
        poll = asyncio.ensure_future(kept.take(10.0))  # a poll under way: that client is alive
        await asyncio.sleep(ORPHAN_S - 1)
        early = boxes.orphans()
        await asyncio.sleep(2)
        late = boxes.orphans()
        poll.cancel()
        return early, late, boxes.get("gone"), boxes.get("kept") is kept

    early, late, gone_box, kept_still = run_virtual(go())
    assert early == [] and sorted(late) == ["g1", "g2"] and gone_box is None and kept_still


# ------------------------------------------------------------------ the client's poll
class PollDoor:
    """``take_output`` answers as scripted, in order; ``submit`` takes everything."""

    def __init__(self, answers: list[Outcome]) -> None:
        self.answers, self.calls = answers, []

    async def call(self, handle, method, *args, timeout):
        self.calls.append(method)
        if method == "submit":
            return Outcome(OK, value=[True] * len(args[1]))
        await asyncio.sleep(0.1)
        return self.answers.pop(0) if self.answers else Outcome(OK, value=[])


class View:
    def __init__(self, door) -> None:
        self.door = door


def test_a_dead_shards_poll_ends_every_request_watched_there_and_a_timed_out_poll_is_sent_again():
    async def go():
        door = PollDoor([Outcome(TIMED_OUT, error=TimeoutError("poll lost in transit")),
                         Outcome(OK, value=[("a", Chunk((piece(5),), (9,)))]),
                         Outcome(DIED, error=RuntimeError("actor died"))])
        taps = Taps(View(door))

        async def watch(rid):
            return [o async for o in taps.stream((0, 1), "h", rid, b"request", 60.0)]

        return await asyncio.gather(watch("a"), watch("b")), door.calls

    (a, b), calls = run_virtual(go())
    assert [o.kind for o in a] == [OK, DIED] and isinstance(a[0].value, Chunk)
    assert [o.kind for o in b] == [DIED]
    assert calls.count("take_output") == 3 and calls.count("submit") == 1  # both submitted in one call


def test_an_attempt_that_closes_late_does_not_stop_the_next_attempt_of_its_request_on_the_same_shard():
    async def go():
        door = PollDoor([Outcome(OK, value=[("r", result("r", (1,)))]), Outcome(OK, value=[]),
                         Outcome(OK, value=[("r", result("r", (2,)))])])
        taps = Taps(View(door))
        first = taps.stream((0, 1), "h", "r", b"request", 60.0)
        got = [await first.__anext__()]  # its result: the dispatcher stops there, the generator not closed yet

        async def collect():
            return [o async for o in taps.stream((0, 1), "h", "r", b"request", 60.0)]

        second = asyncio.ensure_future(collect())  # the re-sent attempt watches the same shard
        await asyncio.sleep(0.01)
        await first.aclose()  # the first attempt's generator closes only now
        return got, await second
    got, second = run_virtual(go())
    assert [o.value.completions[0].token_ids for o in got] == [(1,)]
    assert [o.value.completions[0].token_ids for o in second] == [(2,)]


def test_an_answer_joins_a_requests_pieces_by_version_and_labels_them_with_the_version_they_were_made_at():
    async def go():
        box = Outbox()
        box.start("r", 0.05)
        box.offer("r", [piece(1), piece(2)], (9,), 3, urgent=False)  # made at version 3 (pieces say 0)
        box.offer("r", [piece(3)], None, 3, urgent=False)
        box.offer("r", [piece(4)], None, 4, urgent=False)  # the refit's stamp landed between two steps
        box.offer("r", [Piece(0, (5,), (-0.5,), "<5>", 0, finish_reason="length")], None, 4, urgent=False)
        box.hurry()
        return await box.take(1.0)

    ((rid, chunk),) = run_virtual(go())
    assert rid == "r" and chunk.prompt_token_ids == (9,)
    assert [(p.token_ids, p.version, p.text, p.finish_reason) for p in chunk.pieces] == [
        ((1, 2, 3), 3, "<1><2><3>", None), ((4, 5), 4, "<4><5>", "length")]
    assert [len(p.logprobs) for p in chunk.pieces] == [3, 2]


def test_top_logprobs_and_each_completion_of_n_join_in_their_own_runs_and_prompt_logprobs_start_one():
    def top(index: int, token: int, **kw) -> Piece:
        return Piece(index, (token,), (-0.5,), f"<{token}>", 0, top_logprobs=({token: -0.5},), **kw)

    async def go():
        box = Outbox()
        box.start("r", 0.05)
        box.offer("r", [top(0, 1, prompt_logprobs=(None,)), top(1, 11, prompt_logprobs=(None,))], (9,), 2, False)
        box.offer("r", [top(0, 2), top(1, 12)], None, 2, urgent=False)  # n = 2: one piece of each per step
        box.offer("r", [piece(3)], None, 2, urgent=False)  # no top logprobs where the run has them: a new run
        box.offer("r", [top(1, 13, finish_reason="stop", spans=((2, 0, 3),))], None, 2, urgent=False)
        box.offer("r", [top(1, 14)], None, 2, urgent=False)  # after its completion's last piece: a run of its own
        box.hurry()
        return await box.take(1.0)

    ((_, chunk),) = run_virtual(go())
    assert [(p.index, p.token_ids, p.text, p.finish_reason, p.spans, p.prompt_logprobs is not None)
            for p in chunk.pieces] == [
        (0, (1, 2), "<1><2>", None, None, True), (1, (11, 12, 13), "<11><12><13>", "stop", ((2, 0, 3),), True),
        (0, (3,), "<3>", None, None, False), (1, (14,), "<14>", None, None, False)]
    assert [p.top_logprobs for p in chunk.pieces][:2] == [({1: -0.5}, {2: -0.5}), ({11: -0.5}, {12: -0.5}, {13: -0.5})]
    assert chunk.pieces[2].top_logprobs is None and {p.version for p in chunk.pieces} == {2}


def test_a_streamed_requests_output_is_not_held_to_a_slower_requests_interval():
    """A long request nobody streams (interval 0.25 s) holds output first; a streamed one (0.05 s) then makes
    some: the answer leaves on the streamed one's interval, not the other's."""
    async def go():
        loop = asyncio.get_running_loop()
        box = Outbox()
        box.start("held", 0.25)
        box.start("streamed", 0.05)
        box.offer("held", [piece(0)], (9,), 0, urgent=True)
        first = await box.take(1.0)  # an answer at 0: the next is due an interval later
        box.offer("held", [piece(1)], None, 0, urgent=False)
        taking = asyncio.ensure_future(box.take(1.0))
        await asyncio.sleep(0.02)  # the taker sleeps toward 0.25 s
        box.offer("streamed", [piece(2)], (9,), 0, urgent=False)
        answer = await taking
        return first, round(loop.time(), 3), sorted(tokens_of(answer).items())

    _, at, got = run_virtual(go())
    assert at == 0.05 and got == [("held", [1]), ("streamed", [2])]


def test_a_poll_whose_answer_cannot_be_read_ends_what_waits_there_instead_of_leaving_it_hanging():
    async def go():
        loop = asyncio.get_running_loop()
        taps = Taps(View(PollDoor([Outcome(OK, value=None)])))  # not a list of (id, item)
        outs = [o async for o in taps.stream((0, 1), "h", "r", b"request", 60.0)]
        return outs, loop.time()

    outs, at = run_virtual(go())
    assert [o.kind for o in outs] == [ERROR] and "poll of slot (0, 1) failed" in str(outs[0].error) and at < 1.0


def test_two_clients_on_one_shard_each_take_only_their_own_requests_output(tmp_path):
    """The real ``EngineShard`` (null engine): two clients submit at once; each client's poll answers its own
    requests and never the other's."""
    from rlfleet.fleet.shard.engine_shard import EngineShard
    from rlfleet.fleet.wire import ServeRequest

    (tmp_path / "config.json").write_text("{}")

    def wire(rid: str, prompt: list[int]) -> bytes:
        return ServeRequest(prompt, {"max_tokens": 1}, rid, None, 0, "any", 0, None, True, 0.05, None, 0).encode()

    async def go():
        shard = EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1)
        await shard.start()
        shard.set_route(0, True, 0)
        assert await shard.submit("a", [wire("a1", [1]), wire("a2", [2])]) == [True, True]
        assert await shard.submit("b", [wire("b1", [3])]) == [True]
        got: dict[str, list[str]] = {"a": [], "b": []}
        while len(got["a"]) < 2 or len(got["b"]) < 1:
            for client in ("a", "b"):
                got[client] += [rid for rid, item in await shard.take_output(client, 0.1)
                                if isinstance(item, GenerationResult)]
        return got

    got = run_virtual(go())
    assert sorted(got["a"]) == ["a1", "a2"] and got["b"] == ["b1"]
