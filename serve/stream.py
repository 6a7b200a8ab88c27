"""One HTTP request's choices running on the fleet, and a streamed answer made of them as they run.

``Choices``: a request for ``n`` choices is ``n`` fleet requests of one (``protocol.choice_samplings``),
each ``Front.run`` on a task of its own. What they produce comes through one queue in arrival order:
``(i, TokenDelta)`` as choice ``i``'s tokens arrive (when streamed), ``(i, Outcome)`` when its request
ends. A non-streamed request waits for all of them (``all``); the first one that fails cancels the rest.

``Stream``: a streamed request. ``start`` waits for the first tokens or the first end, so that a request
the fleet refuses or returns before any token (a bad request, no serving engine within the timeout, a
stopped fleet) is still answered with its HTTP error status; only then is the 200 committed.
``events`` then writes the server-sent events (``serve.sse``) as the queue delivers. An engine that dies
mid-stream is the fleet's business: the dispatcher continues the request on another engine and its
deltas go on where the text stopped, so the stream just forwards them. A request returned after the
stream began ends it with an error event.

Whatever ends a stream (its last event, an error, the HTTP client leaving, the server stopping), the
fleet requests still running are cancelled, which aborts them on their engines (``Dispatcher``):
``EventStreamResponse`` makes sure of it even when the body's generator is left suspended.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.serve.front import Front, Outcome
from rlfleet.serve.protocol import completed
from rlfleet.serve.sse import StreamEvents


class Choices:
    """The ``len(samplings)`` fleet requests of one HTTP request, started at once."""

    def __init__(self, front: Front, work: list[tuple[list[int], dict]], request_id: str,
                 stream: bool, policy: Any = None, arrived: float | None = None) -> None:
        """``work``: (prompt ids, sampling) per fleet request, in the order of the response's choices;
        ``arrived``: when the HTTP request came (``Front.run``)."""
        self.front = front
        self.policy = policy  # the request's weight-version policy (None: the fleet's)
        self.arrived = arrived
        self.n = len(work)
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        ids = [request_id] if self.n == 1 else [f"{request_id}-{i}" for i in range(self.n)]
        self.tasks = [asyncio.ensure_future(self._one(i, prompt, s, rid, stream))
                      for i, ((prompt, s), rid) in enumerate(zip(work, ids))]

    async def _one(self, i: int, prompt: list[int], sampling: dict, request_id: str, stream: bool) -> None:
        on_tokens = (lambda delta: self.queue.put_nowait((i, delta))) if stream else None
        try:
            out = await self.front.run(prompt, sampling, request_id=request_id, on_tokens=on_tokens, policy=self.policy,
                                       arrived=self.arrived)
        except Exception as exc:  # noqa: BLE001 - a bug must end the request with a message, never hang its stream
            out = Outcome(500, None, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")
        self.queue.put_nowait((i, out))

    def cancel(self) -> None:
        """Cancel every request still running (each is aborted on its engine)."""
        for t in self.tasks:
            if not t.done():
                t.cancel()

    async def next(self) -> tuple[int, Any]:
        return await self.queue.get()

    async def all(self) -> list[FleetResult] | Outcome:
        """Every choice's result in order, or the first choice's failure (the others cancelled). Cancelled
        itself (the HTTP client left): every choice is cancelled."""
        results: list[FleetResult | None] = [None] * self.n
        try:
            for _ in range(self.n):
                i, out = await self.queue.get()
                if out.code != 200:
                    self.cancel()
                    return out
                results[i] = out.result
        except asyncio.CancelledError:
            self.cancel()
            raise
        return results  # type: ignore[return-value]


class Stream:
    """A streamed request: held until its first tokens or its first end, then its events."""

    def __init__(self, choices: Choices, events: StreamEvents) -> None:
        self.choices = choices
        self.ev = events
        self.version: int | None = None  # the weight version that sampled the first tokens sent
        self._first: tuple[int, Any] | None = None
        self._results: list[FleetResult | None] = [None] * choices.n
        self._left = choices.n
        self._over = False

    async def start(self) -> Outcome | None:
        """Wait for the first tokens or the first end. A failure before any token: that ``Outcome``, to be
        answered as HTTP (the other choices are cancelled). Otherwise None: the stream may begin."""
        try:
            item = await self.choices.next()
        except asyncio.CancelledError:  # the HTTP client left before anything came
            self.choices.cancel()
            raise
        x = item[1]
        if isinstance(x, Outcome):
            if x.code != 200:
                self.choices.cancel()
                return x
            self.version = completed(x.result).weight_version
        else:
            self.version = x.version
        self._first = item
        return None

    def close(self) -> None:
        self.choices.cancel()

    async def events(self) -> AsyncIterator[str]:
        """The stream's events, from its opening to ``[DONE]``. What arrived together is sent together."""
        try:
            pending = [self.ev.opening()]
            item = self._first
            assert item is not None  # ``start`` took it
            while True:
                pending.append(self._event(*item))
                if self._over:
                    break
                if self.choices.queue.empty():
                    yield "".join(pending)
                    pending = []
                    item = await self.choices.next()
                else:
                    item = self.choices.queue.get_nowait()
            yield "".join(pending)
        finally:
            self.close()

    def _event(self, i: int, x: Any) -> str:
        if not isinstance(x, Outcome):
            return self.ev.delta(i, x)
        if x.code != 200:  # returned after the 200 went out: the stream ends with the reason
            self._over = True
            self.choices.cancel()
            self.choices.front.stream_errors += 1
            return self.ev.error(x.message, x.kind, x.code, x.param)
        self._results[i] = x.result
        self._left -= 1
        assert x.result is not None  # a 200 carries its result
        out = self.ev.finish(i, x.result)
        if self._left == 0:
            self._over = True
            out += self.ev.closing(self._results)  # type: ignore[arg-type]
        return out


class EventStreamResponse(StreamingResponse):
    """A ``Stream`` as ``text/event-stream``. However the response ends, the stream's fleet requests still
    running are cancelled: starlette cancels the body's generator when the client disconnects, but a
    generator left waiting at a ``yield`` (its event was being sent) would only be closed whenever it is
    collected."""

    def __init__(self, stream: Stream, headers: dict[str, str]) -> None:
        super().__init__(stream.events(), media_type="text/event-stream", headers=headers)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
