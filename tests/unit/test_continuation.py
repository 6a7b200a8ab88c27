"""Continuation (issue 32): the client holds each request's streamed output and, when its engine fails, sends
it on from there instead of generating those tokens again; the seam, the pacing and the version spans.

The dispatcher runs against scripted streaming shards (a shard here streams pieces and then dies, aborts or
finishes as told); real engines are in ``tests/integration/test_continuation.py``.
"""

from __future__ import annotations

import asyncio
import random

from rlfleet.fleet.data.dispatch import Dispatcher
from rlfleet.fleet.data.partial import Partial
from rlfleet.fleet.data.routing_state import ANY, LATEST, Member, RoutingState, VersionPolicy
from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.outcome import DIED, OK, Outcome
from rlfleet.fleet.shard.continuation import TextSeam
from rlfleet.fleet.types import Chunk, Completion, GenerationResult, Piece
from rlfleet.fleet.wire import Carried, ServeRequest, decode_request
from tests.unit.fleet_fakes import StateView
from tests.unit.tapped_door import TAPPED, TappedShards


# ---------------------------------------------------------------------------------------------- the seam
def test_the_seam_sends_the_carried_text_the_caller_never_got_first():
    seam = TextSeam("hello wor", "hello", None)
    assert seam.feed("ld") == (" world", None)
    assert seam.feed("!") == ("!", None)


def test_a_stop_string_across_the_seam_ends_the_request_as_vllm_would():
    assert TextSeam("abc ST", "abc ST", ["STOP"]).feed("OP more") == ("", "STOP")
    assert TextSeam("abc ST", "abc ST", ["STOP"], include_stop=True).feed("OP more") == ("OP", "STOP")
    # the dead engine held "ST" back (a possible stop's beginning): it is cut, never sent
    assert TextSeam("abc ST", "abc ", ["STOP"]).feed("OP x") == ("", "STOP")
    assert TextSeam("abc ST", "abc ", ["STOP"], include_stop=True).feed("OP x") == ("STOP", "STOP")
    # a stop wholly in the new text is the engine's own to find
    assert TextSeam("abc", "abc", ["STOP"]).feed(" STOP") == (" STOP", None)


def test_new_text_that_could_still_complete_a_stop_across_the_seam_is_held_until_it_cannot():
    seam = TextSeam("xS", "xS", ["STOP"])
    assert seam.feed("T") == ("", None)  # "ST" could still become "STOP": held
    assert seam.feed("OP") == ("", "STOP")
    seam = TextSeam("xS", "x", ["STOP"])
    assert seam.feed("T", last=True) == ("ST", None)  # the engine finished: what is held goes out


# ---------------------------------------------------------------------------------------------- pacing
# ---------------------------------------------------------------------------------------------- the partial output
def piece(tokens, version=0, text=None, finish=None, index=0):
    return Piece(index, tuple(tokens), tuple(-0.5 for _ in tokens), text if text is not None else "".join(f"<{t}>" for t in tokens),
                 version, finish_reason=finish)


def test_a_continuation_carries_the_prompt_and_held_tokens_and_the_budget_left():
    out = Partial()
    out.begin()
    out.take(Chunk((piece([5, 6, 7]),), (1, 2)))
    prompt, sampling, carried = out.continuation("text prompt", {"max_tokens": 10, "min_tokens": 5, "seed": 3})
    assert prompt == [1, 2, 5, 6, 7]
    assert sampling == {"max_tokens": 7, "min_tokens": 2, "seed": 3}
    assert carried == Carried(3, "<5><6><7>", 0)


def test_tokens_are_told_once_in_order_and_the_whole_result_never_takes_back_what_was_told():
    told = []
    out = Partial(told.append)
    out.begin()
    out.take(Chunk((piece([5, 6]),), (1,)))
    out.take(Chunk((piece([7], version=1),)))
    # the attempt's whole result: everything it made, one more token the pacer still held
    out.settle(GenerationResult("r", (1,), (Completion((5, 6, 7, 8), (-0.5,) * 4, "length", "<5><6><7><8>"),),
                                0, 1, 0, 1, version_spans=((0, 0, 2), (1, 2, 4))))
    assert [d.token_ids for d in told] == [(5, 6), (7,), (8,)]
    assert [d.version for d in told] == [0, 1, 1]
    assert "".join(d.text for d in told) == "<5><6><7><8>"
    assert out.spans() == ((0, 0, 2), (1, 2, 4))
    # a shard that dropped its output at the finish (its policy check) does not shrink what was told
    out2 = Partial()
    out2.begin()
    out2.take(Chunk((piece([5, 6]),), (1,)))
    out2.settle(GenerationResult("r", (1,), (Completion((), (), "abort"),), 0, 1, 0, 1))
    assert out2.tokens == [5, 6]


# ---------------------------------------------------------------------------------------------- the dispatcher
class Script:
    """One shard's answer to one attempt: ``pieces`` streamed, then ``end``: "die", "abort" or "finish"."""

    def __init__(self, pieces, end, version=0):
        self.pieces, self.end, self.version = pieces, end, version


class StreamDoor:
    def __init__(self, scripts: dict[int, list[Script]]) -> None:
        self.scripts = scripts
        self.sent: list[tuple[int, ServeRequest]] = []  # each request as the shard reads it
        self.calls: list[str] = []
        self.tapped = TappedShards(self.script, key=lambda h: h)

    async def script(self, handle, request, timeout):
        slot = handle
        r = decode_request(request)
        self.sent.append((slot, r))
        prompt, rid = r.prompt, r.request_id
        script = self.scripts[slot].pop(0)
        made = []
        for i, p in enumerate(script.pieces):
            made += p.token_ids
            yield Outcome(OK, value=Chunk((p,), tuple(prompt) if i == 0 else None))
            await asyncio.sleep(0)
        if script.end != "finish":  # the failed shard leaves routing: the next attempt goes to the other one
            self.view.state = RoutingState(self.view.state.epoch + 1, True, self.view.state.version, (Member(1, 1, 1),))
        if script.end == "die":
            yield Outcome(DIED, error=RuntimeError(f"slot {slot} died"))
            return
        finish = "abort" if script.end == "abort" else "length"
        c = Completion(tuple(made), tuple(-0.5 for _ in made), finish, "".join(p.text for p in script.pieces))
        yield Outcome(OK, value=GenerationResult(rid, tuple(prompt), (c,), script.version, script.version, slot, 1,
                                                 version_spans=((script.version, 0, len(made)),) if made else ()))

    async def call(self, handle, method, *args, timeout):
        """A watched request's calls (``EngineShard.submit``, ``take_output``), or a plain call: the script's
        last item (its result or failure)."""
        self.calls.append(method)
        if method in TAPPED:
            return await self.tapped.answer(handle, method, args, timeout)
        last = None
        async for out in self.script(handle, args[0], timeout):
            last = out
        return last


class View(StateView):
    def __init__(self, door, version=0, policy=VersionPolicy(ANY)) -> None:
        super().__init__(door, RoutingState(1, True, version, (Member(0, 1, 0),)), policy)  # slot 1 after 0 fails
        door.view = self


def dispatch(view, **kw) -> Dispatcher:
    return Dispatcher(view, EventLog(), request_timeout_s=30, max_redispatch=3, rng=random.Random(0),
                      **{"stream_min_tokens": 0, **kw})


def test_a_request_whose_engine_dies_goes_on_elsewhere_from_its_tokens_with_every_logprob_and_both_versions():
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6]), piece([7])], "die")],
                           1: [Script([piece([8, 9], version=1)], "finish", version=1)]})
        view = View(door, version=1)
        told = []
        d = dispatch(view)
        r = await d.submit([1, 2], {"max_tokens": 5}, "r", on_tokens=told.append)
        assert [(e["slot"], e["tokens"]) for e in d._log.records() if e["event"] == "continued"] == [(1, 3)]
        assert r.ok and r.continued == 1 and r.tokens_reused == 3 and r.tokens_discarded == 0
        c = r.result.completions[0]
        assert c.token_ids == (5, 6, 7, 8, 9) and len(c.logprobs) == 5 and c.text == "<5><6><7><8><9>"
        assert r.result.prompt_token_ids == (1, 2)
        assert r.result.version_spans == ((0, 0, 3), (1, 3, 5)) and r.result.mixed_versions
        (slot, second), = [(s, req) for s, req in door.sent if s == 1]
        assert second.prompt == [1, 2, 5, 6, 7] and second.sampling["max_tokens"] == 2
        # (its actor died with it alone in flight there: it goes on as a suspect, ``fleet.data.poison``)
        assert (second.carried, second.suspect) == (Carried(3, "<5><6><7>", 0), 1)
        assert [t for d in told for t in d.token_ids] == [5, 6, 7, 8, 9]  # each once, in order

    asyncio.run(go())


def test_latest_never_mixes_versions_it_starts_over_and_says_why():
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6])], "abort")],
                           1: [Script([piece([8, 9, 10], version=1)], "finish", version=1)]})
        view = View(door, version=1, policy=VersionPolicy(LATEST))  # a refit to 1 aborted the version-0 request
        r = await dispatch(view).submit([1, 2], {"max_tokens": 3}, "r")
        assert r.ok and r.continued == 0 and r.tokens_discarded == 2
        assert "latest" in r.started_over and r.result.version_spans == ((1, 0, 3),) and not r.result.mixed_versions
        assert [req.prompt for _, req in door.sent] == [[1, 2], [1, 2]]  # sent again from the prompt alone

    asyncio.run(go())


def test_a_streamed_answer_that_cannot_be_continued_is_returned_not_restarted_under_the_callers_eyes():
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6])], "abort")], 1: []})
        view = View(door, version=1, policy=VersionPolicy(LATEST))
        d = dispatch(view)
        r = await d.submit([1, 2], {"max_tokens": 3}, "r", on_tokens=lambda delta: None)
        assert not r.ok and r.reason.startswith("cannot continue the streamed answer") and "latest" in r.reason
        assert d.in_progress == 0 and d.returned == 1

    asyncio.run(go())


def test_with_continuation_off_an_interrupted_request_starts_over_and_counts_what_it_threw_away():
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6, 7])], "die")], 1: [Script([piece([8, 9, 10, 11])], "finish")]})
        d = dispatch(View(door), continuation=False)
        r = await d.submit([1, 2], {"max_tokens": 4}, "r")
        assert r.ok and r.result.completions[0].token_ids == (8, 9, 10, 11) and r.tokens_discarded == 3
        assert "continuation is off" in r.started_over and d.counters()["tokens_discarded"] == 3

    asyncio.run(go())


def test_output_that_had_already_ended_when_its_engine_died_completes_without_another_attempt():
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6]), piece([7], finish="stop")], "die")], 1: []})
        r = await dispatch(View(door)).submit([1, 2], {"max_tokens": 9}, "r")
        assert r.ok and r.result.completions[0].token_ids == (5, 6, 7) and r.result.finish_reason == "stop"
        assert len(door.sent) == 1

    asyncio.run(go())


def test_held_output_that_ended_tags_the_result_with_its_own_tokens_versions_not_the_routing_version():
    """Issue 47: a result built from held tokens took the client's routing version as its headline:
    ``weight_version: 1`` over ``version_spans ((0, 0, 2),)``, and a trainer filtering on it took a version-0
    sample for a version-1 one. Its tags now come from its tokens: the last one's, the first one's."""
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6]), piece([7], finish="stop")], "die")], 1: []})
        r = await dispatch(View(door, version=1)).submit([1, 2], {"max_tokens": 9}, "r")  # the fleet moved to 1
        assert r.ok and r.result.version_spans == ((0, 0, 3),)
        assert (r.result.version_start, r.result.weight_version) == (0, 0) and not r.result.mixed_versions
        out = Partial()
        out.take(Chunk((piece([5, 6]),), (1,)))
        out.take(Chunk((piece([7], version=2),)))
        ended = out.ended_here(0, 1, 5, "r", 0.0, finish="abort")  # ended by its caller with the fleet at 5
        assert (ended.version_start, ended.weight_version, ended.version_spans) == (0, 2, ((0, 0, 2), (2, 2, 3)))
        empty = Partial().ended_here(-1, -1, 5, "r", 0.0, finish="abort")  # never reached an engine: no token
        assert (empty.version_start, empty.weight_version) == (5, 5)

    asyncio.run(go())


def test_held_output_that_ended_is_held_to_its_version_policy_as_a_continuation_is():
    """Issue 47: a ``latest`` request whose engine died after its output ended was completed from the held
    version-0 tokens although the fleet had committed version 1; it now starts over, as a continuation would."""
    async def go():
        door = StreamDoor({0: [Script([piece([5, 6]), piece([7], finish="stop")], "die")],
                           1: [Script([piece([8, 9, 10], version=1)], "finish", version=1)]})
        r = await dispatch(View(door, version=1, policy=VersionPolicy(LATEST))).submit([1, 2], {"max_tokens": 3}, "r")
        assert r.ok and r.tokens_discarded == 3 and "latest" in r.started_over
        assert r.result.version_spans == ((1, 0, 3),) and r.result.weight_version == 1
        assert [req.prompt for _, req in door.sent] == [[1, 2], [1, 2]]

    asyncio.run(go())


def test_a_short_request_without_a_streaming_caller_is_one_plain_call_and_a_long_one_streams():
    async def go():
        door = StreamDoor({0: [Script([piece([5])], "finish"), Script([piece([5])], "finish"),
                               Script([piece([5])], "finish")]})
        d = dispatch(View(door), stream_min_tokens=32)
        assert (await d.submit([1], {"max_tokens": 32}, "short")).ok  # a stream costs Ray twice a call
        assert (await d.submit([1], {"max_tokens": 33}, "long")).ok
        assert (await d.submit([1], {"max_tokens": 4}, "told", on_tokens=lambda delta: None)).ok
        # the short one a plain call; the others submitted, their output taken by the client's poll of that shard
        assert door.calls[0] == "serve" and [c for c in door.calls[1:] if c != "take_output"] == ["submit", "submit"]
        assert [req.request_id for _, req in door.sent] == ["short", "long", "told"]

    asyncio.run(go())


def test_the_prompt_logprobs_of_the_first_attempt_are_kept_and_not_asked_again_over_the_longer_prompt():
    """A continued request's prompt is the original followed by the held tokens: the prompt logprobs the first
    engine sent (over the original) are the caller's, and the continuation does not make the next engine
    compute them again; a result that brings them (a continuation's, longer) is cut to the original prompt."""
    plp = (None, {2: (-1.0, 1)})
    out = Partial()
    out.begin()
    first = Piece(index=0, token_ids=(5, 6), logprobs=(-0.5, -0.5), text="<5><6>", prompt_logprobs=plp)
    out.take(Chunk((first,), (1, 2)))
    _, sampling, _ = out.continuation([1, 2], {"max_tokens": 4, "prompt_logprobs": 1})
    assert "prompt_logprobs" not in sampling and out.prompt_logprobs == plp
    out.begin()
    out.settle(GenerationResult("r", (1, 2, 5, 6), (Completion((7,), (-0.1,), "length", "<7>"),), 0, 0, 1, 1,
                                prompt_logprobs=plp + ({5: (-2.0, 4)}, {6: (-3.0, 5)})))
    assert out.result(GenerationResult("r", (1, 2, 5, 6), (Completion((7,), (-0.1,), "length"),), 0, 0, 1, 1)
                      ).prompt_logprobs == plp
    late = Partial()
    late.settle(GenerationResult("r", (1, 2), (Completion((7,), (-0.1,), "length"),), 0, 0, 1, 1,
                                 prompt_logprobs=plp))
    assert late.prompt_logprobs == plp


def test_a_caller_that_streams_gets_chunks_per_stream_interval_and_one_that_does_not_per_hold_interval():
    """Output held only for continuation goes less often: each chunk costs an actor message on both sides."""
    async def go():
        door = StreamDoor({0: [Script([piece([5])], "finish"), Script([piece([5])], "finish")]})
        d = dispatch(View(door), stream_interval_s=0.05, hold_interval_s=0.25)
        assert (await d.submit([1], {"max_tokens": 40}, "held")).ok
        assert (await d.submit([1], {"max_tokens": 40}, "told", on_tokens=lambda delta: None)).ok
        assert [(req.request_id, req.first_at_once, req.interval_s) for _, req in door.sent] == [
            ("held", False, 0.25), ("told", True, 0.05)]

    asyncio.run(go())
