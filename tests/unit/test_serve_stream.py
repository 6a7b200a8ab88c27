"""Streamed answers of the HTTP front, in virtual time, through the ASGI app itself (no sockets, no engines).

A scripted fleet client hands over tokens on a schedule (``TokenDelta``s, as ``FleetClient.generate_async``
calls ``on_tokens``) and ends each request as told (completed, or returned with a reason). The app is called
as uvicorn calls it, every message it sends stamped with the loop's (virtual) time, so the tests see when
each event went out, not only what it said:

- events go out as the tokens arrive (not once the completion is whole), the final chunk of each choice
  carries its finish reason and the ``rlfleet`` block (versions, continuations, version spans), then the
  usage (when asked) and ``[DONE]``; chat opens each choice with its role;
- nothing is committed before the first tokens: a request returned before any is an HTTP error status;
  one returned after them ends its stream with vLLM's in-stream error event;
- ``n`` choices are ``n`` fleet requests of one (seeds apart), streamed or not;
- an HTTP client that leaves, mid-stream or before its first token, has its fleet request cancelled
  (which aborts it on its engine: ``tests/unit/test_serve.py``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.fleet.data.routing_state import RoutingState
from rlfleet.fleet.types import Completion, GenerationResult, TokenDelta
from rlfleet.fleet.wire import decode_request
from tests.unit.fleet_fakes import StateView
from tests.unit.tapped_door import TAPPED, TappedShards
from rlfleet.recipe.tinymodel import build_tokenizer
from rlfleet.serve.app import build_app
from rlfleet.serve.front import Front
from rlfleet.serve.protocol import VERSION_HEADER
from rlfleet.sim.clock import run_virtual

MAX_LEN = 512


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def chat(tok, tiny_model):
    from rlfleet.serve.render import ChatRenderer

    return ChatRenderer(tiny_model, MAX_LEN, tok)


# ------------------------------------------------------------------ a scripted fleet client
@dataclass
class Plan:
    """One fleet request's script: ``(seconds after the previous, delta)`` pairs, then its end
    ``end_s`` later: completed (``returned`` empty) or returned with that reason."""

    deltas: list[tuple[float, TokenDelta]]
    end_s: float = 0.0
    returned: str = ""
    attempts: int = 1
    continued: int = 0
    slot: int = 0
    finish: str = "length"


def deltas(words: list[str], versions: list[int] | None = None, every_s: float = 1.0, first_id: int = 100,
           top: bool = False) -> list[tuple[float, TokenDelta]]:
    """One delta per word (one token each), ``every_s`` apart."""
    out = []
    for k, w in enumerate(words):
        tid = first_id + k
        out.append((every_s, TokenDelta(token_ids=(tid,), logprobs=(-0.1 * (k + 1),), text=w,
                                        top_logprobs=({tid: -0.1 * (k + 1), 7: -3.0},) if top else None,
                                        version=(versions or [3] * len(words))[k])))
    return out


@dataclass
class ScriptedClient:
    plan: Any  # (request_id, sampling) -> Plan
    requests: list[tuple[str, dict, bool]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def routing(self) -> RoutingState:
        return RoutingState(5, True, 3)

    def counters(self) -> dict:
        return {"accepted": 0, "completed": 0, "returned": 0, "in_progress": 0, "requeued": 0, "refused": {}}

    async def generate_async(self, prompt, sampling=None, request_id=None, policy=None, on_tokens=None) -> FleetResult:
        self.requests.append((request_id, dict(sampling or {}), on_tokens is not None))
        plan = self.plan(request_id, sampling)
        try:
            for wait_s, d in plan.deltas:
                await asyncio.sleep(wait_s)
                if on_tokens is not None:
                    on_tokens(d)
            await asyncio.sleep(plan.end_s)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        self.finished.append(request_id)
        if plan.returned:
            return FleetResult(request_id, "returned", None, plan.returned, attempts=plan.attempts)
        ds = [d for _, d in plan.deltas]
        spans: list[list[int]] = []
        at = 0
        for d in ds:
            if spans and spans[-1][0] == d.version:
                spans[-1][2] += len(d.token_ids)
            else:
                spans.append([d.version, at, at + len(d.token_ids)])
            at += len(d.token_ids)
        tops = tuple(t for d in ds for t in d.top_logprobs) if ds and ds[0].top_logprobs is not None else None
        comp = Completion(tuple(t for d in ds for t in d.token_ids), tuple(x for d in ds for x in d.logprobs),
                          plan.finish, text="".join(d.text for d in ds), top_logprobs=tops)
        versions = [d.version for d in ds] or [3]
        res = GenerationResult(request_id, tuple(prompt), (comp,), versions[0], versions[-1], plan.slot, 2,
                               version_spans=tuple(tuple(s) for s in spans))
        return FleetResult(request_id, "completed", res, attempts=plan.attempts, continued=plan.continued)


# ------------------------------------------------------------------ the app, called as uvicorn calls it
@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    at: list[tuple[float, bytes]]  # (virtual time, body part) as sent

    def events(self) -> list[tuple[float, Any]]:
        """Every server-sent event with the time it went out: its JSON, or the text ``[DONE]``."""
        out = []
        for t, part in self.at:
            for block in part.decode().split("\n\n"):
                if block:
                    assert block.startswith("data: "), block
                    data = block[len("data: "):]
                    out.append((t, data if data == "[DONE]" else json.loads(data)))
        return out


async def call(app, path: str, body: dict, leave_at: float | None = None) -> Reply:
    """POST ``body`` to ``path``; the client disconnects at virtual time ``leave_at`` (if given)."""
    loop = asyncio.get_running_loop()
    sent: list[dict] = []
    at: list[tuple[float, bytes]] = []
    read = False

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if leave_at is None:
            await asyncio.Event().wait()  # never leaves: cancelled once the response is done
        await asyncio.sleep(max(0.0, leave_at - loop.time()))
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            at.append((loop.time(), message["body"]))

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")], "server": ("test", 80),
             "client": ("test", 1), "root_path": ""}
    await app(scope, receive, send)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    status = start["status"] if start else 0
    headers = {k.decode(): v.decode() for k, v in (start or {}).get("headers", [])}
    return Reply(status, headers, b"".join(b for _, b in at), at)


def serving(tok, plan, chat=None) -> tuple[Any, Front, ScriptedClient]:
    client = ScriptedClient(plan)
    front = Front(client, tok, "m", MAX_LEN, chat=chat)
    return build_app(front), front, client


WORDS = ["The", " quick", " brown", " fox", " jumps"]


# ------------------------------------------------------------------ tokens as they come
def test_a_stream_sends_each_delta_as_it_arrives_and_ends_with_the_results_block(tok):
    """Five tokens a second apart, the last two sampled after a refit on another engine (a continuation):
    each event goes out the moment its token came, the final chunk carries the finish, the text adds up
    to the completion's, and the ``rlfleet`` block says which version sampled which tokens."""
    plan = Plan(deltas(WORDS, versions=[3, 3, 3, 4, 4]), end_s=0.5, attempts=2, continued=1, slot=1)

    async def go():
        app, front, client = serving(tok, lambda rid, s: plan)
        r = await call(app, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True})
        return r, front, client

    r, front, client = run_virtual(go())
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers[VERSION_HEADER] == "3"  # the version that sampled the first tokens sent
    events = r.events()
    deltas_ = [(t, e) for t, e in events[:5]]
    assert [t for t, _ in deltas_] == [1.0, 2.0, 3.0, 4.0, 5.0]  # sent as generated, not at the end (5.5)
    assert [e["choices"][0]["text"] for _, e in deltas_] == WORDS
    assert [e["choices"][0]["token_ids"] for _, e in deltas_] == [[100], [101], [102], [103], [104]]
    assert all("finish_reason" not in e["choices"][0] and "rlfleet" not in e for _, e in deltas_)
    assert deltas_[0][1]["choices"][0]["prompt_token_ids"] == [1, 2, 3]  # with the first chunk only
    assert "prompt_token_ids" not in deltas_[1][1]["choices"][0]
    t_final, final = events[5]
    assert t_final == 5.5 and final["choices"][0]["finish_reason"] == "length"
    assert final["choices"][0]["text"] == "" and final["choices"][0]["token_ids"] == []  # nothing left over
    block = final["rlfleet"]
    assert block["request_id"] == client.requests[0][0] and block["slot"] == 1
    assert (block["attempts"], block["continued"], block["version_start"], block["weight_version"]) == (2, 1, 3, 4)
    assert block["version_spans"] == [[3, 0, 3], [4, 3, 5]] and block["mixed_versions"] is True
    assert events[6] == (5.5, "[DONE]") and len(events) == 7
    assert len({e["id"] for _, e in events[:6]}) == 1 and events[0][1]["id"].startswith("cmpl-")
    assert client.requests[0][2] is True  # asked the fleet for tokens as they come
    counters = front.counters()
    assert counters["ttft_p50_s"] == 1.0 and counters["responses"] == {"/v1/completions 200": 1}
    sample = front.metrics.registry.get_sample_value
    ttft = "rlfleet_http_time_to_first_token_hist_seconds"  # counted from the HTTP request's arrival: the same 1 s here
    assert sample(f"{ttft}_count") == 1 and sample(f"{ttft}_sum") == pytest.approx(1.0, abs=0.01)
    assert sample("rlfleet_http_e2e_request_latency_seconds_count") == 1
    assert counters["engines"] == {"1": {"requests": 1, "tokens": 5}}


def test_a_chat_stream_opens_with_the_role_then_content_deltas_logprobs_and_usage(tok, chat):
    plan = Plan(deltas(WORDS[:3], top=True), end_s=0.0, finish="stop")

    async def go():
        app, _, _ = serving(tok, lambda rid, s: plan, chat)
        return await call(app, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True, "top_logprobs": 2,
            "stream_options": {"include_usage": True}})

    r = run_virtual(go())
    events = [e for _, e in r.events()]
    role = events[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["object"] == "chat.completion.chunk"
    contents = events[1:4]
    assert [e["choices"][0]["delta"]["content"] for e in contents] == WORDS[:3]
    lp = contents[1]["choices"][0]["logprobs"]["content"]
    assert len(lp) == 1 and lp[0]["logprob"] == pytest.approx(-0.2) and len(lp[0]["top_logprobs"]) == 2
    finish, usage, done = events[4], events[5], events[6]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["delta"]["content"] == ""
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["rlfleet"]["weight_version"] == 3 and finish["rlfleet"]["version_spans"] == [[3, 0, 3]]
    assert done == "[DONE]" and all(e["id"].startswith("chatcmpl-") for e in events[:6])


def test_completion_logprobs_come_with_each_delta_their_offsets_counted_across_deltas(tok):
    plan = Plan(deltas(WORDS[:3], top=True))

    async def go():
        app, _, _ = serving(tok, lambda rid, s: plan)
        return await call(app, "/v1/completions", {"prompt": [1], "stream": True, "logprobs": 1})

    events = [e for _, e in run_virtual(go()).events()]
    lps = [e["choices"][0]["logprobs"] for e in events[:3]]
    assert [lp["token_logprobs"] for lp in lps] == [[pytest.approx(-0.1)], [pytest.approx(-0.2)], [pytest.approx(-0.3)]]
    assert all(len(lp["top_logprobs"][0]) == 1 for lp in lps)  # k=1 of the two the engine sent
    offsets = [lp["text_offset"][0] for lp in lps]
    widths = [len(tok.decode([t])) for t in (100, 101)]
    assert offsets == [0, widths[0], widths[0] + widths[1]]


def test_a_request_that_ends_before_any_delta_is_streamed_whole_from_its_result(tok):
    """The result alone (no deltas: the engine sent everything with its end) still makes a full stream."""

    whole = TokenDelta((100, 101), (-0.1, -0.2), "The quick", 3)

    def plan(rid, sampling):  # the result holds two tokens no delta carried
        return Plan([(0.0, whole)], end_s=2.0)

    async def go():
        app, _, client = serving(tok, plan)
        quiet = client.generate_async

        async def no_deltas(prompt, sampling=None, request_id=None, policy=None, on_tokens=None):
            return await quiet(prompt, sampling, request_id, policy, None)  # the deltas never reach the front

        client.generate_async = no_deltas
        return await call(app, "/v1/completions", {"prompt": [1], "stream": True})

    r = run_virtual(go())
    assert r.status == 200 and r.headers[VERSION_HEADER] == "3"
    events = r.events()
    (t, final), done = events[0], events[1]
    assert t == 2.0 and final["choices"][0]["text"] == "The quick" and final["choices"][0]["token_ids"] == [100, 101]
    assert final["choices"][0]["finish_reason"] == "length" and done[1] == "[DONE]"


# ------------------------------------------------------------------ failures: before and after the 200
def test_a_request_returned_before_its_first_token_is_answered_with_its_http_error_not_a_stream(tok):
    """Held until the first token: a fleet that returns the request first (no engine within the timeout,
    a request vLLM refused) is still answered 503 or 400 with the reason, as a non-streamed one is."""

    async def go(reason):
        app, front, _ = serving(tok, lambda rid, s: Plan([], end_s=3.0, returned=reason))
        return await call(app, "/v1/completions", {"prompt": [1], "stream": True}), front

    r, front = run_virtual(go("no serving shard within the request timeout (3 s)"))
    assert r.status == 503 and r.at[0][0] == 3.0  # nothing was sent while it was held
    assert json.loads(r.body)["error"]["message"].startswith("no serving shard")
    r, _ = run_virtual(go("bad request: request x rejected by vLLM: Token id 999 is out of vocabulary"))
    assert r.status == 400 and json.loads(r.body)["error"] == {
        "message": "Token id 999 is out of vocabulary", "type": "BadRequestError", "param": None, "code": 400}
    assert front.counters()["responses"] == {"/v1/completions 503": 1}


def test_a_request_returned_mid_stream_ends_its_stream_with_an_error_event_then_done(tok):
    """Its engine died and the request could not be continued (its version policy forbids mixing
    versions): the 200 went out with the first tokens, so the stream ends in vLLM's in-stream error shape."""
    reason = "cannot continue: its version policy forbids mixing weight versions (2 tokens already sent)"
    plan = Plan(deltas(WORDS[:2]), end_s=1.0, returned=reason, attempts=1)

    async def go():
        app, front, _ = serving(tok, lambda rid, s: plan)
        return await call(app, "/v1/completions", {"prompt": [1], "stream": True}), front

    r, front = run_virtual(go())
    assert r.status == 200
    events = r.events()
    assert [e["choices"][0]["text"] for _, e in events[:2]] == WORDS[:2]
    t, err = events[2]
    assert t == 3.0 and err == {"error": {"message": reason, "type": "ServiceUnavailableError", "param": None,
                                          "code": 503}}
    assert events[3][1] == "[DONE]" and len(events) == 4
    assert front.counters()["stream_errors"] == 1


# ------------------------------------------------------------------ n choices
def test_n_streamed_choices_are_n_fleet_requests_seeded_apart_indexed_in_one_stream(tok, chat):
    def plan(rid, sampling):
        i = int(rid.rsplit("-", 1)[1])
        return Plan(deltas(WORDS[:2], every_s=1.0 + i * 0.5, first_id=200 + 10 * i), end_s=0.1, slot=i)

    async def go():
        app, _, client = serving(tok, plan, chat)
        r = await call(app, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 7, "stream": True,
            "stream_options": {"include_usage": True}})
        return r, client

    r, client = run_virtual(go())
    sent = [(s.get("seed"), s.get("n"), streamed) for _, s, streamed in client.requests]
    assert sent == [(7, None, True), (8, None, True)]
    events = [e for _, e in r.events()]
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # a role chunk per choice first
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    for e in events[2:-2]:
        (c,) = e["choices"]
        by_choice[c["index"]] += c["token_ids"]
    assert by_choice == {0: [200, 201], 1: [210, 211]}
    usage = events[-2]
    assert usage["usage"]["completion_tokens"] == 4
    assert [b["request_id"] for b in usage["rlfleet"]["choices"]] == [rid for rid, _, _ in client.requests]
    assert events[-1] == "[DONE]"


def test_n_non_streamed_choices_are_n_fleet_requests_answered_in_one_response(tok):
    def plan(rid, sampling):
        i = int(rid.rsplit("-", 1)[1])
        return Plan(deltas(WORDS[i:i + 2], first_id=300 + 10 * i), slot=i)

    async def go():
        app, _, client = serving(tok, plan)
        return await call(app, "/v1/completions", {"prompt": [1, 2], "n": 3, "max_tokens": 2}), client

    r, client = run_virtual(go())
    assert r.status == 200 and all(not streamed for _, _, streamed in client.requests) and len(client.requests) == 3
    body = json.loads(r.body)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(i, "".join(WORDS[i:i + 2])) for i in range(3)]
    assert body["usage"]["completion_tokens"] == 6 and [b["slot"] for b in body["rlfleet"]["choices"]] == [0, 1, 2]


def test_one_failed_choice_answers_the_request_with_its_error_and_cancels_the_others(tok):
    def plan(rid, sampling):
        if rid.endswith("-1"):
            return Plan([], end_s=1.0, returned="fleet stopped: FleetExhausted")
        return Plan(deltas(WORDS), end_s=0.0)

    async def go():
        app, _, client = serving(tok, plan)
        return await call(app, "/v1/completions", {"prompt": [1], "n": 2}), client

    r, client = run_virtual(go())
    assert r.status == 503 and "FleetExhausted" in json.loads(r.body)["error"]["message"]
    assert client.cancelled == [client.requests[0][0]]  # not left running for an answer already sent


# ------------------------------------------------------------------ a client that leaves
def test_a_client_that_leaves_mid_stream_has_its_fleet_request_cancelled(tok):
    async def go():
        app, front, client = serving(tok, lambda rid, s: Plan(deltas(WORDS), end_s=0.5))
        r = await call(app, "/v1/completions", {"prompt": [1], "stream": True}, leave_at=2.5)
        await asyncio.sleep(0)
        return r, front, client

    r, front, client = run_virtual(go())
    assert r.status == 200 and [e["choices"][0]["text"] for _, e in r.events()] == WORDS[:2]
    assert client.cancelled == [client.requests[0][0]] and client.finished == []
    counters = front.counters()
    assert (counters["cancelled"], counters["in_flight"]) == (1, 0)


def test_a_client_that_leaves_before_its_first_token_has_its_fleet_request_cancelled(tok):
    async def go():
        app, front, client = serving(tok, lambda rid, s: Plan(deltas(WORDS, every_s=10.0)))
        # a token-id prompt: a chat's rendering runs on a thread, and virtual time would not wait for it
        r = await call(app, "/v1/completions", {"prompt": [1, 2], "n": 2, "stream": True}, leave_at=4.0)
        await asyncio.sleep(0)
        return r, front, client

    r, front, client = run_virtual(go())
    assert b"data:" not in r.body  # no stream was begun (the client is gone: what FastAPI sends it goes nowhere)
    assert sorted(client.cancelled) == sorted(rid for rid, _, _ in client.requests) and len(client.cancelled) == 2
    assert front.counters()["cancelled"] == 2 and front.counters()["in_flight"] == 0


def test_a_stream_cut_off_by_the_servers_stop_ends_with_an_error_event_naming_the_shutdown(tok):
    async def go():
        app, front, client = serving(tok, lambda rid, s: Plan(deltas(WORDS, every_s=2.0)))
        task = asyncio.ensure_future(call(app, "/v1/completions", {"prompt": [1], "stream": True}))
        await asyncio.sleep(3.0)
        front.cut_off_after(2.0)
        return await task, front, client

    r, front, client = run_virtual(go())
    events = r.events()
    assert [e["choices"][0]["text"] for _, e in events[:2]] == WORDS[:2]
    assert events[2][0] == 5.0 and "shutting down" in events[2][1]["error"]["message"]
    assert events[3][1] == "[DONE]" and client.cancelled == [client.requests[0][0]]
    assert front.counters()["cut_off"] == 1


# ------------------------------------------------------------------ through the real dispatcher
class SlowStreamDoor:
    """Shards that make one piece a second (``fleet.types.Chunk``s, told through ``EngineShard.take_output``), then
    die or finish as scripted per slot; every other call (an abort) is recorded."""

    def __init__(self, view_box: dict, scripts: dict[int, tuple[list[int], str, int]]) -> None:
        self.view_box, self.scripts = view_box, scripts
        self.sent: list[tuple[int, list[int]]] = []
        self.calls: list[tuple[int, str, tuple]] = []
        self.tapped = TappedShards(self.script, key=lambda h: h)

    async def script(self, handle, request, timeout):
        from rlfleet.fleet.outcome import DIED, OK, Outcome
        from rlfleet.fleet.types import Chunk, Piece

        slot = handle
        r = decode_request(request)
        prompt, rid = r.prompt, r.request_id
        self.sent.append((slot, list(prompt)))
        tokens, end, version = self.scripts[slot]
        for k, t in enumerate(tokens):
            await asyncio.sleep(1.0)
            yield Outcome(OK, value=Chunk((Piece(0, (t,), (-0.5,), f"<{t}>", version),),
                                          tuple(prompt) if k == 0 else None))
        if end == "die":  # it leaves routing: the next attempt goes to slot 1
            view = self.view_box["view"]
            view.state = RoutingState(view.state.epoch + 1, True, version, (view.members[1],))
            yield Outcome(DIED, error=RuntimeError(f"slot {slot} died"))
            return
        made = tuple(tokens)
        c = Completion(made, tuple(-0.5 for _ in made), "length", "".join(f"<{t}>" for t in made))
        yield Outcome(OK, value=GenerationResult(rid, tuple(prompt), (c,), version, version, slot, 1,
                                                 version_spans=((version, 0, len(made)),)))

    async def call(self, handle, method, *args, timeout):
        from rlfleet.fleet.outcome import OK, Outcome

        if method in TAPPED:
            return await self.tapped.answer(handle, method, args, timeout)
        self.calls.append((handle, method, args))
        return Outcome(OK, value=True)


class DispatchingClient(StateView):
    """A fleet client made of the real ``Dispatcher`` over ``SlowStreamDoor``'s two shards (slot 0 first)."""

    def __init__(self, scripts) -> None:
        import random

        from rlfleet.fleet.data.dispatch import Dispatcher
        from rlfleet.fleet.data.routing_state import Member
        from rlfleet.fleet.eventlog import EventLog

        box: dict = {}
        self.members = (Member(0, 1, 0), Member(1, 1, 1))
        super().__init__(SlowStreamDoor(box, scripts), RoutingState(1, True, 3, (self.members[0],)))
        box["view"] = self
        self.dispatcher = Dispatcher(self, EventLog(), request_timeout_s=60, max_redispatch=3, rng=random.Random(0))

    def counters(self):
        return self.dispatcher.counters()

    async def generate_async(self, prompt, sampling=None, request_id=None, policy=None, on_tokens=None):
        return await self.dispatcher.submit(prompt, sampling, request_id, policy, on_tokens)


def test_an_engine_that_dies_mid_stream_does_not_end_the_stream_the_next_one_goes_on_where_it_stopped(tok):
    async def go():
        client = DispatchingClient({0: ([5, 6, 7], "die", 3), 1: ([8, 9], "finish", 4)})
        app = build_app(Front(client, tok, "m", MAX_LEN))
        r = await call(app, "/v1/completions", {"prompt": [1, 2], "max_tokens": 5, "stream": True})
        return r, client

    r, client = run_virtual(go())
    assert r.status == 200 and r.headers[VERSION_HEADER] == "3"
    events = r.events()
    deltas_ = [(t, e["choices"][0]) for t, e in events[:5]]
    assert [(t, c["token_ids"], c["text"]) for t, c in deltas_] == [
        (1.0, [5], "<5>"), (2.0, [6], "<6>"), (3.0, [7], "<7>"), (4.0, [8], "<8>"), (5.0, [9], "<9>")]
    block = events[5][1]["rlfleet"]
    assert (block["attempts"], block["continued"], block["slot"]) == (2, 1, 1)
    assert block["version_spans"] == [[3, 0, 3], [4, 3, 5]] and block["mixed_versions"] is True
    assert client.door.sent == [(0, [1, 2]), (1, [1, 2, 5, 6, 7])]  # continued from the tokens sent, not redone
    assert events[6][1] == "[DONE]"


def test_a_client_that_leaves_mid_stream_has_its_request_aborted_on_the_engine(tok):
    async def go():
        client = DispatchingClient({0: ([5, 6, 7, 8, 9], "finish", 3)})
        front = Front(client, tok, "m", MAX_LEN)
        r = await call(build_app(front), "/v1/completions", {"prompt": [1, 2], "max_tokens": 5, "stream": True},
                       leave_at=2.5)
        await asyncio.sleep(0.1)
        return r, client, front

    r, client, front = run_virtual(go())
    assert [e["choices"][0]["token_ids"] for _, e in r.events()] == [[5], [6]]
    (rid,) = {e["id"].removeprefix("cmpl-") for _, e in r.events()}
    assert client.door.calls == [(0, "abort", ([rid],))]  # the engine stops spending on it
    assert client.dispatcher.returned_reasons["cancelled by the caller"] == 1 and front.counters()["cancelled"] == 1


def test_a_chat_stream_through_vllms_parsers_streams_reasoning_content_and_tool_call_deltas(tok, tiny_model):
    """With ``--tool-call-parser hermes --reasoning-parser qwen3`` a chat stream is read by vLLM's parsers delta
    by delta (one parser per choice, as ``vllm serve``): the reasoning as ``reasoning`` deltas, the text as
    ``content``, the call as ``tool_calls`` deltas whose arguments add up to the call's JSON; the choice
    finishes ``tool_calls``, and every chunk still carries its token ids (the trainer's)."""
    from rlfleet.serve.render import ChatOptions, ChatRenderer
    from tests.transcripts import TOOLS

    parsing = ChatRenderer(tiny_model, MAX_LEN * 2, tok, ChatOptions(enable_auto_tool_choice=True,
                                                                 tool_call_parser="hermes", reasoning_parser="qwen3"))
    pieces = ["thinking", "</think>", "Let me look.", "<tool_call>", "\n", '{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}', "\n", "</tool_call>"]
    script, ids = [], []
    for p in pieces:
        t = tuple(tok.encode(p, add_special_tokens=False))
        ids += t
        script.append((1.0, TokenDelta(token_ids=t, logprobs=(-0.1,) * len(t), text=p, version=3)))
    plan = Plan(script, end_s=0.0, finish="stop")

    async def go():
        app = build_app(Front(ScriptedClient(lambda rid, s: plan), tok, "m", MAX_LEN * 2, chat=parsing))
        return await call(app, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": True})

    r = run_virtual(go())
    events = [e for _, e in r.events() if e != "[DONE]"]
    deltas_ = [e["choices"][0]["delta"] for e in events[1:]]
    assert "".join(d.get("reasoning") or "" for d in deltas_) == "thinking"
    assert "".join(d.get("content") or "" for d in deltas_).strip() == "Let me look."
    calls = [c for d in deltas_ for c in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == ids


def test_a_batch_of_prompts_streams_prompt_major_each_choice_with_its_own_prompt(tok):
    """``/v1/completions`` with a list of prompts and ``stream: true``, as vLLM streams it: choice ``p * n + i``
    is prompt ``p``'s ``i``-th, its first chunk carries its own prompt's ids, and the usage counts each
    prompt once."""
    def plan(rid, sampling):
        i = int(rid.rsplit("-", 1)[1])
        return Plan(deltas(WORDS[:2], every_s=1.0 + i * 0.25, first_id=300 + 10 * i), end_s=0.1, slot=i)

    async def go():
        app, _, client = serving(tok, plan)
        r = await call(app, "/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 2,
                                                "stream": True, "stream_options": {"include_usage": True}})
        return r, client

    r, client = run_virtual(go())
    assert r.status == 200 and len(client.requests) == 4
    events = [e for _, e in r.events()]
    firsts: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    for e in events[:-2]:
        (c,) = e["choices"]
        tokens[c["index"]] += c["token_ids"]
        if "prompt_token_ids" in c:
            firsts[c["index"]] = c["prompt_token_ids"]
    assert firsts == {0: [1, 2, 3], 1: [1, 2, 3], 2: [4, 5], 3: [4, 5]}
    assert tokens == {i: [300 + 10 * i, 301 + 10 * i] for i in range(4)}
    assert events[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
