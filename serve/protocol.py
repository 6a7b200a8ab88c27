"""OpenAI requests in, fleet calls out; fleet results in, OpenAI responses out.

The request and response models are vLLM's own (``vllm.entrypoints.openai``), so a
request is validated exactly as ``vllm serve`` validates it and a bad one is refused
with vLLM's message. What is written here is the fleet's part only:

- which sampling fields a request sets, as the plain dict a shard turns back into
  ``SamplingParams`` (``sampling_of``: vLLM builds the params, the dict is what
  differs from vLLM's defaults, so nothing is re-derived here);
- the prompt's token ids (a chat request rendered by vLLM's own renderer, ``serve.render``);
- a request for ``n`` choices as ``n`` fleet requests of one (``choice_samplings``);
- the tags every response carries: the weight version the request started and
  finished under, the slot and incarnation that produced it, how many continuations
  it needed and which version sampled which tokens, and the completion's token ids
  (``rlfleet`` in the body, ``x-rlfleet-weight-version`` in the headers).

A streamed answer's events are ``serve.sse``'s; they use the logprob builders here.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from vllm.entrypoints.generate.base.protocol import ToolCall
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList, UsageInfo
from vllm.exceptions import VLLMClientError
from vllm.logprobs import Logprob
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.sampling_params import SamplingParams

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.fleet.types import Completion, GenerationResult, field_with_invalid_text

VERSION_HEADER = "x-rlfleet-weight-version"
# A logprob of -inf (a token the sampler could not have drawn, under processed logprobs) is not JSON: vLLM's
# server sends this floor instead, and so does this front
LOGPROB_FLOOR = -9999.0
# SamplingParams fields a shard never takes from a caller: how outputs are delivered is the backend's business.
_NOT_SAMPLING = frozenset({"output_kind", "skip_clone", "output_text_buffer_length", "stream_interval"})
_DEFAULTS = SamplingParams()


class BadRequest(ValueError):
    """A request the front refuses before routing it (HTTP 400); ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """The error body vLLM's server sends (``{"error": {"message", "type", "param", "code"}}``)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()


def models_body(model: str, max_model_len: int) -> dict:
    return ModelList(data=[ModelCard(id=model, root=model, owned_by="rlfleet", max_model_len=max_model_len)]).model_dump()


def sampling_of(params: SamplingParams) -> dict[str, Any]:
    """The fields of ``params`` that differ from vLLM's defaults: what a shard needs to rebuild them."""
    out = {}
    for name in params.__struct_fields__:
        if name.startswith("_") or name in _NOT_SAMPLING:
            continue
        value = getattr(params, name)
        if value != getattr(_DEFAULTS, name):
            out[name] = value
    return out


def _sampling(req: Any, prompt_len: int, max_model_len: int, requested_max: int | None,
              defaults: dict | None = None) -> dict[str, Any]:
    """The request's sampling dict. ``defaults``: the model's generation config (``generation_defaults``),
    which fills what the request leaves unset, ``max_tokens`` included, as ``vllm serve`` does."""
    defaults = defaults or {}
    room = max_model_len - prompt_len
    if room <= 0:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                         f"has {prompt_len} tokens, which leaves no room for the completion.", "prompt")
    if requested_max is None:
        requested_max = defaults.get("max_tokens")
    max_tokens = room if requested_max is None else min(requested_max, room)  # as vLLM's server clamps it
    try:
        params = req.to_sampling_params(max_tokens, dict(defaults))
    except (ValueError, TypeError, VLLMClientError) as exc:  # vLLM's own validation of the params
        raise BadRequest(str(exc), getattr(exc, "parameter", None)) from None
    out = sampling_of(params)
    # said even when None: a shard computes the sampled tokens' logprobs unless told not to (a trainer
    # always wants them); an HTTP client that did not ask gets none, and the engine spends nothing on them
    out["logprobs"] = params.logprobs
    return out


def generation_defaults(model_config: Any) -> dict[str, Any]:
    """The sampling defaults of the model's ``generation_config.json`` (temperature, top_p, top_k, min_p,
    penalties, ``max_new_tokens`` as ``max_tokens``), read by vLLM as ``vllm serve`` reads them."""
    return dict(model_config.get_diff_sampling_param())


def refuse_invalid_text(req: Any) -> None:
    """A request whose text holds a lone surrogate is refused naming the field (``param``)."""
    bad = field_with_invalid_text(vars(req))
    if bad is not None:
        raise BadRequest(f"{bad} holds text that is not valid Unicode (a lone surrogate such as \\ud800)", bad)


# ---------------------------------------------------------------------------------------------- prompts
def completion_prompts(req: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt (a batch is a list of texts or of token-id lists, as vLLM takes it):
    token ids as given, or the text tokenized as vLLM would (special tokens added)."""
    p = req.prompt
    if p is None or p == "" or p == []:
        raise BadRequest("prompt is required and must not be empty", "prompt")
    batch = p if isinstance(p, list) and isinstance(p[0], (list, str)) else [p]
    out = []
    for i, one in enumerate(batch):
        if one == "" or one == []:
            raise BadRequest(f"prompt[{i}] is empty" if len(batch) > 1 else "prompt is required and must not be empty",
                             "prompt")
        out.append(list(tokenizer.encode(one, add_special_tokens=req.add_special_tokens)) if isinstance(one, str)
                   else [int(t) for t in one])
    return out


def chat_prompt(req: ChatCompletionRequest, renderer: Any) -> list[int]:
    """The conversation rendered as ``vllm serve`` renders it (``serve.render.ChatRenderer``: vLLM's own
    renderer, with the request's tools, tool calls, tool results and template arguments)."""
    if not req.messages:
        raise BadRequest("messages must not be empty", "messages")
    return renderer.render(req)


# Fields vLLM's request models accept that this front does not carry out: a request that sets one is
# refused naming it, rather than answered as if the field had been honoured (field, "is it set?").
UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("use_beam_search", bool),
    ("priority", bool),  # the fleet schedules by its own admission, not per-request priority
    ("cache_salt", lambda v: v is not None),  # the fleet salts the prefix cache per weight version itself
    ("echo", bool),
    ("suffix", lambda v: v is not None),
    ("truncate_prompt_tokens", lambda v: v is not None),
    ("prompt_embeds", lambda v: v is not None),
    ("documents", lambda v: v is not None),
    ("mm_processor_kwargs", lambda v: v is not None),
)


def refuse_unsupported(req: Any) -> None:
    """A field vLLM's models accept that this front does not carry out, or one no model declares (vLLM's
    server would log and ignore it): refused naming it. ``rlfleet`` is this front's own namespace."""
    for field, is_set in UNSUPPORTED:
        if is_set(getattr(req, field, None)):
            raise BadRequest(f"{field} is not supported by rlfleet serve", field)
    unknown = sorted(k for k in (req.model_extra or {}) if k != FLEET_FIELD)
    if unknown:
        raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not part of "
                         f"this endpoint's request (rlfleet serve ignores nothing it is sent)", unknown[0])


def refuse_streamed_prompt_logprobs(req: Any) -> None:
    """``prompt_logprobs`` come in the whole response only (vLLM refuses most streamed ones too)."""
    if req.stream and req.prompt_logprobs is not None:
        raise BadRequest("prompt_logprobs are not available when stream is true: send stream: false",
                         "prompt_logprobs")


FLEET_FIELD = "rlfleet"  # the request body's namespace for what only a fleet has
POLICY_HEADER = "x-rlfleet-version-policy"


def version_policy(req: Any, header: str | None, default: Any) -> Any:
    """The request's weight-version policy (``fleet.data.routing_state.VersionPolicy``): the body's
    ``rlfleet.version_policy`` or the ``x-rlfleet-version-policy`` header (``latest``, ``any``,
    ``max_staleness=K``), ``default`` (the fleet's) when neither is sent. Both sent and different, an
    unknown key in ``rlfleet``, or a policy that does not parse: ``BadRequest`` naming the field."""
    from rlfleet.fleet.data.routing_state import VersionPolicy

    block = (req.model_extra or {}).get(FLEET_FIELD)
    if block is not None and not isinstance(block, dict):
        raise BadRequest(f"{FLEET_FIELD} must be an object (e.g. {{\"version_policy\": \"max_staleness=0\"}})",
                         FLEET_FIELD)
    extra = sorted(set(block or {}) - {"version_policy"})
    if extra:
        raise BadRequest(f"{FLEET_FIELD}.{extra[0]} is not a field of rlfleet (only version_policy)",
                         f"{FLEET_FIELD}.{extra[0]}")
    body = (block or {}).get("version_policy")
    try:
        from_body = None if body is None else VersionPolicy.parse(body)
        from_header = None if header is None else VersionPolicy.parse(header.strip())
    except ValueError as exc:
        where = f"{FLEET_FIELD}.version_policy" if body is not None else POLICY_HEADER
        raise BadRequest(f"{where}: {exc}", where) from None
    if from_body is not None and from_header is not None and from_body != from_header:
        raise BadRequest(f"{FLEET_FIELD}.version_policy ({from_body.describe()}) and the {POLICY_HEADER} header "
                         f"({from_header.describe()}) disagree: send one", f"{FLEET_FIELD}.version_policy")
    return from_body or from_header or default


# No tokenizer in use packs more characters than this into one token on average: a text longer than this
# many characters per token of the context cannot fit, and is refused before the tokenizer spends
# seconds on it (a 5 MB prompt took 6 s on the tiny model's).
MAX_CHARS_PER_TOKEN = 64


def needs_tokenizer(req: Any) -> bool:
    """False for a completion whose prompt is token ids, or a request that is nothing but token ids (vLLM's
    ``GenerateRequest``): nothing to tokenize or render."""
    if isinstance(req, CompletionRequest):
        p = req.prompt
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and isinstance(p[0], str))
    return hasattr(req, "messages")


def refuse_text_beyond_the_context(req: Any, max_model_len: int) -> None:
    """A prompt (or a conversation) of more characters than the context could hold at
    ``MAX_CHARS_PER_TOKEN``: refused naming the field, without tokenizing it."""
    if not needs_tokenizer(req):
        return
    if isinstance(req, CompletionRequest):
        p = req.prompt
        texts = [p] if isinstance(p, str) else [x for x in p if isinstance(x, str)] if isinstance(p, list) else []
        field, chars = "prompt", sum(len(t) for t in texts)
    else:
        field, chars = "messages", len(json.dumps(req.messages, ensure_ascii=False, default=str))
    if chars > max_model_len * MAX_CHARS_PER_TOKEN:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens; your {field} has "
                         f"{chars} characters, more than any tokenization of it could fit "
                         f"(over {MAX_CHARS_PER_TOKEN} per token)", field)


def completion_calls(req: CompletionRequest, tokenizer: Any, max_model_len: int,
                     defaults: dict | None = None) -> list[tuple[list[int], dict]]:
    """(prompt ids, sampling) per prompt of the request, in order (a batch: several; ``max_tokens`` left
    unset is each prompt's own room in the context, as vLLM's server computes it; ``defaults``: the model's
    generation config, for what the request leaves unset)."""
    refuse_unsupported(req)  # before the tokenizer spends anything on a request it would refuse
    refuse_streamed_prompt_logprobs(req)
    prompts = completion_prompts(req, tokenizer)
    return [(p, _sampling(req, len(p), max_model_len, req.max_tokens, defaults)) for p in prompts]


def completion_call(req: CompletionRequest, tokenizer: Any, max_model_len: int) -> tuple[list[int], dict]:
    """``completion_calls`` of a request with one prompt."""
    (one,) = completion_calls(req, tokenizer, max_model_len)
    return one


def chat_call(req: ChatCompletionRequest, renderer: Any, max_model_len: int,
              defaults: dict | None = None) -> tuple[list[int], dict]:
    """As ``completion_call``, the prompt rendered by ``renderer`` (``serve.render.ChatRenderer``)."""
    refuse_unsupported(req)
    refuse_streamed_prompt_logprobs(req)
    prompt = chat_prompt(req, renderer)
    # ``max_tokens`` is deprecated for chat (read from the fields, so that reading it warns no one)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.__dict__.get("max_tokens")
    return prompt, _sampling(req, len(prompt), max_model_len, requested, defaults)


def chat_calls(req: ChatCompletionRequest, renderer: Any, max_model_len: int,
               defaults: dict | None = None) -> list[tuple[list[int], dict]]:
    """``chat_call`` as the one job of ``completion_calls``' shape."""
    return [chat_call(req, renderer, max_model_len, defaults)]


# ---------------------------------------------------------------------------------------------- choices
def choice_samplings(sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """One sampling dict per choice: a request for ``n`` choices is sent as ``n`` fleet requests of one (the
    seed, when given, ``seed + i`` for choice ``i``, as ``FleetClient.group_async`` does). Each choice is then
    its own request to the fleet: routed on its own, and continued on another engine if its own dies (the
    fleet does not continue a request of ``n > 1``)."""
    n = int(sampling.get("n") or 1)
    base = {k: v for k, v in sampling.items() if k != "n"}
    out = []
    for i in range(n):
        s = dict(base)
        if i and s.get("seed") is not None:
            s["seed"] = int(s["seed"]) + i
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------------- responses
def completed(fr: FleetResult | None) -> GenerationResult:
    """The result of a completed fleet request: what every answer is built from (``FleetResult.ok``, an
    ``Outcome`` of code 200)."""
    assert fr is not None and fr.result is not None, "an answer is built only from a completed request"
    return fr.result


def tags(result: GenerationResult, request_id: str, attempts: int) -> dict[str, Any]:
    """What the fleet adds to every response: which weights, which engine, which request."""
    return {"weight_version": result.weight_version, "version_start": result.version_start,
            "slot": result.slot, "incarnation": result.incarnation, "request_id": request_id,
            "attempts": attempts}


def fleet_block(fr: FleetResult) -> dict[str, Any]:
    """The ``rlfleet`` block of one completed fleet request: ``tags``, how many continuations it needed
    (``continued``: an engine died under it and another carried on from its tokens), and which weight
    version sampled which of its tokens (``version_spans``: ``[version, start, end)`` over the completion's
    token indexes; ``mixed_versions`` when more than one did)."""
    res = completed(fr)
    block = tags(res, fr.request_id, fr.attempts)
    block.update(continued=fr.continued, version_spans=[list(s) for s in res.version_spans],
                 mixed_versions=res.mixed_versions)
    return block


def group_block(frs: list[FleetResult]) -> dict[str, Any]:
    """The ``rlfleet`` block of a response: one choice's own block; with ``n > 1`` (one fleet request per
    choice) the versions span every choice (``version_start`` the earliest, ``weight_version`` the latest),
    ``attempts`` and ``continued`` are summed, slot, incarnation and request id are choice 0's, and
    ``choices`` holds each choice's own block."""
    if len(frs) == 1:
        return fleet_block(frs[0])
    each = [fleet_block(fr) for fr in frs]
    block = {k: v for k, v in each[0].items() if k != "version_spans"}
    block.update(weight_version=max(b["weight_version"] for b in each),
                 version_start=min(b["version_start"] for b in each),
                 attempts=sum(b["attempts"] for b in each), continued=sum(b["continued"] for b in each),
                 mixed_versions=any(b["mixed_versions"] for b in each), choices=each)
    return block


def _text(c: Completion, tokenizer: Any, skip_special: bool) -> str:
    return c.text if c.text is not None else tokenizer.decode(list(c.token_ids), skip_special_tokens=skip_special)


def usage(prompt_len: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                     total_tokens=prompt_len + completion_tokens)


def _usage(frs: list[FleetResult], n: int = 1) -> UsageInfo:
    """Each prompt once (its ``n`` choices share it; choices come prompt-major), the tokens of every choice."""
    return usage(sum(len(completed(fr).prompt_token_ids) for fr in frs[::max(1, n)]),
                 sum(len(c.token_ids) for fr in frs for c in completed(fr).completions))


def token_id_name(token_id: int) -> str:
    """A token named by its id, as vLLM names it under ``return_tokens_as_token_ids`` (no text to decode)."""
    return f"token_id:{int(token_id)}"


def completion_logprobs(token_ids: Any, logprobs: Any, top_logprobs: Any, tokenizer: Any, k: int | None,
                        offset: int = 0, as_ids: bool = False) -> tuple[CompletionLogProbs | None, int]:
    """The completion format's logprobs of these tokens (top ``k`` of what the engine sent), their text
    offsets counted from ``offset``; and the offset after them (a stream's next delta starts there).
    ``as_ids``: tokens named ``token_id:<id>`` (the request's ``return_tokens_as_token_ids``)."""
    if k is None:
        return None, offset
    ids = list(token_ids)
    name = token_id_name if as_ids else tokenizer.convert_ids_to_tokens
    tokens = [token_id_name(t) for t in ids] if as_ids else tokenizer.convert_ids_to_tokens(ids)
    top: list[dict[str, float] | None] | None = None
    if k > 0 and top_logprobs is not None:
        top = [{name(t): max(lp, LOGPROB_FLOOR)
                for t, lp in sorted(d.items(), key=lambda kv: -kv[1])[:k]} for d in top_logprobs]
    offsets = []
    for t in ids:
        offsets.append(offset)
        offset += len(tokenizer.decode([t]))
    return CompletionLogProbs(text_offset=offsets, token_logprobs=[max(lp, LOGPROB_FLOOR) for lp in logprobs],
                              tokens=tokens,
                              top_logprobs=top or [None] * len(tokens)), offset


def chat_logprobs(token_ids: Any, logprobs: Any, top_logprobs: Any, tokenizer: Any, want: bool,
                  k: int | None, as_ids: bool = False) -> ChatCompletionLogProbs | None:
    """The chat format's logprobs of these tokens (top ``k`` of what the engine sent); ``as_ids`` as in
    ``completion_logprobs``."""
    if not want:
        return None
    name = token_id_name if as_ids else (lambda t: tokenizer.decode([t]))
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        tops = []
        if k and top_logprobs is not None and i < len(top_logprobs):
            for tt, tlp in sorted(top_logprobs[i].items(), key=lambda kv: -kv[1])[:k]:
                s = name(tt)
                tops.append(ChatCompletionLogProb(token=s, logprob=max(tlp, LOGPROB_FLOOR), bytes=list(s.encode())))
        s = name(t)
        content.append(ChatCompletionLogProbsContent(token=s, logprob=max(lp, LOGPROB_FLOOR), bytes=list(s.encode()),
                                                     top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs(result: GenerationResult, tokenizer: Any) -> list[dict[int, Logprob] | None] | None:
    """The prompt's logprobs as vLLM's server sends them (``{token id: Logprob}`` per position, ``None`` for
    the first; a ``-inf`` floored), when the request asked for ``prompt_logprobs``."""
    if result.prompt_logprobs is None:
        return None
    return [None if d is None else {t: Logprob(logprob=max(lp, LOGPROB_FLOOR), rank=rank,
                                               decoded_token=tokenizer.decode([t]))
                                    for t, (lp, rank) in d.items()}
            for d in result.prompt_logprobs]


def _completions(frs: list[FleetResult]) -> list[Completion]:
    return [c for fr in frs for c in completed(fr).completions]


def completion_response(req: CompletionRequest, model: str, frs: list[FleetResult], tokenizer: Any) -> dict:
    """The response to a completion request from its choices' fleet results (one per choice), prompt-major
    as vLLM orders them (a batch of prompts: choice ``p * n + i`` is prompt ``p``'s ``i``-th); each choice
    carries its prompt's token ids."""
    choices = [
        CompletionResponseChoice(index=i, text=_text(c, tokenizer, req.skip_special_tokens),
                                 logprobs=completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, tokenizer,
                                                              req.logprobs,
                                                              as_ids=bool(req.return_tokens_as_token_ids))[0],
                                 prompt_logprobs=prompt_logprobs(completed(fr), tokenizer),
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 token_ids=list(c.token_ids) if req.return_token_ids is not False else None,
                                 prompt_token_ids=list(completed(fr).prompt_token_ids)
                                 if req.return_token_ids is not False else None)
        for i, (fr, c) in enumerate((fr, c) for fr in frs for c in completed(fr).completions)
    ]
    body = CompletionResponse(id=f"cmpl-{frs[0].request_id}", model=model, choices=choices,
                              usage=_usage(frs, req.n or 1)).model_dump(exclude_none=True)
    body["rlfleet"] = group_block(frs)
    return body


def forces_a_call(req: ChatCompletionRequest) -> bool:
    """``tool_choice`` is ``required`` or names a function: vLLM's renderer constrained the output to the tools'
    JSON schema (structured outputs), and the parser reads the calls from that JSON."""
    return req.tool_choice == "required" or isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam)


def chat_message(req: ChatCompletionRequest, text: str, token_ids: Any, finish_reason: str | None,
                 renderer: Any = None) -> tuple[ChatMessage, str | None]:
    """The assistant message of one choice and its finish reason. With a tool-call or reasoning parser
    (``renderer.parses``), the text is read back by vLLM's parsers as ``vllm serve`` does: ``reasoning``
    apart (dropped when the request says ``include_reasoning: false``), and with tools under an automatic
    tool choice, the calls found as ``tool_calls`` and the finish reason ``tool_calls``."""
    if renderer is None or not renderer.parses:
        return ChatMessage(role="assistant", content=text), finish_reason
    reasoning, content, calls = renderer.parse(req, text, token_ids)
    if not req.include_reasoning:
        reasoning = None
    if forces_a_call(req):  # the output was held to the tools' JSON schema when rendered (vLLM's adjust_request)
        tool_calls = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls or ()]
        required = req.tool_choice == "required"
        return (ChatMessage(role="assistant", reasoning=reasoning, content=content or "", tool_calls=tool_calls),
                "tool_calls" if required and finish_reason == "stop" else finish_reason)
    auto = bool(req.tools) and req.tool_choice in (None, "auto") and renderer.options.enable_auto_tool_choice
    if auto and calls:
        tool_calls = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls]
        return ChatMessage(role="assistant", reasoning=reasoning, content=content, tool_calls=tool_calls), "tool_calls"
    return ChatMessage(role="assistant", reasoning=reasoning, content=content), finish_reason


def chat_response(req: ChatCompletionRequest, model: str, frs: list[FleetResult], tokenizer: Any,
                  renderer: Any = None) -> dict:
    """As ``completion_response``, in the chat format; ``renderer`` reads tool calls and reasoning back
    (``chat_message``). The completion's token ids are always there, parsed or not (the trainer's)."""
    choices = []
    for i, c in enumerate(_completions(frs)):
        message, finish = chat_message(req, _text(c, tokenizer, req.skip_special_tokens), c.token_ids,
                                       c.finish_reason, renderer)
        choices.append(ChatCompletionResponseChoice(
            index=i, message=message,
            logprobs=chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, tokenizer, bool(req.logprobs),
                                   req.top_logprobs, as_ids=bool(req.return_tokens_as_token_ids)),
            finish_reason=finish, stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if req.return_token_ids is not False else None))
    body = ChatCompletionResponse(id=f"chatcmpl-{frs[0].request_id}", model=model, choices=choices,
                                  usage=_usage(frs, len(frs)),  # one conversation: its n choices share it
                                  prompt_token_ids=list(completed(frs[0]).prompt_token_ids)
                                  if req.return_token_ids is not False else None,
                                  prompt_logprobs=prompt_logprobs(completed(frs[0]), tokenizer)).model_dump(exclude_none=True)
    body["rlfleet"] = group_block(frs)
    return body
