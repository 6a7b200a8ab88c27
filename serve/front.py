"""What the HTTP front does with a request, apart from HTTP: run it on the fleet, say how it ended.

``Front`` holds the fleet's client (``fleet.data.client.FleetClient``: it routes straight to the
shards, holds a request while the gate is closed, re-sends after an engine death), the
tokenizer, and the front's own counters. It runs on the client's event loop, so a request
costs no hop between threads and none through the controller.

An accepted request ends in one of these, and nothing else:
- completed: 200, tagged with the weight versions, slot and incarnation;
- refused by vLLM's validation (the front's or the engine's): 400 with vLLM's message;
- returned as a poison (its attempts crashed two engines, or a shard knows its fingerprint):
  400 naming the fingerprint and the window it is refused for (retrying it is refused);
- returned by the fleet (stopped; no serving engine within the request timeout, which names
  why the gate is closed; the re-send budget spent): 503 with the reason;
- abandoned by its HTTP client: aborted on the engine and counted ``cancelled``;
- streamed and returned after its first tokens went out: the 200 was sent, so the stream ends with an
  error event naming the reason (``serve.stream``), counted ``stream_errors``;
- still running when the server stops past its grace (``cut_off_after``): aborted on the engine
  and answered 503, saying the server is shutting down (never the server's bare 500).
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.fleet.data.poison import POISON
from rlfleet.serve.metrics import FrontMetrics
from rlfleet.serve.prepare_pool import PreparePool, PrepareTimeout
from rlfleet.serve.protocol import BadRequest

_PARAMETER = re.compile(r"\(parameter=(\w+)")
# HTTP requests one front answers at once (each may be n fleet requests); past it a 429 at once. Sized for
# agent loops (hundreds of concurrent episodes), bounded so a flood is refused, not held for minutes.
DEFAULT_MAX_PENDING = 4096
# A request whose tokenizing or chat rendering runs longer than this is refused (``serve.prepare_pool``)
DEFAULT_PREPARE_LIMIT_S = 10.0
# Latencies kept for the /metrics quantiles (the most recent ones).
_LATENCY_WINDOW = 4096
_NAMES_KEPT = 4096  # request names ``/abort_requests`` can end by (``Front.name_request``)


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as HTTP: the status code, and either the result or an error message."""

    code: int
    result: FleetResult | None = None
    message: str = ""
    kind: str = ""
    param: str | None = None  # the request field a 400 is about, when known


class ServerStopping(Exception):
    """A call the server's stop cut off (``Front.until_stopped``): its caller is answered 503."""


class Front:
    def __init__(self, client: Any, tokenizer: Any, model: str, max_model_len: int, controller: Any = None,
                 chat: Any = None) -> None:
        """``chat``: how chat requests are rendered and read back (``serve.render.ChatRenderer``); None: this
        front answers chat requests 400, naming ``messages``."""
        self.client = client
        self.tokenizer = tokenizer
        self.chat = chat
        # what the model's generation_config.json sets (``protocol.generation_defaults``), for fields a request leaves unset
        self.sampling_defaults: dict = {}
        self.logprobs_mode = "raw_logprobs"  # the engines' (``EngineConfig.logprobs_mode``), said in each response
        self.pending = 0  # HTTP requests being answered (``serve.app``); past ``max_pending`` a 429
        self.max_pending = DEFAULT_MAX_PENDING
        self.model = model
        self.max_model_len = max_model_len
        self._ctl = controller
        self.responses: Counter[tuple[str, int]] = Counter()  # (endpoint, status code) -> responses sent
        self.cancelled = 0
        self.in_flight = 0
        self.tokens_out = 0
        self.latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self.ttfts: deque[float] = deque(maxlen=_LATENCY_WINDOW)  # streamed requests: time to the first token
        # ``/metrics``: this front's own registry (histograms since it started: latency, time to first token, time
        # queued at the front; vLLM's weight-route metrics; the fleet's figures, read at scrape time)
        self.metrics = FrontMetrics(lambda: (self.health()[1], self.counters()))
        self.engines: dict[int, dict[str, int]] = {}  # slot -> requests and tokens it finished for this front
        self.stream_errors = 0  # streams ended by an error event after their 200 (returned mid-stream)
        self.cut_off = 0  # requests returned because the server stopped before they finished
        # Prompts are tokenized (and chat templates rendered) off the event loop that routes every request (a
        # multi-megabyte prompt held /health and every other request for seconds), bounded in queue and time
        # (``serve.prepare_pool``): a request that takes too long is refused and a fresh worker goes on.
        self.prepare_pool = PreparePool(Kit(tokenizer, chat), self._fresh_kit, limit_s=DEFAULT_PREPARE_LIMIT_S)
        self._running: set[asyncio.Task] = set()
        # the ids callers know a request by (its response's ``id``) -> the fleet's ids of its choices, for
        # ``/abort_requests``; the newest ``_NAMES_KEPT`` (a name outlives its request harmlessly)
        self._names: OrderedDict[str, list[tuple[str, int, int]]] = OrderedDict()
        self._cut: set[asyncio.Task] = set()
        self._closing = False

    def name_request(self, response_id: str, request_id: str, prompts: int, choices: int) -> None:
        """The HTTP request ``response_id`` runs as the fleet's ``request_id`` (``choices`` fleet requests, prompt-major
        over ``prompts`` prompts: ``request_id-i``, or ``request_id`` alone when there is one)."""
        self._names.setdefault(response_id, []).append((request_id, prompts, choices))
        self._names.move_to_end(response_id)
        while len(self._names) > _NAMES_KEPT:
            self._names.popitem(last=False)

    def fleet_ids(self, ids: list[str]) -> list[str]:
        """The fleet's request ids (or id prefixes: ``Dispatcher.end``) of what callers name as vLLM's
        ``/abort_requests`` does: a response's ``id`` (``cmpl-...``: every choice of that request), vLLM's
        per-prompt ``id-j`` (prompt j's choices), or the fleet's own ``rlfleet.request_id``."""
        out = []
        for name in ids:
            base, _, j = name.rpartition("-")
            if name in self._names:
                out += [rid for rid, _, _ in self._names[name]]
            elif j.isdigit() and base in self._names:
                for rid, prompts, choices in self._names[base]:
                    n = choices // max(1, prompts)
                    if int(j) < prompts:
                        out += [rid] if choices == 1 else [f"{rid}-{i}" for i in range(int(j) * n, int(j) * n + n)]
            else:
                out.append(name)
        return out

    def _fresh_kit(self) -> Kit:
        """A new worker's own tokenizer and renderer (built on its thread: the routing loop never waits on it)."""
        tokenizer = copy.deepcopy(self.tokenizer)
        return Kit(tokenizer, None if self.chat is None else self.chat.fresh(tokenizer))

    # ------------------------------------------------------------------ requests
    async def prepare(self, call: Any, req: Any, via: Any = None) -> Any:
        """``call(req, via, max_model_len)`` (the prompt's token ids and the sampling dict; ``via``: the
        tokenizer when None, else this front's chat renderer, or this front itself for both) on a preparing
        thread, with that thread's own copy of ``via``. Its ``BadRequest`` reaches the caller as raised; past
        the pool's time limit a ``BadRequest`` naming the request's text field; the pool full: ``PoolBusy``."""
        role = "tokenizer" if via is None else "chat" if via is self.chat else "kit"
        if role == "kit" and via is not self:
            raise ValueError("prepare's via is None, this front's chat renderer, or this front")
        mml = self.max_model_len
        try:
            return await self.prepare_pool.run(lambda kit: call(req, kit if role == "kit" else getattr(kit, role), mml))
        except PrepareTimeout as exc:
            field = "messages" if hasattr(req, "messages") else "prompt"
            raise BadRequest(f"{field} took too long to prepare: {exc}", field) from None

    async def run(self, prompt: list[int], sampling: dict, request_id: str | None = None,
                  on_tokens: Callable[[Any], None] | None = None, policy: Any = None,
                  arrived: float | None = None) -> Outcome:
        """One request on the fleet; returns how it ended. Cancelled (the HTTP client left): aborted on the
        engine by the dispatcher and counted here, then the cancellation goes on. Cut off by the server's
        stop (``cut_off_after``): aborted the same way, and answered 503. ``on_tokens``: called with each
        ``TokenDelta`` as the tokens arrive (a streamed answer; the shard then sends the first token at once).
        ``arrived``: when the HTTP request came (the loop's clock), from which the histograms count."""
        if self._closing:
            return self._shutting_down()
        self.in_flight += 1
        clock = asyncio.get_running_loop().time  # time.monotonic on a real loop; virtual time in tests
        t0 = clock()
        if on_tokens is not None:
            on_tokens = self._timed(on_tokens, clock, t0, arrived)
        try:
            result = await self.until_stopped(
                self.client.generate_async(prompt, sampling, request_id, policy=policy, on_tokens=on_tokens))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except ServerStopping:  # this front's own cut-off, not the caller's: answer it
            self.cut_off += 1
            return self._shutting_down()
        finally:
            self.in_flight -= 1
        if result.ok:
            self.latencies.append(clock() - t0)
            self.metrics.histograms["e2e"].observe(clock() - (t0 if arrived is None else arrived))
            tokens = sum(len(c.token_ids) for c in result.result.completions)
            self.tokens_out += tokens
            if result.result.slot >= 0:  # (-1: ended before it reached an engine)
                row = self.engines.setdefault(result.result.slot, {"requests": 0, "tokens": 0})
                row["requests"] += 1
                row["tokens"] += tokens
            return Outcome(200, result)
        return self.returned(result)

    async def until_stopped(self, call: Any) -> Any:
        """``call``'s result, unless the server's stop (``cut_off_after``) comes first: then ``ServerStopping``,
        for the route to answer (503) instead of being torn down mid-call by the HTTP server. For a route's long
        call (a fleet request: ``run``; the weight routes' relay calls); its caller leaving still cancels it."""
        if self._closing:
            if asyncio.iscoroutine(call):
                call.close()  # never started
            raise ServerStopping("the server is shutting down: nothing was done; send it to the next server")
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await call
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()
            raise ServerStopping("the server is shutting down: the call was cut off before it finished") from None
        finally:
            self._running.discard(task)
            self._cut.discard(task)

    def _timed(self, on_tokens: Callable[[Any], None], clock: Callable[[], float], t0: float,
               arrived: float | None) -> Callable[[Any], None]:
        """``on_tokens`` that also records the time to the first token (``ttft_p50_s``)."""
        first = True

        def tokens(delta: Any) -> None:
            nonlocal first
            if first:
                first = False
                self.ttfts.append(clock() - t0)
                self.metrics.histograms["ttft"].observe(clock() - (t0 if arrived is None else arrived))
            on_tokens(delta)

        return tokens

    def cut_off_after(self, grace_s: float) -> None:
        """The server is stopping (call on the client's loop): refuse new requests, and return every request
        still running ``grace_s`` from now (aborted on its engine, answered 503 naming the shutdown)."""
        self._closing = True
        asyncio.get_running_loop().call_later(grace_s, self._cut_all)

    def _cut_all(self) -> None:
        for task in list(self._running):
            self._cut.add(task)
            task.cancel()

    @staticmethod
    def _shutting_down() -> Outcome:
        return Outcome(503, None, "the server is shutting down: the request was returned before it finished "
                                  "(aborted on its engine); send it again", "ServiceUnavailableError")

    def returned(self, result: FleetResult) -> Outcome:
        """A request the fleet returned: the caller's mistake (refused by validation, or a poison: its attempts took
        down engines, ``fleet.data.poison``) is a 400, everything else a 503 with the reason."""
        reason = result.reason
        if reason.startswith("bad request: "):
            message = _vllm_message(reason[len("bad request: "):])
            named = _PARAMETER.search(message)  # vLLM's validation error says "(parameter=NAME, ...)"
            return Outcome(400, result, message, "BadRequestError", named.group(1) if named else None)
        if reason.startswith(f"{POISON}: "):  # the request itself takes engines down: the caller's to change, not retry
            return Outcome(400, result, reason, "BadRequestError")
        state = self.client.routing()
        if reason.startswith("no serving shard") and not state.gate_open and not state.stopped:
            reason = f"{reason}; the gate is closed: {state.reason or 'a refit is running'}"
        return Outcome(503, result, reason, "ServiceUnavailableError")

    def count(self, endpoint: str, code: int) -> None:
        self.responses[(endpoint, code)] += 1

    # ------------------------------------------------------------------ the fleet's state
    def readiness(self) -> tuple[int, dict]:
        """``/ready``: 200 while the gate is open (a request is served now); 503 with the reason while it is
        closed (a refit, too few engines) or the fleet stopped."""
        s = self.client.routing()
        body = {"gate_open": s.gate_open, "version": s.version, "epoch": s.epoch, "serving": len(s.members)}
        if s.stopped:
            return 503, {**body, "status": "stopped", "reason": s.stopped}
        if not s.gate_open:
            return 503, {**body, "status": "gate closed", "reason": s.reason or "a refit is running"}
        return 200, {**body, "status": "ok"}

    def health(self) -> tuple[int, dict]:
        """``/health``, liveness: 200 while the fleet is not stopped, a refit or a closed gate included (a
        request sent then waits for the gate: the server is alive, restarting it would lose that); 503 once
        the fleet stopped. The body is ``readiness``'s."""
        code, body = self.readiness()
        return (503 if body["status"] == "stopped" else 200), body

    async def status(self, timeout: float = 10.0) -> dict | None:
        """The controller's ``status()`` (None if it does not answer within ``timeout``: it may be restarting)."""
        if self._ctl is None:
            return None
        out = await self.client.door.call(self._ctl, "status", timeout=timeout)
        return out.value if out.ok else None

    def counters(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        ttft = sorted(self.ttfts)
        return {
            "responses": {f"{e} {c}": n for (e, c), n in sorted(self.responses.items())},
            "in_flight": self.in_flight,
            "cancelled": self.cancelled,
            "cut_off": self.cut_off,
            "tokens_out": self.tokens_out,
            "latency_p50_s": _quantile(lat, 0.5),
            "latency_p99_s": _quantile(lat, 0.99),
            "ttft_p50_s": _quantile(ttft, 0.5),
            "ttft_p99_s": _quantile(ttft, 0.99),
            "stream_errors": self.stream_errors,
            "engines": {str(slot): dict(row) for slot, row in sorted(self.engines.items())},
            "client": self.client.counters(),
        }


@dataclass
class Kit:
    """What a preparing thread uses: a tokenizer and a chat renderer (None: no chat) of its own."""

    tokenizer: Any
    chat: Any = None


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _vllm_message(detail: str) -> str:
    """The shard wraps vLLM's refusal (``request X rejected by vLLM: <message>``); the client gets vLLM's words."""
    for marker in ("rejected by vLLM: ", "sampling params rejected by vLLM: "):
        if marker in detail:
            return detail.split(marker, 1)[1]
    return detail
