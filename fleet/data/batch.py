"""Plain ``serve`` calls bound for one shard in the same turn of the event loop, sent as one call.

A batched HTTP request (TRL sends its prompts as one ``/v1/completions`` of ``n`` choices each) becomes many
fleet requests accepted together. Sent one Ray call each, every call costs the caller, Ray and the shard a
fixed overhead, and the engine sees them trickle in over several steps. The dispatcher's requests still go
one by one through routing, accounting and re-sending (``fleet.data.dispatch``); only the call carrying them
is shared: those that reach the same shard before the event loop turns go as one ``serve_many``
(``EngineShard.serve_many``), and each gets back the ``Outcome`` its own call would have come to
(``fleet.outcome.answer_outcome``). A call that fails as a whole (the shard died, hung, could not be reached)
is every item's outcome, as it would have been for each of their own calls. A lone request goes as ``serve``.

Each item keeps its own deadline: one whose time runs out while the batch is still running comes back
``timed_out`` (its caller aborts it on the shard, as for a call of its own); one whose caller gave up stops
waiting without disturbing the others.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Hashable

from rlfleet.fleet.outcome import ERROR, TIMED_OUT, Outcome, answer_outcome


@dataclass
class _Batch:
    handle: Any
    requests: list[bytes] = field(default_factory=list)  # each a ``fleet.wire.ServeRequest`` on the wire
    waiters: list[asyncio.Future] = field(default_factory=list)
    timeout: float = 0.0


class ServeBatcher:
    """One client's batching of plain ``serve`` calls per shard (``key``: the shard's slot and incarnation).

    ``one``/``many``: the shard's methods for a lone request and for several (``many`` with ``lead`` before the
    list); ``one`` None sends a lone request as a list of one (``EngineShard.submit``)."""

    def __init__(self, view: Any, one: str | None = "serve", many: str = "serve_many", lead: tuple = ()) -> None:
        self._view = view  # its ``door`` carries the calls
        self._one, self._many, self._lead = one, many, lead
        self._open: dict[Hashable, _Batch] = {}
        self._sending: set[asyncio.Future] = set()  # referenced until done
        self.calls = 0  # calls sent (``serve`` or ``serve_many``)
        self.batched = 0  # requests that went in a ``serve_many`` of two or more

    async def serve(self, key: Hashable, handle: Any, request: bytes, timeout: float) -> Outcome:
        loop = asyncio.get_running_loop()
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(handle)
            loop.call_soon(self._send, key)  # after every request that is ready now has joined
        waiter = loop.create_future()
        batch.requests.append(request)
        batch.waiters.append(waiter)
        batch.timeout = max(batch.timeout, timeout)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError as exc:
            return Outcome(TIMED_OUT, error=exc, elapsed_s=timeout)

    def _send(self, key: Hashable) -> None:
        batch = self._open.pop(key)
        future = asyncio.ensure_future(self._call(batch))
        self._sending.add(future)
        future.add_done_callback(self._sending.discard)

    async def _call(self, batch: _Batch) -> None:
        self.calls += 1
        outcomes: list[Outcome] = []
        try:
            if len(batch.requests) == 1 and self._one is not None:
                outcomes = [await self._view.door.call(batch.handle, self._one, batch.requests[0], timeout=batch.timeout)]
            else:
                self.batched += len(batch.requests) if len(batch.requests) > 1 else 0
                whole = await self._view.door.call(batch.handle, self._many, *self._lead, batch.requests,
                                                   timeout=batch.timeout)
                outcomes = ([answer_outcome(item, whole.elapsed_s) for item in whole.value] if whole.ok
                            else [whole] * len(batch.requests))
        except BaseException as exc:  # the door never raises for a shard's failure; this is the loop going away
            outcomes = [Outcome(ERROR, error=RuntimeError(f"the call carrying this request was lost: {exc!r}"))
                        ] * len(batch.requests)
            raise
        finally:
            for waiter, outcome in zip(batch.waiters, outcomes):
                if not waiter.done():
                    waiter.set_result(outcome)
