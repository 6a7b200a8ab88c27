"""``rlfleet serve`` on real vLLM-CPU engines, through the real ``openai`` client and ``curl``.

One fleet of two engines and one HTTP front for the module (the front runs in this process, on
the fleet client's loop, as ``rlfleet serve`` runs it):

- completions and chat, plain and streamed (token by token, ``n`` choices), text and token-id prompts,
  logprobs with top-k: every response carries its weight versions, slot, incarnation and token ids, and the
  version header (a stream in its last chunks);
- the endpoints a deployment watches (``/health``, ``/metrics``, ``/v1/models``,
  ``/v1/fleet/status``) and the refusals (400 with vLLM's message, 404 for another model);
- a bounded load test with two refits in the middle: every request answered 200, none lost,
  responses from before and after each refit (the refits happened under the load);
- a shard killed under load: every request ends complete (re-sent) or with a clear error, none hangs,
  and the kill is shown to have hit requests in flight (they were re-sent);
- a shard killed mid-stream: the stream goes on (continued on the other engine), every token once, in order.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.records import Kill
from rlfleet.serve.loadtest import run_load
from rlfleet.serve.protocol import VERSION_HEADER
from rlfleet.serve.server import HttpServer
from tests.integration.fleet_helpers import Run, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(shared_fleet):
    fleet, source = shared_fleet.fleet, shared_fleet.source  # the session's fleet (tests/integration/conftest.py)
    server = HttpServer(fleet, port=0).start()
    try:
        yield SimpleNamespace(fleet=fleet, server=server, source=source, url=server.url, model=server.model_name)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def agent_front(served):
    """A second front on the same fleet, as ``rlfleet serve --enable-auto-tool-choice --tool-call-parser hermes``."""
    from rlfleet.serve.render import ChatOptions

    front = HttpServer(served.fleet, port=0, chat=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    front.start()
    try:
        yield SimpleNamespace(**{**vars(served), "url": front.url, "server": front})
    finally:
        front.stop()


def openai_client(s) -> OpenAI:
    return OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)


def curl(*args: str) -> tuple[int, str]:
    """(HTTP status, body) of one ``curl`` call."""
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=120)
    body, _, code = out.stdout.rpartition("\n")
    return int(code), body


def tags_of(obj) -> dict:
    return obj.model_dump()["rlfleet"]


# What the engine is held to when it must call a tool (a random tiny model never would by itself): vLLM's
# structured outputs, through the request's ``structured_outputs``, as a client of ``vllm serve`` would ask.
TOOL_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}\n</tool_call>'


def test_an_agent_transcript_with_tools_is_rendered_as_transformers_renders_it_and_its_call_parsed(agent_front):
    """A multi-turn transcript with tool calls and tool results, through the real ``openai`` client, to a front
    with vLLM's ``hermes`` tool-call parser: the prompt the engine got (the response's ``prompt_token_ids``) is
    ``transformers``' rendering of it, and the completion (constrained to a tool call) comes back as
    ``tool_calls``, its token ids kept; the next turn, carrying the call and its result, renders alike."""
    from transformers import AutoTokenizer

    from tests.transcripts import TOOLS, TRANSCRIPT, hf_rendering

    tok = AutoTokenizer.from_pretrained(agent_front.fleet.config.engine.model)
    c = openai_client(agent_front)
    r = c.chat.completions.create(model=agent_front.model, messages=TRANSCRIPT, tools=TOOLS, max_tokens=160,
                                  extra_body={"structured_outputs": {"regex": TOOL_CALL}})
    assert r.model_dump()["prompt_token_ids"] == hf_rendering(tok, TRANSCRIPT, TOOLS, add_generation_prompt=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    ids = choice.model_dump()["token_ids"]
    assert ids and "<tool_call>" in tok.decode(ids)
    turn = TRANSCRIPT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "snow"}]
    r2 = c.chat.completions.create(model=agent_front.model, messages=turn, tools=TOOLS, max_tokens=4)
    assert r2.model_dump()["prompt_token_ids"] == hf_rendering(tok, turn, TOOLS, add_generation_prompt=True)
    # tool_choice "required": no regex from the client; vLLM's renderer holds the engine to the tools' format
    # (a strict tool, so the arguments follow its schema too, as in OpenAI's API; its argument is one of three
    # words. JSON lets whitespace run on between its tokens and the random model takes it often: 15 of 25 such
    # calls ran past 120 tokens. Penalties on repeated tokens end that: 25 of 25 calls ended within 99 tokens.)
    ENDS = dict(frequency_penalty=1.5, presence_penalty=1.0)
    closed = [{"type": "function", "function": {"name": "pick", "description": "Pick a city", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}]
    r3 = c.chat.completions.create(model=agent_front.model, messages=TRANSCRIPT[:1], tools=closed,
                                   tool_choice="required", max_tokens=200, **ENDS)
    choice = r3.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [(t.function.name, json.loads(t.function.arguments)["city"] in ("Paris", "Rome", "Oslo"))
            for t in choice.message.tool_calls][:1] == [("pick", True)], choice
    # the same, streamed: vLLM's parser reads the deltas as they come, and the call arrives as tool_calls deltas
    chunks = list(c.chat.completions.create(model=agent_front.model, messages=TRANSCRIPT[:1], tools=closed,
                                            tool_choice="required", max_tokens=200, stream=True, **ENDS))
    calls = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "pick", chunks
    args = json.loads("".join(t.function.arguments or "" for t in calls if t.index == 0))
    assert args["city"] in ("Paris", "Rome", "Oslo")
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_completions_and_chat_through_the_openai_client_are_tagged_with_their_weights(served):
    c = openai_client(served)
    version = served.fleet.status()["version"]
    raw = c.completions.with_raw_response.create(model=served.model, prompt=[5, 6, 7, 8], max_tokens=8, logprobs=2,
                                                 extra_body={"ignore_eos": True})
    assert raw.headers[VERSION_HEADER] == str(version)
    r = raw.parse()
    choice = r.choices[0]
    assert len(choice.logprobs.token_logprobs) == 8 and all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    tag = tags_of(r)
    assert tag["weight_version"] == tag["version_start"] == version and tag["slot"] in (0, 1) and tag["incarnation"] >= 1
    assert len(choice.model_dump()["token_ids"]) == 8 and r.usage.completion_tokens == 8
    # a batch of prompts in one request, n each: prompt-major choices, each with its prompt (a trainer's step)
    batch = c.completions.create(model=served.model, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3, seed=1,
                                 extra_body={"ignore_eos": True}).model_dump()
    assert [ch["prompt_token_ids"] for ch in batch["choices"]] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert all(len(ch["token_ids"]) == 3 for ch in batch["choices"]) and batch["usage"]["prompt_tokens"] == 5

    text = c.completions.create(model=served.model, prompt="hello world", max_tokens=4, n=2, seed=1)
    assert len(text.choices) == 2 and all(ch.text for ch in text.choices)

    chat = c.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "count to three"}],
                                     max_tokens=6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    msg = chat.choices[0]
    assert msg.message.role == "assistant" and msg.message.content
    assert len(msg.logprobs.content) == 6 and all(len(t.top_logprobs) == 2 for t in msg.logprobs.content)
    assert tags_of(chat)["weight_version"] == version
    # the prompt's logprobs from the engine, each position's own token among them; tokens named by id
    scored = c.completions.create(model=served.model, prompt=[5, 6, 7, 8], max_tokens=2, logprobs=1,
                                  extra_body={"prompt_logprobs": 1, "return_tokens_as_token_ids": True}).model_dump()
    plp = scored["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    assert all(str(t) in plp[i] and plp[i][str(t)]["logprob"] <= 0 for i, t in enumerate([5, 6, 7, 8]) if i)
    assert all(tok.startswith("token_id:") for tok in scored["choices"][0]["logprobs"]["tokens"])


def test_streams_arrive_as_server_sent_events_token_by_token_tagged_at_the_end(served):
    c = openai_client(served)
    chunks = list(c.completions.create(model=served.model, prompt=[9, 10, 11], max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    body = [ch.model_dump() for ch in chunks]
    tokens = [t for ch in body for choice in ch["choices"] for t in choice["token_ids"]]
    assert len(tokens) == 8 and len([ch for ch in body if ch["choices"]]) > 2  # more than one delta and the finish
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == 8 and body[-1]["rlfleet"]["version_spans"][0][1:] == [0, 8]
    finish = body[-2]["choices"][0]
    assert finish["finish_reason"] == "length" and body[-2]["rlfleet"]["request_id"] == body[-1]["rlfleet"]["request_id"]
    chat = list(c.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, n=2, seed=3, stream=True, extra_body={"ignore_eos": True}))
    assert [ch.choices[0].delta.role for ch in chat[:2]] == ["assistant", "assistant"]
    for i in (0, 1):
        mine = [ch for ch in chat if ch.choices and ch.choices[0].index == i]
        assert mine[-1].choices[0].finish_reason == "length" and "".join(ch.choices[0].delta.content or "" for ch in mine)
        assert sum(len(ch.model_dump()["choices"][0].get("token_ids") or []) for ch in mine) == 5


def test_a_bad_request_is_refused_with_vllms_message_and_another_model_is_not_found(served):
    c = openai_client(served)
    with pytest.raises(BadRequestError, match="temperature must be non-negative"):
        c.completions.create(model=served.model, prompt=[1, 2], temperature=-1.0)
    with pytest.raises(BadRequestError, match="out of vocabulary"):  # refused by the engine, through the fleet
        c.completions.create(model=served.model, prompt=[1, 10**7], max_tokens=2)
    with pytest.raises(NotFoundError, match="does not exist"):
        c.completions.create(model="gpt-4", prompt=[1, 2])
    code, body = curl(f"{served.url}/v1/completions", "-H", "content-type: application/json", "-d", "{not json")
    assert code == 400 and json.loads(body)["error"]["type"] == "BadRequestError"
    code, body = curl(f"{served.url}/v1/chat/completions", "-H", "content-type: application/json",
                      "-d", json.dumps({"messages": [], "max_tokens": 2}))
    assert code == 400 and "messages" in json.loads(body)["error"]["message"]
    for prompt in ({}, {"prompt": ""}, {"prompt": None}):  # vLLM's own validator raised these past pydantic: a 500
        code, body = curl(f"{served.url}/v1/completions", "-H", "content-type: application/json",
                          "-d", json.dumps({"model": served.model, "max_tokens": 2, **prompt}))
        error = json.loads(body)["error"]
        assert (code, error["type"], error["param"]) == (400, "BadRequestError", "prompt"), (prompt, code, body)
    for field, value in (("logprobs", 100), ("prompt", [""])):  # refused on the engine (logprobs) and the front
        body = json.dumps({"model": served.model, "max_tokens": 2, "prompt": [1, 2], field: value})
        code, out = curl(f"{served.url}/v1/completions", "-H", "content-type: application/json", "-d", body)
        assert (code, json.loads(out)["error"]["param"]) == (400, field), (field, code, out)
    epoch = served.fleet.status()["epoch"]
    for field, value in (("prompt", "\ud800"), ("stop", ["\ud800"]), ("bad_words", ["\ud800"])):
        # a lone surrogate: a 500 with a traceback (prompt), or an engine error re-sent to every engine (stop)
        body = json.dumps({"model": served.model, "max_tokens": 2, "prompt": "hi", field: value})
        code, out = curl(f"{served.url}/v1/completions", "-H", "content-type: application/json", "-d", body)
        error = json.loads(out)["error"]
        assert (code, error["type"], error["param"]) == (400, "BadRequestError", field), (field, code, out)
    (results,) = served.fleet.generate([[1, 2, 3]], n=1, sampling={"max_tokens": 2, "stop": ["\ud800"]})
    assert [(r.status, r.attempts) for r in results] == [("returned", 1)], results  # not re-sent elsewhere
    assert results[0].reason.startswith("bad request") and "stop holds text that is not valid Unicode" in results[0].reason
    for sampling, at in (({"max_tokens": 4.5}, "$.max_tokens"), ({"max_tokens": 2, "seed": "x"}, "$.seed")):
        # taken as given by SamplingParams(**d), these killed the engine core (twice, before the poison check)
        (results,) = served.fleet.generate([[1, 2, 3]], n=1, sampling=sampling)
        assert [(r.status, r.attempts) for r in results] == [("returned", 1)], results
        assert results[0].reason.startswith("bad request") and at in results[0].reason, results[0].reason
    status = served.fleet.status()
    assert status["gate_open"] and status["epoch"] == epoch  # the caller's mistakes changed nothing
    assert {row["state"] for row in status["ledger"]["slots"]} == {"healthy"}, status["ledger"]["slots"]


def test_curl_sees_health_models_metrics_and_status(served):
    code, body = curl(f"{served.url}/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    code, body = curl(f"{served.url}/v1/models")
    assert code == 200 and json.loads(body)["data"][0]["id"] == served.model
    code, body = curl("-i", f"{served.url}/v1/completions", "-H", "content-type: application/json",
                      "-d", json.dumps({"prompt": [3, 4, 5], "max_tokens": 3}))
    assert code == 200 and f"{VERSION_HEADER}: " in body.lower()
    code, body = curl(f"{served.url}/metrics")
    assert code == 200
    lines = body.splitlines()
    assert "rlfleet_gate_open 1.0" in lines and "rlfleet_controller_up 1.0" in lines
    assert any(line.startswith('rlfleet_http_responses_total{code="200",endpoint="/v1/completions"}') for line in lines)
    assert 'rlfleet_engines{state="healthy"} 2.0' in lines
    code, body = curl(f"{served.url}/v1/fleet/status")
    status = json.loads(body)
    assert code == 200 and status["controller"]["fleet"] == served.fleet.name and status["routing"]["serving"] == 2


def _load_in_thread(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(asyncio.run(run_load(url, clients, seconds, max_tokens))))
    t.start()
    return t, out


def test_load_with_two_refits_in_the_middle_loses_nothing_and_sends_no_5xx(served):
    fleet, source = served.fleet, served.source
    v0 = fleet.status()["version"]
    t, out = _load_in_thread(served.url, clients=6, seconds=12.0, max_tokens=16)
    for i, at in enumerate((3.0, 7.0)):
        time.sleep(at - (3.0 if i else 0.0))
        ray_door.ask(source, "perturb", 100 + i, timeout=60)
        fleet.sync_weights(version=v0 + 1 + i, source=source)  # raises unless it committed
    t.join(timeout=180)
    assert not t.is_alive(), "the load test did not end"
    assert out["lost"] == 0, out["errors"]
    assert out["server_errors"] == 0 and out["by_code"] == {"200": out["sent"]}, out["errors"]
    versions = {int(v) for v in out["versions"]}
    assert {v0, v0 + 2} <= versions, f"responses did not straddle the refits: {out['versions']}"  # they ran under load
    assert fleet.status()["version"] == v0 + 2


def test_a_request_sent_while_a_refit_holds_the_gate_waits_and_runs_on_the_new_weights(served):
    """A request sent while a (slow) refit holds the gate closed waits for it and runs on the new weights, under the
    version policy it named; meanwhile ``/health`` says alive and ``/ready`` says why the gate is closed.

    It also showed a second front whose ``request_timeout_s`` (1.5 s) was below the fleet's refit budget (65 s)
    answer 503 naming the gate: a front timeout below the budget is now refused (issue 47), and a request that a
    closed gate holds past a valid timeout gets that 503 in ``tests/unit/test_serve.py`` (an operator's pause holds
    the gate there; here it would hold a real fleet for over a minute)."""
    fleet, source = served.fleet, served.source
    v = fleet.status()["version"]
    ray_door.ask(source, "perturb", 7, timeout=60)
    ray_door.ask(source, "hold_next_update", 5.0, timeout=30)  # a slow trainer holds the refit and the gate
    refit = threading.Thread(target=lambda: fleet.sync_weights(version=v + 1, source=source))
    refit.start()
    code, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(curl(f"{served.url}/ready")), 30,
                          every_s=0.05, what="the gate to close")
    assert json.loads(body)["status"] == "gate closed"
    alive = httpx.get(f"{served.url}/health", timeout=30)  # liveness: a refit is no reason to restart it
    assert alive.status_code == 200 and alive.json()["status"] == "gate closed"
    waited: dict = {}
    patient = threading.Thread(target=lambda: waited.update(  # this request's own policy: no stale engine
        openai_client(served).completions.create(model=served.model, prompt=[4, 5, 6], max_tokens=4,
                                                 extra_headers={"x-rlfleet-version-policy": "max_staleness=0"}
                                                 ).model_dump()))
    patient.start()
    refit.join(120)
    patient.join(120)
    # sent while the gate was closed, it waited and ran on the new weights, under the policy it named
    assert waited["rlfleet"]["version_start"] == waited["rlfleet"]["weight_version"] == v + 1
    assert waited["rlfleet"]["version_policy"] == "max_staleness=0"
    assert curl(f"{served.url}/health")[0] == curl(f"{served.url}/ready")[0] == 200


def test_the_documented_agent_rollout_tags_each_turn_with_the_weights_that_made_it(agent_front):
    spec = importlib.util.spec_from_file_location("agent_rollout", Path(__file__).parents[2] / "docs/examples/agent_rollout.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    served = agent_front
    fleet, source = served.fleet, served.source
    v = fleet.status()["version"]

    def refit() -> None:
        ray_door.ask(source, "perturb", 11, timeout=60)
        fleet.sync_weights(version=v + 1, source=source)

    turn1, turn2 = example.play_episode(openai_client(served), served.model, example.TASKS[0], refit)
    assert (turn1["weight_version"], turn2["weight_version"]) == (v, v + 1)
    (call,) = turn1["tool_calls"]  # the tool was called, and its call read back by the parser
    assert call["function"]["name"] == "count_words" and "text" in json.loads(call["function"]["arguments"])
    assert all(len(t["token_ids"]) == len(t["logprobs"]) > 0 for t in (turn1, turn2))


def test_a_shard_killed_under_load_costs_the_clients_nothing_but_latency(served):
    fleet = served.fleet
    before = served.server.front.client.counters()["requeued"]
    t, out = _load_in_thread(served.url, clients=6, seconds=8.0, max_tokens=32)
    time.sleep(2.5)
    fleet.fault_injector().kill_shard(0)
    t.join(timeout=180)
    assert not t.is_alive(), "the load test did not end: a request hung"
    assert out["lost"] == 0, out["errors"]
    # complete (re-sent), or a clear error: never an answer without a status and a message
    assert out["by_code"].get("200", 0) + sum(v for k, v in out["by_code"].items() if k != "200") == out["sent"]
    assert all(": " in e for e in out["errors"])
    assert served.server.front.client.counters()["requeued"] > before, "the kill hit no request in flight"
    wait_for(lambda: any(s["slot"] == 0 and s["incarnation"] >= 2 for s in fleet.status()["ledger"]["slots"]),
             120, what="slot 0 restarted")


def _serving_slot(served, request_id: str) -> tuple[int, int] | None:
    """(slot, incarnation) of the shard this front's client has ``request_id`` running on, read on its loop."""

    async def read():
        for slot, running in served.server.front.client.dispatcher.outstanding.items():
            if request_id in running:
                return slot, running[request_id][0]
        return None

    return served.server.front.client.spawn(read()).result(10)


def test_a_shard_killed_mid_stream_costs_the_stream_nothing_every_token_arrives_once_in_order(served):
    """A long completion streamed through the real ``openai`` client; once its first tokens arrived, the shard
    generating it is killed. The fleet continues it on the other engine from the tokens already sent: the
    stream goes on, every token arrives once and in order, the text adds up to the completion's, and the
    last chunk says it took more than one attempt and a continuation, on another slot than the one killed."""
    fleet, front = served.fleet, served.server.front
    heal = Run(fleet, served.source)  # both engines serving the committed version: the other one must take over
    heal.version = fleet.status()["version"]
    heal.heal()
    ended: list = []
    run = front.run

    async def recording(*args, **kwargs):  # the fleet's own result, to hold the stream against
        out = await run(*args, **kwargs)
        ended.append(out)
        return out

    front.run = recording
    since = len(fleet.events())
    try:
        stream = openai_client(served).completions.create(
            model=served.model, prompt=[21, 22, 23, 24], max_tokens=200, stream=True, temperature=1.0, seed=5,
            logprobs=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks, killed, sent_before_kill = [], None, 0
        for ch in stream:
            chunks.append(ch.model_dump())
            if killed is None and ch.choices and chunks[-1]["choices"][0]["token_ids"]:
                request_id = ch.id.removeprefix("cmpl-")
                killed = _serving_slot(served, request_id)
                assert killed is not None, f"{request_id} runs on no shard after its first tokens"
                sent_before_kill = sum(len(x["choices"][0]["token_ids"]) for x in chunks if x["choices"])
                fleet.fault_injector().kill_shard(killed[0])
    finally:
        del front.run
    assert killed is not None, "no tokens arrived"
    usage, final = chunks[-1], chunks[-2]
    tokens = [t for x in chunks[:-1] for t in x["choices"][0]["token_ids"]]
    text = "".join(x["choices"][0]["text"] for x in chunks[:-1])
    (out,) = ended
    completion = out.result.result.completions[0]
    assert sent_before_kill < 200, "the stream had ended before the kill"
    # every token once, in order, and the engines' own text of them: the stream is the completion
    assert tokens == list(completion.token_ids) and len(tokens) == usage["usage"]["completion_tokens"] == 200
    assert len(completion.logprobs) == 200 and all(math.isfinite(lp) for lp in completion.logprobs)  # each engine's own
    assert text == completion.text
    block = usage["rlfleet"]
    assert block["attempts"] > 1 and block["continued"] >= 1, block
    assert block["slot"] != killed[0], (block, killed)  # it finished on the other engine
    assert final["choices"][0]["finish_reason"] == "length" and final["rlfleet"] == block
    spans = block["version_spans"]
    assert spans[0][1] == 0 and spans[-1][2] == 200 and all(a[2] == b[1] for a, b in zip(spans, spans[1:]))
    assert any(k.slot == killed[0] and k.incarnation == killed[1] for k in Kill.among(fleet.events(since)))  # it fired
    assert (out.result.result.slot, out.result.result.incarnation) != killed
