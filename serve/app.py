"""The HTTP routes of ``rlfleet serve`` (FastAPI), over one ``Front``.

OpenAI-compatible: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` as server-sent events). The fleet's own: ``GET /health``, ``GET /metrics``
(Prometheus text, ``serve.metrics``), ``GET /v1/fleet/status``. Weight updates stay the trainer's call
(``Fleet.sync_weights``) on the same fleet, unless vLLM's RL routes are mounted (``rlapi.routes``).

A request for ``n`` choices is sent to the fleet as ``n`` requests of one (``seed + i`` when seeded).

A streamed request is sent as events while its tokens are generated (``serve.stream``,
``serve.sse``). An engine that dies mid-stream does not end it: the fleet continues the request
on another engine from the tokens already sent, and the stream goes on where it stopped (the
last chunk's ``rlfleet`` block counts the continuations and says which weight version sampled
which tokens). The 200 is committed with the first tokens: a request refused or returned
before any is answered with its HTTP error; one returned after them (it could not be continued)
ends its stream with an error event. A client that leaves has its requests aborted on the engines.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import with_cancellation
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.exceptions import VLLMValidationError

from rlfleet.serve import bodies, protocol, sse
from rlfleet.serve.front import Front, Outcome
from rlfleet.serve.metrics import CONTENT_TYPE_LATEST
from rlfleet.serve.prepare_pool import PoolBusy
from rlfleet.serve.stream import Choices, EventStreamResponse, Stream


log = logging.getLogger("rlfleet.serve")
access = logging.getLogger("rlfleet.serve.access")

# ``Retry-After`` on every 503: a closed gate (a refit) or a request timeout passes in seconds; a stopped
# fleet does not come back by waiting, but a client told nothing retries at once
RETRY_AFTER_S = 1
RETRY_AFTER_STOPPED_S = 60


def _error(code: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    headers = None
    if code == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    if code == 503:
        headers = {"Retry-After": str(RETRY_AFTER_STOPPED_S if message.startswith("fleet stopped") else RETRY_AFTER_S)}
    return JSONResponse(protocol.error_body(message, kind, code, param), status_code=code, headers=headers)


def _refused(front: Any, endpoint: str, exc: protocol.BadRequest | PoolBusy) -> JSONResponse:
    """A request its preparation refused, counted on ``endpoint``: 400 naming the parameter, or 429 while every
    preparing thread is busy (retry later)."""
    if isinstance(exc, PoolBusy):
        front.count(endpoint, 429)
        return _error(429, f"{exc}: retry later", "TooManyRequests")
    front.count(endpoint, 400)
    return _error(400, str(exc), "BadRequestError", exc.param)


def _authentication() -> Any:  # a middleware class (a subclass of vLLM's, untyped here)
    """vLLM's API-key middleware (``vllm serve --api-key``: its token check, its guarded ``/v1`` prefix), whose
    refusal is worded in OpenAI's error shape like every other error here (vLLM's own body is
    ``{"error": "Unauthorized"}``)."""
    from starlette.datastructures import Headers
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX, AuthenticationMiddleware

    class Authentication(AuthenticationMiddleware):
        def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope.get("method") != "OPTIONS":
                path = scope["path"].removeprefix(scope.get("root_path", ""))
                if path.startswith(GUARDED_PREFIX) and not self.verify_token(Headers(scope=scope)):
                    refusal = _error(401, "Unauthorized: send the server's API key as 'Authorization: Bearer KEY'",
                                     "AuthenticationError")
                    return refusal(scope, receive, send)
            return super().__call__(scope, receive, send)

    return Authentication


class AccessLog:
    """One line per HTTP request on the ``rlfleet.serve.access`` logger: method, path, status, milliseconds and
    the request id (``X-Request-Id``: the caller's, or the one the response carries)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, seen = time.monotonic(), {"status": 0, "id": "-"}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for k, v in message.get("headers", []):
                    if k.lower() == b"x-request-id":
                        seen["id"] = v.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            access.info("%s %s %s %.1fms id=%s", scope.get("method"), scope.get("path"), seen["status"] or "-",
                        (time.monotonic() - t0) * 1000, seen["id"])


def _state(code: int, body: dict) -> JSONResponse:
    """``/health`` and ``/ready``: the routing state, with ``Retry-After`` on a 503."""
    headers = None
    if code == 503:
        headers = {"Retry-After": str(RETRY_AFTER_STOPPED_S if body.get("status") == "stopped" else RETRY_AFTER_S)}
    return JSONResponse(body, status_code=code, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    """One line per problem, as pydantic words it (the messages of vLLM's own validators among them); a body
    that is not JSON, or none at all, said as much (pydantic: "31: JSON decode error", "Field required")."""
    parts = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        if e.get("type") == "json_invalid":
            at = next((x for x in loc if isinstance(x, int)), None)
            why = (e.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON{f' at character {at}' if at is not None else ''}"
                         f"{f' ({why})' if why else ''}")
            continue
        if loc == ("body",) and e.get("type") == "missing":
            parts.append("the request body is missing: send a JSON object")
            continue
        # (a union member is tagged by its schema, ``function-wrap[...]`` for vLLM's models: no field of the body)
        where = ".".join(str(x) for x in loc if x != "body" and not str(x).startswith("function-"))
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or str(exc)


def build_app(front: Front, api_keys: list[str] | None = None, rl: Any = None, scale_out: bool = False) -> FastAPI:
    """The routes over ``front``. ``api_keys``: every ``/v1`` route wants ``Authorization: Bearer KEY``
    (vLLM's own middleware, as ``vllm serve --api-key``; ``/health``, ``/ready``, ``/metrics`` and
    ``/version`` stay open). Every response echoes ``X-Request-Id`` (the caller's, else a new one).
    ``rl``: vLLM's RL routes (``rlapi.routes.RLSurface``), outside ``/v1`` as in ``vllm serve``. ``scale_out``:
    vLLM's render and token-in/token-out routes (``serve.scale_out``; without it they answer 403, as vLLM's)."""
    from vllm.entrypoints.serve.middleware.x_request_id import XRequestIdMiddleware

    app = FastAPI(title="rlfleet", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(XRequestIdMiddleware)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        """A bug still answers in OpenAI's error shape (never a text/plain 500), and is logged with its trace."""
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")
    if api_keys:
        app.add_middleware(_authentication(), tokens=list(api_keys))
    app.add_middleware(AccessLog)  # outermost: it sees every answer, a 401 and the X-Request-Id header included

    @app.post("/tokenize")
    async def tokenize(request: bodies.Tokenize):
        """vLLM's ``/tokenize``: a prompt's ids (special tokens as asked), or a conversation's as the chat
        endpoint renders it (the same renderer: tools and tool calls included)."""
        if request.model is not None and request.model != front.model:
            return _error(404, f"The model `{request.model}` does not exist.", "NotFoundError", "model")
        try:
            ids = await front.prepare(_tokenize, request, front)
        except protocol.BadRequest as exc:
            return _error(400, str(exc), "BadRequestError", exc.param)
        except PoolBusy as exc:
            return _error(429, f"{exc}: retry later", "TooManyRequests")
        strs = front.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=front.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(request: bodies.Detokenize):
        if request.model is not None and request.model != front.model:
            return _error(404, f"The model `{request.model}` does not exist.", "NotFoundError", "model")
        size = len(front.tokenizer)
        bad = next((t for t in request.tokens if t >= size), None)
        if bad is not None:
            return _error(400, f"token id {bad} is out of vocabulary (size {size})", "BadRequestError", "tokens")
        return DetokenizeResponse(prompt=front.tokenizer.decode(request.tokens)).model_dump()

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        from vllm import __version__ as vllm_version

        try:
            own = installed("rlfleet")
        except PackageNotFoundError:
            own = None
        return {"version": own, "vllm": vllm_version}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        front.count(request.url.path, 400)
        return _error(400, _validation_message(exc), "BadRequestError")

    @app.exception_handler(VLLMValidationError)
    async def _refused_by_vllm(request: Request, exc: VLLMValidationError):
        """vLLM's request models raise their own error from a validator pydantic does not wrap (a missing or
        empty prompt): it is the caller's mistake, a 400 in vLLM's words, not a 500."""
        front.count(request.url.path, 400)
        return _error(400, str(exc), "BadRequestError", getattr(exc, "parameter", None))

    @app.get("/v1/models")
    async def models():
        return protocol.models_body(front.model, front.max_model_len)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """FastAPI's own answers (no such path, a method the path does not take) in the OpenAI error shape."""
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "HTTPError")
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        response = _error(exc.status_code, message, kind)
        response.headers.update(getattr(exc, "headers", None) or {})  # Allow: on a 405
        return response

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return _state(*front.health())  # liveness: 200 unless the fleet stopped (a refit is alive)

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        return _state(*front.readiness())  # readiness: 503 while the gate is closed

    @app.get("/metrics")
    async def metrics():
        return Response(front.metrics.exposition(await front.status(timeout=5.0)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/fleet/status")
    async def fleet_status():
        status = await front.status()
        _, health_body = front.health()
        body = {"front": front.counters(), "routing": health_body, "controller": status}
        return JSONResponse(json.loads(json.dumps(body, default=str)), status_code=200 if status is not None else 503)

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(request: bodies.Completion, raw_request: Request):
        return await _serve(front, "/v1/completions", request,
                            functools.partial(protocol.completion_calls, defaults=front.sampling_defaults),
                            protocol.completion_response, raw=raw_request)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat(request: bodies.Chat, raw_request: Request):
        if front.chat is None:
            front.count("/v1/chat/completions", 400)
            return _error(400, "this server renders no chat (started without a chat renderer)", "BadRequestError",
                          "messages")
        return await _serve(front, "/v1/chat/completions", request,
                            functools.partial(protocol.chat_calls, defaults=front.sampling_defaults),
                            functools.partial(protocol.chat_response, renderer=front.chat), via=front.chat,
                            raw=raw_request)

    from rlfleet.serve import scale_out as scale_out_routes

    scale_out_routes.mount(app, front, scale_out, _serve, _error, _refused)
    if rl is not None:
        rl.mount(app, front)
    return app


def _tokenize(req: Any, front: Any, max_model_len: int) -> list[int]:
    """``/tokenize``'s ids (on a preparing thread, ``front`` its ``Kit``): a chat request through the chat renderer."""
    if isinstance(req, TokenizeChatRequest):
        if front.chat is None:
            raise protocol.BadRequest("this server renders no chat", "messages")
        fields = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                  "chat_template_kwargs", "add_special_tokens")
        return front.chat.render(ChatCompletionRequest(**{f: getattr(req, f) for f in fields}, tool_choice="none"))
    if len(req.prompt) > max_model_len * protocol.MAX_CHARS_PER_TOKEN:
        raise protocol.BadRequest(f"prompt has {len(req.prompt)} characters, more than any tokenization of it "
                                  f"could fit in the context ({max_model_len} tokens)", "prompt")
    return list(front.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))


async def _serve(front: Front, endpoint: str, req: Any, call: Callable, respond: Callable, via: Any = None,
                 raw: Request | None = None) -> Response:
    if front.pending >= front.max_pending:  # full: answered at once, not held for minutes behind the others
        front.count(endpoint, 429)
        return _error(429, f"{front.pending} requests are in flight at this server, its bound (--max-pending "
                           f"{front.max_pending}): retry later", "TooManyRequests")
    front.pending += 1
    try:
        return await _serve_one(front, endpoint, req, call, respond, via, raw)
    finally:
        front.pending -= 1


async def _serve_one(front: Front, endpoint: str, req: Any, call: Callable, respond: Callable, via: Any,
                     raw: Request | None) -> Response:
    """``call(req, via, max_model_len)`` prepares the fleet calls, (prompt ids, sampling) per prompt (``via``:
    the chat renderer; default the tokenizer), ``respond`` builds the body from the choices' results. The request's weight-version policy
    (``protocol.version_policy``: body or header, else the fleet's) goes with each of its fleet requests and
    is echoed in the response (``rlfleet.version_policy`` and the header)."""
    arrived = asyncio.get_running_loop().time()  # the clock ``Front.run`` counts on
    if req.model is not None and req.model != front.model:
        front.count(endpoint, 404)
        return _error(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
    try:
        protocol.refuse_invalid_text(req)
        protocol.refuse_text_beyond_the_context(req, front.max_model_len)
        policy = protocol.version_policy(req, raw.headers.get(protocol.POLICY_HEADER) if raw is not None else None,
                                         getattr(front.client, "policy", None))
        jobs = await front.prepare(call, req, via) if protocol.needs_tokenizer(req) else \
            call(req, front.tokenizer if via is None else via, front.max_model_len)
    except (protocol.BadRequest, PoolBusy) as exc:
        return _refused(front, endpoint, exc)
    # n choices of each prompt: n fleet requests of one, prompt-major (vLLM's order of choices)
    work = [(prompt, s) for prompt, sampling in jobs for s in protocol.choice_samplings(sampling)]
    request_id = f"http-{uuid.uuid4().hex[:16]}"  # the fleet's: unique, whatever the caller sends (a shard
    # answers a request id it has seen with that request's result)
    front.metrics.histograms["queue"].observe(asyncio.get_running_loop().time() - arrived)
    choices = Choices(front, work, request_id, stream=bool(req.stream), policy=policy, arrived=arrived)
    said = {protocol.POLICY_HEADER: policy.describe()} if policy is not None else {}
    # the caller's id for it (``X-Request-Id``, or the body's ``request_id`` when set) names the response, as
    # in vllm serve; the fleet's own (``rlfleet.request_id``) stays unique
    caller = raw.headers.get("x-request-id") if raw is not None else None
    caller = caller or (req.request_id if "request_id" in req.model_fields_set else None)
    # vLLM's names: a chat response's ``id`` is ``chatcmpl-...``, a completion's ``cmpl-...``, a token-in/token-out
    # response's ``request_id`` is ``generate-tokens-...``
    prefix, id_field = ("chatcmpl", "id") if isinstance(req, ChatCompletionRequest) else \
        ("cmpl", "id") if isinstance(req, CompletionRequest) else ("generate-tokens", "request_id")
    response_id = f"{prefix}-{caller or request_id}"
    front.name_request(response_id, request_id, len(jobs), len(work))
    if req.stream:
        return await _stream(front, endpoint, req, [p for p, _ in work], choices, response_id, said)
    out = await choices.all()
    if isinstance(out, Outcome):
        front.count(endpoint, out.code)
        return _error(out.code, out.message, out.kind, out.param)
    front.count(endpoint, 200)
    body = respond(req, front.model, out, front.tokenizer)
    body[id_field] = response_id
    body["rlfleet"]["logprobs_mode"] = front.logprobs_mode  # which logprobs these are (the engines' mode)
    if policy is not None:
        body["rlfleet"]["version_policy"] = policy.describe()
    return JSONResponse(body, headers={protocol.VERSION_HEADER: str(body["rlfleet"]["weight_version"]), **said})


async def _stream(front: Front, endpoint: str, req: Any, prompts: list[list[int]], choices: Choices,
                  response_id: str, headers: dict | None = None) -> Response:
    """Hold the answer until the first tokens (or the end) arrive: a request refused or returned before any
    token is still answered with its HTTP status; from the first token on it is a 200 and its events."""
    stream = Stream(choices, sse.events_for(req, front.model, response_id, prompts, front.tokenizer,
                                            choices.n, front.chat))
    failed = await stream.start()
    if failed is not None:
        front.count(endpoint, failed.code)
        return _error(failed.code, failed.message, failed.kind, failed.param)
    front.count(endpoint, 200)
    # The headers go out before the request finishes, so the version header names the weight version that
    # sampled the first tokens (the version the request finished under, when it ended before any token):
    # a request a refit held, or one continued on another engine, may end under a later version, which its
    # last chunk's ``rlfleet`` block names (``weight_version``, ``version_spans``).
    return EventStreamResponse(stream, headers={protocol.VERSION_HEADER: str(stream.version), **(headers or {})})
