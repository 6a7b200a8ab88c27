"""The HTTP front's pure parts, without Ray or engines.

- OpenAI request -> (prompt token ids, sampling dict): vLLM's own models and validation decide; the
  dict is what differs from vLLM's defaults and rebuilds the same ``SamplingParams`` on a shard;
- chat requests are rendered by vLLM's own renderer with the model's chat template (tools, tool calls and
  tool results included: the same ids as ``transformers``), and read back by vLLM's tool and reasoning parsers;
- responses carry the fleet's tags (weight versions, slot, incarnation, request id) and token ids;
- how a returned request becomes HTTP (400 for the caller's mistake with vLLM's words, 503 naming why);
- the Prometheus text (as a scraper parses it: ``test_serve_metrics``);
- a cancelled request (its HTTP client left) is aborted on its shard and accounted, never lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.sampling_params import SamplingParams

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.fleet.data.routing_state import RoutingState
from rlfleet.fleet.types import Completion, GenerationResult
from rlfleet.recipe.tinymodel import CHAT_TEMPLATE, build_tokenizer
from rlfleet.serve import protocol
from rlfleet.serve.front import Front
from tests.transcripts import TOOLS, TRANSCRIPT, hf_rendering
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run

MAX_LEN = 512


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def result(n: int = 1, version: int = 3, start: int = 2, text: str | None = None) -> GenerationResult:
    comps = tuple(Completion((10 + i, 11, 12), (-0.5, -1.0, -1.5), "length", text=text,
                             top_logprobs=({10 + i: -0.5, 7: -0.7}, {11: -1.0}, {12: -1.5})) for i in range(n))
    return GenerationResult("r-1", (1, 2, 3), comps, start, version, slot=4, incarnation=2,
                            version_spans=((version, 0, 3),))


# ------------------------------------------------------------------ requests
def test_a_completion_request_becomes_token_ids_and_the_sampling_fields_it_set(tok):
    req = CompletionRequest(prompt="hello world", max_tokens=5, temperature=0.5, seed=7, logprobs=2, n=2,
                            stop=["xyz"])
    prompt, sampling = protocol.completion_call(req, tok, MAX_LEN)
    assert prompt == tok.encode("hello world")
    assert sampling == {"n": 2, "temperature": 0.5, "seed": 7, "max_tokens": 5, "logprobs": 2, "stop": ["xyz"]}
    rebuilt = SamplingParams(**sampling)  # what the shard's backend does with it
    assert (rebuilt.n, rebuilt.temperature, rebuilt.max_tokens, rebuilt.logprobs) == (2, 0.5, 5, 2)


def test_token_id_prompts_pass_through_and_max_tokens_is_clamped_to_the_context(tok):
    prompt, sampling = protocol.completion_call(CompletionRequest(prompt=[5, 6, 7], max_tokens=10_000), tok, MAX_LEN)
    assert prompt == [5, 6, 7] and sampling["max_tokens"] == MAX_LEN - 3
    assert sampling["logprobs"] is None  # not asked for: the engine does not compute them
    prompt, _ = protocol.completion_call(CompletionRequest(prompt=[[8, 9]]), tok, MAX_LEN)
    assert prompt == [8, 9]


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [1, 2], "temperature": -1.0}, "temperature", "temperature must be non-negative"),
    ({"prompt": [1, 2], "top_p": 0.0}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": [[1], [2], list(range(MAX_LEN))]}, "prompt", "maximum context length"),  # one of a batch
    ({"prompt": list(range(MAX_LEN))}, "prompt", "maximum context length"),
    ({"prompt": [1], "echo": True}, "echo", "echo is not supported"),
    ({"prompt": [""]}, "prompt", "must not be empty"),
    ({"prompt": [[]]}, "prompt", "must not be empty"),
])
def test_a_bad_completion_request_is_refused_with_vllms_words_naming_the_field(tok, body, param, words):
    with pytest.raises(protocol.BadRequest, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        protocol.completion_calls(CompletionRequest(**body), tok, MAX_LEN)
    assert err.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ({"prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt"),
    ({"prompt": [1, 2], "stop": ["\ud800"]}, "stop"),
    ({"prompt": [1, 2], "bad_words": ["fine", "\ud800x"]}, "bad_words"),
    ({"prompt": [1, 2], "logit_bias": {"\ud800": 1.0}}, "logit_bias"),
])
def test_text_with_a_lone_surrogate_is_refused_naming_its_field_before_the_tokenizer_or_an_engine(body, param):
    """JSON carries "\\ud800"; UTF-8 cannot. In a prompt it was a 500 with a traceback (the tokenizer's
    TypeError); in ``stop`` or ``bad_words`` vLLM failed inside the engine, the failure counted against
    every engine the request was re-sent to, and normal traffic stalled behind the exclusions."""
    with pytest.raises(protocol.BadRequest, match="not valid Unicode") as err:
        protocol.refuse_invalid_text(CompletionRequest(**body))
    assert err.value.param == param
    protocol.refuse_invalid_text(CompletionRequest(prompt="caf\u00e9 \U0001f600", stop=["\n"]))  # valid text passes


def test_the_engine_side_refuses_a_sampling_dict_with_invalid_text_naming_the_field():
    from rlfleet.fleet.types import field_with_invalid_text

    assert field_with_invalid_text({"stop": ["a", "\ud800"], "n": 2}) == "stop"
    assert field_with_invalid_text({"structured_outputs": {"regex": "\udc00+"}}) == "structured_outputs"
    assert field_with_invalid_text({"stop": ["\u00e9"], "seed": 1, "logit_bias": {3: 1.0}}) is None


@pytest.mark.parametrize("sampling, words", [
    ({"max_tokens": 4.5}, "Expected `int | null`, got `float` - at `$.max_tokens`"),
    ({"seed": "x"}, "Expected `int | null`, got `str` - at `$.seed`"),
    ({"max_tokens": "4"}, "at `$.max_tokens`"),
    ({"stop": 5}, "at `$.stop`"),
    ({"logit_bias": {"1": 0.5}}, "at `key` in `$.logit_bias`"),
    ({"seed": 2 ** 64}, "seed must be within int64"),
    ({"bogus_key": 1}, "Unexpected keyword argument 'bogus_key'"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),  # vLLM's own checks still run
])
def test_the_engine_side_refuses_a_sampling_value_of_the_wrong_type_naming_the_field(sampling, words):
    """``SamplingParams(**d)`` took ``max_tokens=4.5`` or ``seed="x"`` as given; the engine core died on them
    (twice, before the poison check returned the request: a one-engine fleet stopped). Checked against vLLM's own
    annotations now, in the shard, before anything reaches the engine."""
    from vllm.exceptions import VLLMClientError

    from rlfleet.fleet.shard.vllm_backend import sampling_params

    with pytest.raises((TypeError, ValueError, VLLMClientError)) as err:  # what the shard answers as a bad request
        sampling_params({"max_tokens": 8, **sampling})
    assert words in str(err.value)


def test_the_engine_side_builds_the_same_sampling_params_as_vllms_constructor():
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    from rlfleet.fleet.shard.vllm_backend import sampling_params

    d = {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": "x", "logprobs": 2, "n": 1,
         "logit_bias": {5: -1.0}, "output_kind": RequestOutputKind.DELTA, "flat_logprobs": True, "stream_interval": 4,
         "ignore_eos": True, "stop_token_ids": [2]}
    assert sampling_params(d) == SamplingParams(**d)
    so = sampling_params({"structured_outputs": {"json": {"type": "object"}}}).structured_outputs
    assert isinstance(so, StructuredOutputsParams) and so.json == {"type": "object"}


@pytest.mark.parametrize("field,value", [
    ("truncate_prompt_tokens", 2), ("suffix", "end"), ("echo", True),
])
def test_a_field_the_front_does_not_carry_out_is_refused_naming_it_not_ignored(tok, field, value):
    with pytest.raises(protocol.BadRequest, match=f"{field} is not supported") as err:
        protocol.completion_call(CompletionRequest(prompt=[1, 2], **{field: value}), tok, MAX_LEN)
    assert err.value.param == field


@pytest.fixture(scope="module")
def chat(tok, tiny_model):
    from rlfleet.serve.render import ChatRenderer

    return ChatRenderer(tiny_model, MAX_LEN * 2, tok)


@pytest.fixture(scope="module")
def parsing(tok, tiny_model):
    from rlfleet.serve.render import ChatOptions, ChatRenderer

    return ChatRenderer(tiny_model, MAX_LEN * 2, tok, ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                                                  reasoning_parser="qwen3"))


def test_an_agent_transcript_with_tools_renders_exactly_as_transformers_renders_it(tok, chat):
    """vLLM's renderer (``serve.render``) builds the prompt ``vllm serve`` would: the tools in the system block,
    each tool call as ``<tool_call>`` JSON with its arguments, the tool results in one user turn."""
    req = ChatCompletionRequest(messages=TRANSCRIPT, tools=TOOLS, tool_choice="none", max_completion_tokens=4)
    prompt, sampling = protocol.chat_call(req, chat, MAX_LEN * 2)
    assert prompt == hf_rendering(tok, TRANSCRIPT, TOOLS, add_generation_prompt=True)
    text = tok.decode(prompt)
    assert '"name": "get_weather", "arguments": {"city": "Rome"}' in text and text.count("<tool_response>") == 2
    assert '"description": "The weather in a city"' in text and text.endswith("<|im_start|>assistant\n")
    assert sampling["max_tokens"] == 4
    # the template's switches reach it: no generation prompt, or the last message continued
    plain = TRANSCRIPT[:2] + [{"role": "assistant", "content": "It is"}]
    for kw in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
        got, _ = protocol.chat_call(ChatCompletionRequest(messages=plain, **kw), chat, MAX_LEN * 2)
        assert got == hf_rendering(tok, plain, **kw), kw


def test_what_vllm_serve_refuses_in_a_chat_request_is_refused_with_its_words(chat):
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (ChatCompletionRequest(messages=hi, tools=TOOLS), '"auto" tool choice requires --enable-auto-tool-choice'),
        (ChatCompletionRequest(messages=hi, chat_template="{{ 'x' }}"), "--trust-request-chat-template is not set"),
        (ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "is not a multimodal model"),
    ]
    for req, words in cases:
        with pytest.raises(protocol.BadRequest, match=words):
            protocol.chat_call(req, chat, MAX_LEN)
    forced = ChatCompletionRequest(messages=hi, tools=TOOLS, tool_choice="required")
    with pytest.raises(protocol.BadRequest, match='tool_choice="required" requires --tool-call-parser'):
        protocol.chat_call(forced, chat, MAX_LEN)


def test_a_forced_tool_choice_holds_the_output_to_the_tools_format_and_reads_the_calls_back(tok, parsing):
    """``tool_choice: required`` or a named function: vLLM's renderer constrains the output to the tools (for
    hermes, a structural tag: ``<tool_call>`` blocks whose arguments follow the tool's JSON schema, as
    ``vllm serve`` does), which goes to the engine in the sampling; the calls are read back by the parser
    (``required``: finish reason ``tool_calls``; a named call ends ``stop``, as OpenAI's API)."""
    req = ChatCompletionRequest(messages=TRANSCRIPT[:2], tools=TOOLS, tool_choice="required")
    _, sampling = protocol.chat_call(req, parsing, MAX_LEN * 2)
    tag = sampling["structured_outputs"].structural_tag
    assert '"at_least_one": true' in tag and "get_weather" in tag
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tuple(tok.encode(text))
    res = GenerationResult("r-1", (1, 2, 3), (Completion(ids, (-0.5,) * len(ids), "stop", text=text),), 2, 3,
                           slot=4, incarnation=2, version_spans=((3, 0, len(ids)),))
    choice = protocol.chat_response(req, "m", [done(res)], tok, renderer=parsing)["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"
    named = ChatCompletionRequest(messages=TRANSCRIPT[:2], tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _, sampling = protocol.chat_call(named, parsing, MAX_LEN * 2)
    assert "get_weather" in (sampling["structured_outputs"].structural_tag or str(sampling["structured_outputs"].json))
    choice = protocol.chat_response(named, "m", [done(res)], tok, renderer=parsing)["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == "stop"


def test_a_trusted_request_template_is_used(tok, tiny_model):
    from rlfleet.serve.render import ChatOptions, ChatRenderer

    trusting = ChatRenderer(tiny_model, MAX_LEN, tok, ChatOptions(trust_request_chat_template=True))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")
    prompt, _ = protocol.chat_call(req, trusting, MAX_LEN)
    assert tok.decode(prompt) == "<hi>"


def test_tool_calls_and_reasoning_are_read_back_by_vllms_parsers(tok, parsing):
    """``--tool-call-parser hermes --reasoning-parser qwen3``: the completion's text comes back as
    ``reasoning``, ``content`` and ``tool_calls`` (finish reason ``tool_calls``), its token ids kept."""
    text = 'thinking it over</think>Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tuple(tok.encode(text))
    res = GenerationResult("r-1", (1, 2, 3), (Completion(ids, (-0.5,) * len(ids), "stop", text=text),), 2, 3,
                           slot=4, incarnation=2, version_spans=((3, 0, len(ids)),))
    req = ChatCompletionRequest(messages=TRANSCRIPT[:2], tools=TOOLS)
    body = protocol.chat_response(req, "m", [done(res)], tok, renderer=parsing)
    choice = body["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    assert choice["message"]["reasoning"] == "thinking it over" and choice["message"]["content"] == "Let me look."
    assert choice["finish_reason"] == "tool_calls" and choice["token_ids"] == list(ids)
    quiet = ChatCompletionRequest(messages=TRANSCRIPT[:2], tools=TOOLS, include_reasoning=False)
    assert "reasoning" not in protocol.chat_response(quiet, "m", [done(res)], tok, renderer=parsing)["choices"][0]["message"]
    plain = protocol.chat_response(ChatCompletionRequest(messages=TRANSCRIPT[:2]), "m", [done(res)], tok, renderer=parsing)
    assert "tool_calls" not in plain["choices"][0]["message"] and plain["choices"][0]["finish_reason"] == "stop"


def test_chat_flags_vllm_does_not_know_are_refused_naming_the_flag():
    from rlfleet.serve.render import ChatOptions

    for options, flag in ((ChatOptions(tool_call_parser="nope"), "--tool-call-parser"),
                          (ChatOptions(reasoning_parser="nope"), "--reasoning-parser"),
                          (ChatOptions(enable_auto_tool_choice=True), "--enable-auto-tool-choice")):
        with pytest.raises(ValueError, match=flag):
            options.check()


def test_a_chat_request_is_rendered_with_the_models_chat_template(tok, chat):
    assert tok.chat_template == CHAT_TEMPLATE
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
                                          {"role": "user", "content": "again"}],
                                max_completion_tokens=4, logprobs=True, top_logprobs=3)
    prompt, sampling = protocol.chat_call(req, chat, MAX_LEN)
    assert tok.decode(prompt) == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi"
                                  "<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert sampling["max_tokens"] == 4 and sampling["logprobs"] == 3


# ------------------------------------------------------------------ responses
def done(res: GenerationResult, attempts: int = 1, continued: int = 0) -> FleetResult:
    return FleetResult(res.request_id, "completed", res, attempts=attempts, continued=continued)


def test_a_completion_response_is_tagged_with_versions_engine_and_token_ids(tok):
    body = protocol.completion_response(CompletionRequest(prompt=[1, 2, 3], logprobs=1), "m",
                                        [done(result(2), attempts=2)], tok)
    assert body["rlfleet"] == {"weight_version": 3, "version_start": 2, "slot": 4, "incarnation": 2,
                               "request_id": "r-1", "attempts": 2, "continued": 0, "version_spans": [[3, 0, 3]],
                               "mixed_versions": False}
    assert [c["token_ids"] for c in body["choices"]] == [[10, 11, 12], [11, 11, 12]]
    assert body["choices"][0]["text"] == tok.decode([10, 11, 12])  # no engine text: decoded by the front
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -1.0, -1.5] and len(lp["top_logprobs"]) == 3
    assert len(lp["top_logprobs"][0]) == 1  # k=1 of the two the engine sent
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_the_engines_own_text_is_preferred_and_chat_logprobs_carry_top_k(tok):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2)
    body = protocol.chat_response(req, "m", [done(result(text="engine text"))], tok)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "engine text"}
    assert [len(c["top_logprobs"]) for c in choice["logprobs"]["content"]] == [2, 1, 1]
    assert body["rlfleet"]["weight_version"] == 3


def test_n_choices_are_n_fleet_requests_of_one_seeded_apart_and_answered_as_one_response(tok):
    _, sampling = protocol.completion_call(CompletionRequest(prompt=[1], n=3, seed=7, max_tokens=4), tok, MAX_LEN)
    assert protocol.choice_samplings(sampling) == [{"seed": 7 + i, "max_tokens": 4, "logprobs": None} for i in range(3)]
    assert protocol.choice_samplings({"n": 2, "max_tokens": 4}) == [{"max_tokens": 4}] * 2  # unseeded: as sent
    assert protocol.choice_samplings({"max_tokens": 4}) == [{"max_tokens": 4}]
    a = done(GenerationResult("r-1-0", (1, 2), (Completion((5, 6), (-1.0, -1.0), "length", text="ab"),), 3, 3, 0, 1,
                              version_spans=((3, 0, 2),)))
    b = done(GenerationResult("r-1-1", (1, 2), (Completion((7,), (-1.0,), "stop", text="c"),), 3, 4, 1, 2,
                              version_spans=((3, 0, 1),)), attempts=2, continued=1)
    body = protocol.completion_response(CompletionRequest(prompt=[1, 2], n=2), "m", [a, b], tok)
    assert [(c["index"], c["text"], c["token_ids"]) for c in body["choices"]] == [(0, "ab", [5, 6]), (1, "c", [7])]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    tag = body["rlfleet"]
    assert (tag["version_start"], tag["weight_version"], tag["attempts"], tag["continued"]) == (3, 4, 3, 1)
    assert [c["request_id"] for c in tag["choices"]] == ["r-1-0", "r-1-1"] and tag["choices"][1]["slot"] == 1
    chat = protocol.chat_response(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=2), "m",
                                  [a, b], tok)
    assert chat["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}  # the prompt once, as vLLM


# ------------------------------------------------------------------ a returned request, as HTTP
class _Client:
    def __init__(self, state: RoutingState) -> None:
        self.state = state

    def routing(self) -> RoutingState:
        return self.state

    def counters(self) -> dict:
        return {"accepted": 0, "completed": 0, "returned": 0, "in_progress": 0, "requeued": 0, "refused": {}}


def returned(reason: str) -> FleetResult:
    return FleetResult("r-9", "returned", None, reason)


def test_returned_requests_become_400_for_the_caller_and_503_naming_why_for_the_fleet(tok):
    closed = Front(_Client(RoutingState(5, False, 2, reason="refit of version 3")), tok, "m", MAX_LEN)
    out = closed.returned(returned("bad request: request r-9 rejected by vLLM: Token id 999 is out of vocabulary"))
    assert (out.code, out.message, out.param) == (400, "Token id 999 is out of vocabulary", None)
    out = closed.returned(returned("bad request: request r-9 rejected by vLLM: Requested sample logprobs of 100, "
                                   "which is greater than max allowed: 20 (parameter=logprobs, value=100)"))
    assert (out.code, out.param) == (400, "logprobs") and out.message.startswith("Requested sample logprobs")
    out = closed.returned(returned("poison: its attempts took down 2 engines (slot 0 (incarnation 1), slot 1 "
                                   "(incarnation 1)); fingerprint 0123abcd; not sent again, and refused for 600 s"))
    assert out.code == 400 and "fingerprint 0123abcd" in out.message  # the request's own fault: not a 503 to retry
    out = closed.returned(returned("no serving shard within the request timeout (60 s)"))
    assert out.code == 503 and "the gate is closed: refit of version 3" in out.message
    stopped = Front(_Client(RoutingState(6, False, 2, stopped="FleetExhausted: slots 0, 1 dead")), tok, "m", MAX_LEN)
    out = stopped.returned(returned("fleet stopped: FleetExhausted: slots 0, 1 dead"))
    assert out.code == 503 and "slots 0, 1 dead" in out.message
    assert stopped.health() == (503, {"gate_open": False, "version": 2, "epoch": 6, "serving": 0,
                                      "status": "stopped", "reason": "FleetExhausted: slots 0, 1 dead"})
    assert stopped.readiness() == stopped.health()
    # a closed gate (a refit): alive (/health 200), not ready (/ready 503 naming why)
    assert closed.health()[0] == 200 and closed.readiness()[0] == 503
    assert closed.health()[1] == closed.readiness()[1] and closed.readiness()[1]["reason"] == "refit of version 3"


def test_every_503_says_when_to_retry(tok):
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import RETRY_AFTER_S, RETRY_AFTER_STOPPED_S, build_app

    closed = TestClient(build_app(Front(_Client(RoutingState(5, False, 2, reason="refit of version 3")), tok, "m", MAX_LEN)))
    assert closed.get("/health").status_code == 200 and "retry-after" not in closed.get("/health").headers
    ready = closed.get("/ready")
    assert ready.status_code == 503 and ready.headers["retry-after"] == str(RETRY_AFTER_S)
    assert closed.head("/ready").status_code == 503
    gone = TestClient(build_app(Front(_Client(RoutingState(6, False, 2, stopped="FleetExhausted")), tok, "m", MAX_LEN)))
    for path in ("/health", "/ready"):
        r = gone.get(path)
        assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_STOPPED_S), path


def test_prometheus_text_has_the_fleets_gauges_and_the_fronts_counters(tok):
    front = Front(_Client(RoutingState(5, True, 2)), tok, "m", MAX_LEN)
    front.count("/v1/completions", 200)
    front.count("/v1/completions", 200)
    front.latencies.append(0.25)
    status = {"ledger": {"slots": [{"state": "healthy"}, {"state": "healthy"}, {"state": "dead"}]},
              "refits": 4, "generation": 1, "target_size": 3}
    text = front.metrics.exposition(status).decode()
    lines = set(text.splitlines())
    assert 'rlfleet_http_responses_total{code="200",endpoint="/v1/completions"} 2.0' in lines
    assert {"rlfleet_gate_open 1.0", "rlfleet_weight_version 2.0", 'rlfleet_engines{state="healthy"} 2.0',
            'rlfleet_engines{state="dead"} 1.0', "rlfleet_refits_total 4.0", "rlfleet_controller_up 1.0",
            'rlfleet_http_request_seconds{quantile="0.5"} 0.25'} <= lines
    down = front.metrics.exposition(None).decode()
    assert "rlfleet_controller_up 0.0" in down and "rlfleet_engines" not in down
    for line in text.splitlines():  # every sample line parses: name{labels} value
        if not line.startswith("#"):
            assert not math.isnan(float(line.rsplit(" ", 1)[1]))


# ------------------------------------------------------------------ a client that leaves
def test_a_cancelled_request_is_aborted_on_its_shard_and_counted_returned(model_dir):
    async def go():
        ctl, door, _ = make(model_dir)
        door.gen_delay = 5.0  # long enough that the caller leaves while it runs
        await ctl.start()
        c = client(ctl)
        task = asyncio.ensure_future(c.generate_async([1, 2, 3], {"max_tokens": 4}))
        await asyncio.sleep(0.5)
        running = [(s.slot, rid) for s in door.shards.values() for rid in s.in_flight]
        assert len(running) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        slot, rid = running[0]
        assert ("abort", slot, 1) in door.calls
        assert not any(s.in_flight for s in door.shards.values())  # the engine stopped spending on it
        counters = c.counters()
        assert (counters["accepted"], counters["returned"], counters["in_progress"]) == (1, 1, 0)
        assert c.dispatcher.returned_reasons["cancelled by the caller"] == 1
        await ctl.shutdown()

    run(go())


async def _one_running(model_dir, tok, gen_delay: float):
    """A started fleet of fakes whose generations take ``gen_delay``, its front, and one request running."""
    ctl, door, _ = make(model_dir)
    door.gen_delay = gen_delay
    await ctl.start()
    front = Front(client(ctl), tok, "m", MAX_LEN)
    task = asyncio.ensure_future(front.run([1, 2, 3], {"max_tokens": 4}))
    await asyncio.sleep(0.1)
    return ctl, door, front, task


def test_a_request_still_running_when_the_server_stops_is_aborted_and_answered_503_not_dropped(model_dir, tok):
    """uvicorn ends requests still running at its graceful-shutdown limit with a bare 500 (28 of 60 long
    requests when tried from outside). The front cuts them off first: aborted on the engine, answered 503
    saying why; one that finishes within the grace is answered normally; a new one is refused at once."""

    async def go():
        ctl, door, front, slow = await _one_running(model_dir, tok, gen_delay=5.0)
        await asyncio.sleep(0.4)
        running = [(s.slot, rid) for s in door.shards.values() for rid in s.in_flight]
        assert len(running) == 1 and front.in_flight == 1
        front.cut_off_after(1.0)
        late = await front.run([1, 2], {"max_tokens": 2})  # arrives after the stop began
        assert (late.code, late.kind) == (503, "ServiceUnavailableError") and "shutting down" in late.message
        out = await slow
        assert out.code == 503 and "shutting down" in out.message and "aborted on its engine" in out.message
        await asyncio.sleep(0.1)
        assert ("abort", running[0][0], 1) in door.calls and not any(s.in_flight for s in door.shards.values())
        counters = front.counters()
        assert (counters["in_flight"], counters["cut_off"], counters["cancelled"]) == (0, 1, 0)
        assert counters["client"]["in_progress"] == 0
        await ctl.shutdown()

    run(go())


def test_a_request_that_finishes_within_the_grace_is_answered_normally(model_dir, tok):
    async def go():
        ctl, _, front, task = await _one_running(model_dir, tok, gen_delay=0.5)
        front.cut_off_after(2.0)
        assert (await task).code == 200 and front.counters()["cut_off"] == 0
        await asyncio.sleep(2.5)  # the cut-off comes and finds nothing running
        assert front.counters()["cut_off"] == 0
        await ctl.shutdown()

    run(go())


def test_a_prompt_is_prepared_off_the_event_loop_that_routes_requests(tok):
    """A 5 MB text prompt took 6 s to tokenize on the routing loop: /health and every other request
    waited behind it. ``Front.prepare`` runs the tokenizer on its own thread; the loop keeps turning."""
    import time

    def slow_call(req, tokenizer, max_model_len):
        time.sleep(0.6)  # a tokenizer busy with a huge prompt (blocking, as the real one is)
        return [1, 2], {"max_tokens": 2}

    def refused(req, tokenizer, max_model_len):
        raise protocol.BadRequest("prompt is required and must not be empty", "prompt")

    async def go():
        front = Front(None, tok, "m", MAX_LEN)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        assert await front.prepare(slow_call, None) == ([1, 2], {"max_tokens": 2})
        t.cancel()
        assert ticks >= 20, ticks  # the loop ran all along (on the loop itself: 0 ticks)
        with pytest.raises(protocol.BadRequest) as err:
            await front.prepare(refused, None)
        assert err.value.param == "prompt"

    asyncio.run(go())


def test_a_text_longer_than_any_tokenization_of_the_context_is_refused_without_tokenizing():
    limit = MAX_LEN * protocol.MAX_CHARS_PER_TOKEN
    for body, field in (({"prompt": "a" * (limit + 1)}, "prompt"), ({"prompt": ["b" * (limit + 1)]}, "prompt")):
        with pytest.raises(protocol.BadRequest, match="maximum context length is 512 tokens") as err:
            protocol.refuse_text_beyond_the_context(CompletionRequest(**body), MAX_LEN)
        assert err.value.param == field
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "c" * (limit + 1)}])
    with pytest.raises(protocol.BadRequest) as err:
        protocol.refuse_text_beyond_the_context(chat, MAX_LEN)
    assert err.value.param == "messages"
    protocol.refuse_text_beyond_the_context(CompletionRequest(prompt="a" * (limit // 2)), MAX_LEN)  # may fit: tokenized
    protocol.refuse_text_beyond_the_context(CompletionRequest(prompt=list(range(10))), MAX_LEN)
    assert not protocol.needs_tokenizer(CompletionRequest(prompt=[1, 2, 3]))
    assert not protocol.needs_tokenizer(CompletionRequest(prompt=[[1, 2, 3]]))
    assert protocol.needs_tokenizer(CompletionRequest(prompt="hi")) and protocol.needs_tokenizer(chat)


def test_fastapis_own_answers_come_in_the_openai_error_shape_and_head_health_answers(tok):
    """404, 405 and a body that is not JSON (or none) were FastAPI's ``{"detail": ...}`` ("31: JSON decode
    error", "Field required"); HEAD /health was a 405. An OpenAI client reads ``error.message``."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    http = TestClient(build_app(Front(_Client(RoutingState(5, True, 2)), tok, "m", MAX_LEN)))
    r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"] == {"message": "no route /v1/nope", "type": "NotFoundError",
                                                          "param": None, "code": 404}
    r = http.delete("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "DELETE is not allowed on /v1/completions"
    assert "POST" in r.headers["allow"]
    r = http.post("/v1/completions", content=b'{"prompt": [1], oops}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON at character")
    r = http.post("/v1/completions", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is missing: send a JSON object"
    r = http.head("/health")
    assert r.status_code == 200 and r.content == b""


# ------------------------------------------------------------------ per-request weight-version policy
def test_a_request_names_its_weight_version_policy_in_its_body_or_a_header_and_a_bad_one_is_refused():
    from rlfleet.fleet.data.routing_state import VersionPolicy

    fleet_default = VersionPolicy.for_fleet(1)

    def req(**kw):
        return CompletionRequest(prompt=[1, 2], **kw)

    assert protocol.version_policy(req(), None, fleet_default) == fleet_default
    assert protocol.version_policy(req(rlfleet={"version_policy": "max_staleness=0"}), None, fleet_default) == \
        VersionPolicy("max_staleness", 0)
    assert protocol.version_policy(req(), " latest ", fleet_default) == VersionPolicy("latest")
    assert protocol.version_policy(req(rlfleet={"version_policy": {"max_staleness": 2}}), "max_staleness=2",
                                   fleet_default) == VersionPolicy("max_staleness", 2), "both, agreeing"
    bad = [({"rlfleet": {"version_policy": "newest"}}, None, "rlfleet.version_policy"),
           ({}, "max_staleness=-1", protocol.POLICY_HEADER),
           ({"rlfleet": {"version_policy": "latest"}}, "any", "rlfleet.version_policy"),
           ({"rlfleet": {"policy": "latest"}}, None, "rlfleet.policy"),
           ({"rlfleet": "latest"}, None, "rlfleet")]
    for kw, header, param in bad:
        with pytest.raises(protocol.BadRequest) as err:
            protocol.version_policy(req(**kw), header, fleet_default)
        assert err.value.param == param, (kw, header, err.value)


class _Capturing(_Client):
    """A fleet client that completes every request at once and keeps the policy each was sent with."""

    def __init__(self) -> None:
        from rlfleet.fleet.data.routing_state import VersionPolicy

        super().__init__(RoutingState(5, True, 2))
        self.policy = VersionPolicy.for_fleet(1)
        self.sent: list = []

    async def generate_async(self, prompt, sampling=None, request_id=None, policy=None, on_tokens=None):
        self.sent.append(policy)
        self.prompts = getattr(self, "prompts", []) + [(list(prompt), dict(sampling or {}))]
        seed = int((sampling or {}).get("seed") or 0)
        gen = GenerationResult(request_id or "r", tuple(prompt), (Completion((100 + seed,), (-0.5,), "length"),), 2, 3,
                               slot=1, incarnation=1, version_spans=((3, 0, 1),))
        return done(gen)


def test_the_policy_goes_with_each_fleet_request_and_comes_back_in_the_response(tok):
    from fastapi.testclient import TestClient

    from rlfleet.fleet.data.routing_state import VersionPolicy
    from rlfleet.serve.app import build_app

    client = _Capturing()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN)))
    r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "n": 2},
                  headers={protocol.POLICY_HEADER: "max_staleness=0"})
    assert r.status_code == 200 and r.headers[protocol.POLICY_HEADER] == "max_staleness=0"
    assert r.json()["rlfleet"]["version_policy"] == "max_staleness=0"
    assert client.sent == [VersionPolicy("max_staleness", 0)] * 2, "each of the n choices"
    plain = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
    assert plain.json()["rlfleet"]["version_policy"] == "max_staleness=1" and client.sent[-1] == client.policy
    bad = http.post("/v1/completions", json={"prompt": [1, 2], "rlfleet": {"version_policy": "newest"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rlfleet.version_policy"
    assert len(client.sent) == 3, "a refused request never reaches the fleet"


@pytest.mark.parametrize("body,param", [({"use_beam_search": True}, "use_beam_search"), ({"priority": 3}, "priority"),
                                        ({"cache_salt": "s"}, "cache_salt"), ({"best_guess": 1}, "best_guess")])
def test_a_field_the_front_would_not_honour_is_refused_naming_it(tok, body, param):
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    client = _Capturing()
    r = TestClient(build_app(Front(client, tok, "m", MAX_LEN))).post("/v1/completions", json={"prompt": [1, 2], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert client.sent == []


def test_an_api_key_guards_the_v1_routes_as_vllm_serve_does_and_the_request_id_comes_back(tok):
    """``--api-key``: every ``/v1`` route wants the Bearer token (vLLM's own middleware); liveness,
    readiness, metrics and version stay open. ``X-Request-Id`` (or the body's ``request_id``) names the
    response and comes back in the header."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    client = _Capturing()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN), api_keys=["k1", "k2"]))
    body = {"prompt": [1, 2], "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
        refused = http.post("/v1/completions", json=body, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["type"] == "AuthenticationError" and refused.json()["error"]["code"] == 401
        assert http.get("/v1/models", headers=headers).status_code == 401, headers
    assert client.sent == [], "refused before the fleet"
    ok = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer k2", "X-Request-Id": "abc-1"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "abc-1" and ok.json()["id"] == "cmpl-abc-1"
    assert ok.json()["rlfleet"]["request_id"] != "abc-1", "the fleet's own id stays unique"
    named = http.post("/v1/completions", json={**body, "request_id": "mine"}, headers={"Authorization": "Bearer k1"})
    assert named.json()["id"] == "cmpl-mine" and named.headers["x-request-id"]
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert http.get(path).status_code == 200, path
    assert http.get("/version").json()["vllm"]


def test_a_batch_of_prompts_is_answered_prompt_major_each_choice_with_its_prompt(tok):
    """``/v1/completions`` with a list of prompts (token ids or texts), ``n`` each: one fleet request per
    choice, the choices prompt-major as vLLM orders them, each with its prompt's token ids; the usage counts
    each prompt once. A batch cannot stream yet: refused naming ``stream``."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    client = _Capturing()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN)))
    r = http.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]], "n": 2, "seed": 10, "max_tokens": 1})
    assert r.status_code == 200, r.json()
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
    assert [c["token_ids"] for c in body["choices"]] == [[110], [111], [110], [111]], "seed + i within each prompt"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    texts = http.post("/v1/completions", json={"prompt": ["red sun", "blue"], "max_tokens": 1}).json()
    assert [c["prompt_token_ids"] for c in texts["choices"]] == [tok.encode("red sun"), tok.encode("blue")]
    # a max_tokens past the context is clamped to each prompt's own room, as vLLM's server clamps it
    http.post("/v1/completions", json={"prompt": [[1] * 10, [2] * 20], "max_tokens": MAX_LEN - 5})
    assert [s["max_tokens"] for _, s in client.prompts[-2:]] == [MAX_LEN - 10, MAX_LEN - 20]
    bad = http.post("/v1/completions", json={"prompt": [[1, 2], []]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.json()


def test_tokenize_and_detokenize_as_vllm_serve_answers_them(tok, chat):
    """vLLM's ``/tokenize`` (a prompt, or a conversation rendered as the chat endpoint renders it, tools
    included) and ``/detokenize``, with vLLM's request and response models."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    http = TestClient(build_app(Front(_Capturing(), tok, "m", MAX_LEN * 2, chat=chat)))
    r = http.post("/tokenize", json={"prompt": "red sun", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("red sun") and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN * 2
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    conv = http.post("/tokenize", json={"messages": TRANSCRIPT, "tools": TOOLS}).json()
    assert conv["tokens"] == hf_rendering(tok, TRANSCRIPT, TOOLS, add_generation_prompt=True)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "red sun"}
    bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_the_engines_logprobs_mode_is_a_fleet_setting_and_every_response_names_it(tok, tmp_path):
    """``engine.logprobs_mode`` goes to vLLM's engine arguments (``processed_logprobs``: the distribution the
    token was sampled from, after temperature and top-p); a value vLLM does not have is refused naming the
    field; the front says in each response which mode made its logprobs."""
    from fastapi.testclient import TestClient

    from rlfleet.fleet.config.engine import EngineConfig
    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.errors import ConfigError
    from rlfleet.serve.app import build_app

    (tmp_path / "config.json").write_text("{}")
    cfg = EngineConfig(model=str(tmp_path), logprobs_mode="processed_logprobs")
    assert cfg.engine_args()["logprobs_mode"] == "processed_logprobs"
    assert EngineConfig(model=str(tmp_path)).engine_args()["logprobs_mode"] == "raw_logprobs"
    with pytest.raises(ConfigError, match=r"engine\.logprobs_mode"):
        load_fleet_config({"engine": {"model": str(tmp_path), "logprobs_mode": "cooked"}})
    front = Front(_Capturing(), tok, "m", MAX_LEN)
    front.logprobs_mode = "processed_logprobs"
    r = TestClient(build_app(front)).post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "logprobs": 0})
    assert r.json()["rlfleet"]["logprobs_mode"] == "processed_logprobs"


def test_a_full_front_answers_429_at_once_a_bug_answers_json_and_every_request_has_its_access_line(tok, caplog):
    """Past ``max_pending`` HTTP requests in flight a request is answered 429 with ``Retry-After`` at once
    (not held); an unexpected error is a 500 in OpenAI's error shape; each request gets one access line
    naming its status and request id."""
    import logging

    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    client = _Capturing()
    front = Front(client, tok, "m", MAX_LEN)
    http = TestClient(build_app(front), raise_server_exceptions=False)
    front.max_pending, front.pending = 2, 2  # two requests already being answered
    full = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert full.status_code == 429 and full.headers["retry-after"] and "--max-pending 2" in full.json()["error"]["message"]
    assert client.sent == [] and front.counters()["responses"]["/v1/completions 429"] == 1
    front.pending = 0
    with caplog.at_level(logging.INFO, logger="rlfleet.serve"):
        ok = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers={"X-Request-Id": "r-77"})

        async def broken(*a, **kw):
            raise RuntimeError("a bug")

        client.generate_async = broken
        bug = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert ok.status_code == 200 and front.pending == 0
    assert bug.status_code == 500 and bug.json()["error"]["type"] == "InternalServerError" and "a bug" in bug.json()["error"]["message"]
    lines = [r.getMessage() for r in caplog.records if r.name == "rlfleet.serve.access"]
    assert any(line.startswith("POST /v1/completions 200 ") and line.endswith("id=r-77") for line in lines), lines
    assert any(" 500 " in line for line in lines), lines


def test_a_minus_infinite_logprob_is_floored_as_vllm_serve_does_and_return_token_ids_false_is_honoured(tok):
    """Under processed logprobs a top-k alternative can be -inf, which JSON cannot carry: it was a 500.
    vLLM's floor (-9999.0) is sent instead. ``return_token_ids: false`` drops the token ids (sent otherwise:
    a trainer needs them)."""
    inf = float("-inf")
    res = GenerationResult("r-1", (1, 2), (Completion((10, 11), (-0.5, inf), "length",
                                                      top_logprobs=({10: -0.5, 7: inf}, {11: inf})),), 2, 3,
                           slot=1, incarnation=1, version_spans=((3, 0, 2),))
    body = protocol.completion_response(CompletionRequest(prompt=[1, 2], logprobs=2), "m", [done(res)], tok)
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, protocol.LOGPROB_FLOOR]
    assert sorted(lp["top_logprobs"][0].values()) == [protocol.LOGPROB_FLOOR, -0.5]
    import json

    json.dumps(body, allow_nan=False)  # what the response encoder does: raises on -inf
    quiet = protocol.completion_response(CompletionRequest(prompt=[1, 2], return_token_ids=False), "m", [done(res)], tok)
    assert "token_ids" not in quiet["choices"][0] and "prompt_token_ids" not in quiet["choices"][0]
    chat = protocol.chat_response(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], return_token_ids=False),
                                  "m", [done(res)], tok)
    assert "token_ids" not in chat["choices"][0] and "prompt_token_ids" not in chat


def test_prompt_logprobs_are_sent_as_vllm_sends_them_and_tokens_can_be_named_by_id(tok):
    """``prompt_logprobs`` go to the engine and come back per prompt position (None for the first, a -inf
    floored), on each completion choice and once for a chat; ``return_tokens_as_token_ids`` names every
    logprob's token ``token_id:<id>``; a streamed request asking prompt logprobs is refused naming the field."""
    import json

    _, sampling = protocol.completion_call(CompletionRequest(prompt=[1, 2, 3], prompt_logprobs=1, max_tokens=2),
                                           tok, MAX_LEN)
    assert sampling["prompt_logprobs"] == 1
    plp = (None, {2: (-1.5, 3), 9: (-0.2, 1)}, {3: (float("-inf"), 7)})
    res = GenerationResult("r-1", (1, 2, 3), (Completion((10, 11), (-0.5, -0.7), "length",
                                                         top_logprobs=({10: -0.5, 7: -2.0}, {11: -0.7})),), 2, 3,
                           slot=1, incarnation=1, version_spans=((3, 0, 2),), prompt_logprobs=plp)
    req = CompletionRequest(prompt=[1, 2, 3], prompt_logprobs=1, logprobs=1, return_tokens_as_token_ids=True)
    body = json.loads(json.dumps(protocol.completion_response(req, "m", [done(res)], tok), allow_nan=False))
    choice = body["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1]["2"] == {"logprob": -1.5, "rank": 3, "decoded_token": tok.decode([2])}
    assert choice["prompt_logprobs"][2]["3"]["logprob"] == protocol.LOGPROB_FLOOR
    assert choice["logprobs"]["tokens"] == ["token_id:10", "token_id:11"]
    assert set(choice["logprobs"]["top_logprobs"][0]) == {"token_id:10"}
    chat_req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=1,
                                     prompt_logprobs=0, return_tokens_as_token_ids=True)
    chat = protocol.chat_response(chat_req, "m", [done(res)], tok)
    assert [c["token"] for c in chat["choices"][0]["logprobs"]["content"]] == ["token_id:10", "token_id:11"]
    assert chat["choices"][0]["logprobs"]["content"][0]["bytes"] == list(b"token_id:10")
    assert len(chat["prompt_logprobs"]) == 3
    plain = protocol.completion_response(CompletionRequest(prompt=[1, 2, 3], logprobs=0), "m",
                                         [done(dataclasses.replace(res, prompt_logprobs=None))], tok)
    assert "prompt_logprobs" not in plain["choices"][0] and plain["choices"][0]["logprobs"]["tokens"][0] != "token_id:10"
    with pytest.raises(protocol.BadRequest) as err:
        protocol.completion_call(CompletionRequest(prompt=[1, 2], prompt_logprobs=0, stream=True), tok, MAX_LEN)
    assert err.value.param == "prompt_logprobs"


def test_fields_a_request_leaves_unset_take_the_models_generation_config_as_vllm_serve_does(tok, tiny_model, tmp_path):
    """``generation_config.json``'s temperature, top_p and max_new_tokens (a chat's) fill what a request leaves unset (read
    by vLLM, as ``vllm serve`` reads them); what the request sets wins; the tiny model's own sets none."""
    import json
    import os

    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app
    from rlfleet.serve.render import ChatRenderer

    for name in os.listdir(tiny_model):
        if name != "generation_config.json":
            os.symlink(os.path.join(tiny_model, name), tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                                 "max_new_tokens": 7}))
    defaults = protocol.generation_defaults(ChatRenderer(str(tmp_path), MAX_LEN, tok).model_config)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert protocol.generation_defaults(ChatRenderer(tiny_model, MAX_LEN, tok).model_config) == {}
    (_, unset), = protocol.completion_calls(CompletionRequest(prompt=[1, 2]), tok, MAX_LEN, defaults)
    # a completion's max_tokens is 16 when unset (the field's own default, as in vllm serve); a chat's takes the config's
    assert (unset["temperature"], unset["top_p"], unset.get("max_tokens", 16)) == (0.6, 0.9, 16)
    (_, own), = protocol.completion_calls(CompletionRequest(prompt=[1, 2], temperature=1.0, max_tokens=3), tok,
                                          MAX_LEN, defaults)
    assert own.get("temperature", 1.0) == 1.0 and own["top_p"] == 0.9 and own["max_tokens"] == 3
    client = _Capturing()
    front = Front(client, tok, "m", MAX_LEN, chat=ChatRenderer(str(tmp_path), MAX_LEN, tok))
    front.sampling_defaults = defaults
    http = TestClient(build_app(front))
    assert http.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert [(s["temperature"], s.get("max_tokens", 16)) for _, s in client.prompts] == [(0.6, 16), (0.6, 7)]


def test_metrics_have_latency_ttft_and_queue_histograms_and_per_engine_series(tok):
    """``/metrics`` carries Prometheus histograms (end-to-end latency, time to first token, time queued at the
    front) with cumulative buckets, ``_sum`` and ``_count``, and per-slot counters of requests and tokens."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    client = _Capturing()
    http = TestClient(build_app(Front(client, tok, "m", MAX_LEN)))
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
    streamed = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "stream": True})
    assert streamed.status_code == 200
    lines = http.get("/metrics").text.splitlines()
    assert "# TYPE rlfleet_http_e2e_request_latency_seconds histogram" in lines
    assert 'rlfleet_http_e2e_request_latency_seconds_bucket{le="+Inf"} 4.0' in lines
    assert "rlfleet_http_e2e_request_latency_seconds_count 4.0" in lines
    assert "rlfleet_http_queue_time_seconds_count 4.0" in lines
    buckets = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("rlfleet_http_queue_time_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 4  # cumulative
    assert 'rlfleet_http_engine_requests_total{slot="1"} 4.0' in lines  # the capturing client's results: slot 1
    assert 'rlfleet_http_engine_generated_tokens_total{slot="1"} 4.0' in lines


def test_a_front_timeout_below_the_fleets_refit_budget_is_refused_and_one_at_or_above_it_is_its_clients(model_dir):
    """The front's own ``request_timeout_s`` (``HttpServer(request_timeout_s=)``, ``rlfleet serve --connect
    --request-timeout``) goes through the fleet config's validation: below the refit budget it is refused naming
    the flag and the field, before the front starts; at or above it, the front's client runs under it."""
    from types import SimpleNamespace

    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.errors import ConfigError
    from rlfleet.serve.server import HttpServer

    cfg = load_fleet_config({"engine": {"model": model_dir}, "refit_timeout_s": 60, "lifecycle_grace_s": 5})
    fleet = SimpleNamespace(config=cfg)
    with pytest.raises(ConfigError, match=r"--request-timeout \(request_timeout_s\): must be >= the refit budget.*"
                                          r"= 65 s.*\(got 1\.5\)"):
        HttpServer(fleet, port=0, request_timeout_s=1.5)
    assert HttpServer(fleet, port=0, request_timeout_s=65).client_config.request_timeout_s == 65
    assert HttpServer(fleet, port=0).client_config is cfg


def test_a_request_the_closed_gate_holds_past_its_timeout_gets_503_naming_why_then_the_front_serves_again(model_dir, tok):
    """What ``tests/integration/test_serve.py`` showed with a front timeout below the refit budget (a config now
    refused): a request held by a closed gate longer than its timeout is answered 503 naming why the gate is
    closed, after waiting the whole timeout. Here an operator's pause holds the gate (it has no deadline), with a
    timeout the fleet's config takes."""

    async def go():
        ctl, door, _ = make(model_dir, request_timeout_s=2.0)  # the refit budget is 0.4 s
        await ctl.start()
        front = Front(client(ctl), tok, "m", MAX_LEN)
        await ctl.pause("abort", 5.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        late = await front.run([1, 2, 3], {"max_tokens": 2})
        waited = loop.time() - t0
        await ctl.resume()
        again = await front.run([1, 2, 3], {"max_tokens": 2})
        await ctl.shutdown()
        return late, waited, again

    late, waited, again = run(go())
    assert late.code == 503 and "the gate is closed" in late.message and "pause" in late.message, late.message
    assert waited >= 2.0
    assert again.code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"])
@pytest.mark.parametrize("messages", [5, None, True])
def test_a_body_field_of_the_wrong_type_is_a_400_naming_it_even_where_a_vllm_validator_raises_typeerror(
        tok, chat, path, messages):
    """vLLM's ``check_system_message_content_type`` iterates ``messages`` before pydantic checks its type: an int
    (or null, or true) raised ``TypeError``, which pydantic lets through, and the caller got a 500."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    front = Front(_Client(RoutingState(5, True, 2)), tok, "m", MAX_LEN)
    front.chat = chat
    http = TestClient(build_app(front, scale_out=True), raise_server_exceptions=False)
    r = http.post(path, json={"model": "m", "messages": messages})
    assert r.status_code == 400, r.text
    assert "messages: Input should be" in r.json()["error"]["message"], r.json()
    assert "function-" not in r.json()["error"]["message"]
    if path != "/tokenize":
        r = http.post(path, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]  # pydantic's own check, as before


def test_a_validator_reading_a_field_of_the_wrong_type_is_a_400_naming_the_field(tok):
    """``{"structured_outputs": 5}`` was read with ``.get`` by a vLLM validator: ``AttributeError``, a 500."""
    from fastapi.testclient import TestClient

    from rlfleet.serve.app import build_app

    http = TestClient(build_app(Front(_Client(RoutingState(5, True, 2)), tok, "m", MAX_LEN)), raise_server_exceptions=False)
    r = http.post("/v1/completions", json={"prompt": [1, 2], "structured_outputs": 5})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("structured_outputs: "), r.json()
    r = http.post("/tokenize", json={"prompt": 5})  # a union body: its members' problems, without their schema tags
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: Input should be"), r.json()
    assert "function-" not in r.json()["error"]["message"]


def test_a_typeerror_no_single_field_explains_still_answers_400_naming_the_model():
    from pydantic import ValidationError, model_validator
    from pydantic import BaseModel

    from rlfleet.serve.bodies import checked

    class Odd(BaseModel):
        x: int = 0

        @model_validator(mode="before")
        @classmethod
        def _boom(cls, data):
            if isinstance(data, dict) and data.get("x") == 3:
                raise TypeError("three is not a number here")
            return data

    with pytest.raises(ValidationError, match="the request body does not fit Odd: three is not a number here"):
        checked(Odd).model_validate({"x": 3})
    assert isinstance(checked(Odd).model_validate({"x": 4}), Odd)


def test_a_weight_routes_long_call_the_servers_stop_cuts_off_is_answered_not_torn_down(tok):
    """A relay call still running when the server stopped (a trainer's rendezvous that never came) was cancelled by
    uvicorn at its shutdown limit: a traceback per call in the log, and no answer. ``until_stopped`` turns the
    server's cut-off into ``ServerStopping`` (the route answers 503); the caller leaving still cancels it."""
    from rlfleet.serve.front import ServerStopping

    async def go():
        front = Front(_Client(RoutingState(5, True, 2)), tok, "m", MAX_LEN)
        never = asyncio.get_running_loop().create_future()
        mine = asyncio.ensure_future(front.until_stopped(asyncio.sleep(30)))
        cut = asyncio.ensure_future(front.until_stopped(never))
        await asyncio.sleep(0.05)
        mine.cancel()  # its caller left: cancelled, as before
        await asyncio.sleep(0)
        assert mine.cancelled()
        front.cut_off_after(0.05)
        with pytest.raises(ServerStopping, match="cut off before it finished"):
            await cut
        assert cut.done()
        with pytest.raises(ServerStopping, match="nothing was done"):  # one that comes after the stop began
            await front.until_stopped(asyncio.sleep(0))

    asyncio.run(go())
