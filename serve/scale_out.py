"""vLLM's scale-out routes on ``rlfleet serve`` (``--enable-scale-out``, as ``vllm serve`` takes it).

- ``POST /v1/chat/completions/render``: a chat request rendered to what an engine runs, vLLM's
  ``GenerateRequest`` (prompt token ids, sampling params, request id), by vLLM's own ``ServingRender`` over
  the front's chat renderer (``serve.render``): the ids the chat endpoint sends the fleet, and the ids
  ``vllm serve`` would render. Rendering runs off the routing loop, as every chat rendering here.
- ``POST /inference/v1/generate``: token ids in, token ids out, with vLLM's request and response models
  (``vllm/entrypoints/scale_out/token_in_token_out``). Each of its ``n`` choices is one fleet request, routed
  as a ``/v1/completions`` request with token ids is (``serve.app._serve``): held while the gate is closed,
  continued on another engine from its tokens if its own dies, aborted when the client leaves. Each choice's
  ``weight_versions`` (vLLM's field) are the fleet's version spans, and the body's ``rlfleet`` block and the
  ``x-rlfleet-weight-version`` header carry the fleet's tags as on every other route.

What the fleet does not carry out is refused naming the field (400), never ignored: multimodal ``features`` and
``content_parts`` (the fleet's engines take token ids), ``stream``, ``output_mode: "text"``, disaggregation's
``kv_transfer_params``/``ec_transfer_params``, a ``priority``, a ``cache_salt``. Sampled tokens' logprobs come
without vLLM's vocabulary ``rank`` (the fleet's results do not carry it: ``None``, as vLLM sends for no rank).

Without the flag both routes answer 403 with vLLM's words, as ``vllm serve``'s do.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.entrypoints.serve.utils.api_utils import with_cancellation
from vllm.outputs import WeightVersionSpan

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.serve import bodies, protocol
from rlfleet.serve.prepare_pool import PoolBusy

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DISABLED = "Scale-out endpoints are disabled. Restart rlfleet serve with --enable-scale-out to enable them."


def mount(app: FastAPI, front: Any, enabled: bool, serve: Callable, error: Callable, refused: Callable) -> None:
    """The two routes on ``app`` over ``front``; ``serve``: how a request is routed through the fleet
    (``serve.app._serve``), ``error``: the error response (``serve.app._error``), ``refused``: the answer to a
    request its preparation refused (``serve.app._refused``)."""
    if not enabled:
        async def disabled():
            return error(403, DISABLED, "PermissionDeniedError")

        for path in (RENDER_PATH, GENERATE_PATH):
            app.add_api_route(path, disabled, methods=["POST"], include_in_schema=False)
        return

    @app.post(RENDER_PATH)
    async def render(request: bodies.Chat, raw_request: Request):
        if front.chat is None:
            front.count(RENDER_PATH, 400)
            return error(400, "this server renders no chat (started without a chat renderer)", "BadRequestError",
                         "messages")
        if request.model is not None and request.model != front.model:
            front.count(RENDER_PATH, 404)
            return error(404, f"The model `{request.model}` does not exist.", "NotFoundError", "model")
        call = functools.partial(_render, model=front.model, request_id=raw_request.headers.get("x-request-id"))
        try:
            rendered = await front.prepare(call, request, front.chat)
        except (protocol.BadRequest, PoolBusy) as exc:
            return refused(front, RENDER_PATH, exc)
        front.count(RENDER_PATH, 200)
        return JSONResponse(rendered.model_dump())

    @app.post(GENERATE_PATH)
    @with_cancellation
    async def generate(request: bodies.Generate, raw_request: Request):
        return await serve(front, GENERATE_PATH, request,
                           functools.partial(generate_calls, defaults=front.sampling_defaults), generate_response,
                           raw=raw_request)


def _render(req: ChatCompletionRequest, chat: Any, max_model_len: int, model: str, request_id: str | None) -> Any:
    """On a preparing thread (``chat``: its own renderer): vLLM's ``GenerateRequest`` for ``req``."""
    return chat.render_request(req, model, request_id)


# ------------------------------------------------------------------------------------------------ generate
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("features", lambda r: r.features is not None, "multimodal features are not served: the fleet's engines "
                                                   "take token ids"),
    ("content_parts", lambda r: bool(r.content_parts), "multimodal content_parts are not served: the fleet's "
                                                       "engines take token ids"),
    ("stream", lambda r: bool(r.stream), "stream is not served on this route: send stream: false, or stream "
                                         "from /v1/completions with token ids"),
    ("output_mode", lambda r: r.output_mode != "tokens", "output_mode 'text' is not served: send 'tokens' and "
                                                         "detokenize with /detokenize"),
    ("kv_transfer_params", lambda r: r.kv_transfer_params is not None, "disaggregated serving is not served"),
    ("ec_transfer_params", lambda r: r.ec_transfer_params is not None, "disaggregated serving is not served"),
    ("priority", lambda r: r.priority != 0, "priority scheduling is not served"),
    ("cache_salt", lambda r: r.cache_salt is not None, "cache_salt is not served"),
    ("reasoning_ended", lambda r: r.reasoning_ended is not None and r.sampling_params.structured_outputs is not None,
     "structured outputs gated by a reasoning parser are not served"),
)


def generate_calls(req: GenerateRequest, _tokenizer: Any, max_model_len: int,
                   defaults: dict | None = None) -> list[tuple[list[int], dict]]:
    """The request's one (prompt ids, sampling) job. ``max_tokens`` left out of ``sampling_params`` is the
    prompt's room in the context (or the model's generation-config default, when smaller), as vLLM's server
    fills it; the rest is the request's ``SamplingParams`` as vLLM built them (``protocol.sampling_of``)."""
    for field, is_set, why in _REFUSED:
        if is_set(req):
            raise protocol.BadRequest(f"{field}: {why} by rlfleet serve", field)
    prompt = list(req.token_ids)
    room = max_model_len - len(prompt)
    if room <= 0:
        raise protocol.BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                  f"prompt has {len(prompt)} tokens, which leaves no room for the completion.",
                                  "token_ids")
    params = req.sampling_params
    sampling = protocol.sampling_of(params)
    if not req.is_sampling_param_provided("max_tokens"):
        default = (defaults or {}).get("max_tokens")
        sampling["max_tokens"] = room if default is None else min(int(default), room)
    sampling["logprobs"] = params.logprobs  # said even when None: a shard computes them unless told not to
    return [(prompt, sampling)]


def generate_response(req: GenerateRequest, model: str, frs: list[FleetResult], tokenizer: Any) -> dict:
    """vLLM's ``GenerateTokensResponse`` from the choices' fleet results (one per choice), each choice with its
    token ids, logprobs as asked and ``weight_versions`` (the fleet's spans); the ``rlfleet`` block beside it."""
    k = req.sampling_params.logprobs
    choices = []
    for i, fr in enumerate(frs):
        res = protocol.completed(fr)
        (c,) = res.completions  # a fleet request per choice: one completion each
        choices.append(GenerateTokensChoice(
            index=i, finish_reason=c.finish_reason or "stop", stop_reason=c.stop_reason, token_ids=list(c.token_ids),
            logprobs=None if k is None else tokens_logprobs(c.token_ids, c.logprobs, c.top_logprobs, k),
            weight_versions=[WeightVersionSpan(version=str(v), start=s, end=e) for v, s, e in res.version_spans]))
    first = protocol.completed(frs[0])
    response = GenerateTokensResponse(
        model=model, created=int(time.time()), choices=choices,
        usage=protocol.usage(len(first.prompt_token_ids), sum(len(c.token_ids or ()) for c in choices)),
        prompt_logprobs=protocol.prompt_logprobs(first, tokenizer),
        prompt_token_ids=list(first.prompt_token_ids) if req.return_token_ids else None)
    body = response.model_dump()
    body["rlfleet"] = protocol.group_block(frs)
    return body


def _floor(lp: float) -> float:
    return protocol.LOGPROB_FLOOR if math.isnan(lp) else max(lp, protocol.LOGPROB_FLOOR)


def tokens_logprobs(token_ids: Any, logprobs: Any, top_logprobs: Any, k: int) -> GenerateLogProbs:
    """vLLM's token-id logprobs (``ServingTokens._create_tokens_logprobs``): per generated token its logprob and a
    ``top_logprobs`` list in the engine's order (the sampled token first, then the others by logprob), the first
    ``max(k, 1)`` of them (all for ``k == -1``)."""
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        others = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else {}
        ranked = [(t, lp)] + sorted(((tt, tlp) for tt, tlp in others.items() if tt != t), key=lambda kv: -kv[1])
        keep = ranked if k == -1 else ranked[:max(k, 1)]
        content.append(GenerateLogProbsContent(
            token_id=int(t), logprob=_floor(lp),
            top_logprobs=[GenerateLogProb(token_id=int(tt), logprob=_floor(tlp)) for tt, tlp in keep]))
    return GenerateLogProbs(content=content)

