"""A client's watched requests on a shard, all their output through one poll: the caller's side of
``fleet.shard.outbox``.

A request whose output the client watches as it is made (a streaming caller, or a long one whose output is
held against its engine's death) is submitted tapped (``EngineShard.submit``, batched with this client's
other submissions for that shard that are ready at once: ``fleet.data.batch``), and its output comes back
with every other such request's on that shard through one ``take_output`` poll per answer. ``Taps.stream``
gives each request its own view: the ``Outcome``s a stream of its own would have given (``ok`` chunks, then
its result, or its failure after the chunks sent before it), so ``fleet.data.dispatch`` handles both the
same way.

One poll runs per shard while any request there is watched, and stops when none is. A poll that fails
ends every watched request there with that failure (the shard died: each one's outcome is ``died``, as
each stream's would have been), except a poll that timed out in transit, which is sent again: a hung shard
is the monitor's to find, and each request's own deadline still bounds it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from typing import Any, Hashable

from rlfleet.fleet.data.batch import ServeBatcher
from rlfleet.fleet.outcome import ERROR, OK, TIMED_OUT, Outcome, answer_outcome
from rlfleet.fleet.types import Chunk

POLL_WAIT_S = 1.0  # a poll with nothing to answer comes back empty after this long
POLL_SLACK_S = 10.0  # and its call's own deadline is this much later (Ray's and the shard's delays)


class _Inbox:
    """One watched request's ``Outcome``s as its poll brings them: put without waiting, taken in order."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


_TIMED_OUT = object()  # put in a request's inbox when its time ran out


class _Tap:
    """The watched requests on one shard, and the poll that feeds them."""

    def __init__(self, taps: "Taps", key: Hashable, handle: Any) -> None:
        self._taps, self.key, self.handle = taps, key, handle
        self.queues: dict[str, _Inbox] = {}
        self._poll: asyncio.Future | None = None

    def watch(self, request_id: str) -> _Inbox:
        q = self.queues[request_id] = _Inbox()
        if self._poll is None:
            self._poll = asyncio.ensure_future(self._polling())
        return q

    def unwatch(self, request_id: str, q: _Inbox) -> None:
        """Stop feeding ``q`` (an attempt's generator may close after the next attempt of its request began
        watching the same shard: that one's queue stays)."""
        if self.queues.get(request_id) is q:
            del self.queues[request_id]

    def _fail_all(self, out: Outcome) -> None:
        for q in self.queues.values():
            q.put(out)

    async def _polling(self) -> None:
        door = self._taps.view.door
        try:
            while self.queues:
                out = await door.call(self.handle, "take_output", self._taps.id, POLL_WAIT_S,
                                      timeout=POLL_WAIT_S + POLL_SLACK_S)  # fmt: skip
                self._taps.polls += 1
                if out.ok:
                    for request_id, item in out.value:
                        q = self.queues.get(request_id)
                        if q is not None:  # one that ended here or was given up on: nobody waits for it
                            q.put(answer_outcome(item, out.elapsed_s))
                elif out.kind != TIMED_OUT:  # the shard failed: so did every request watched there
                    self._fail_all(out)
                    return
        except Exception as exc:  # noqa: BLE001 - a malformed answer: end what waits here, never leave it hanging
            self._fail_all(Outcome(ERROR, error=RuntimeError(f"the poll of slot {self.key} failed: {exc!r}")))
        finally:
            self._poll = None
            if not self.queues:
                self._taps.drop(self.key, self)


class Taps:
    """One client's taps, by shard (``key``: its slot and incarnation)."""

    def __init__(self, view: Any) -> None:
        self.view = view  # its ``door`` carries the calls
        self.id = uuid.uuid4().hex  # the shards' outboxes know this client by it
        self._taps: dict[Hashable, _Tap] = {}
        self._submits = ServeBatcher(view, one=None, many="submit", lead=(self.id,))
        self.polls = 0  # take_output calls answered or failed

    @property
    def submits(self) -> int:
        return self._submits.calls

    def drop(self, key: Hashable, tap: _Tap) -> None:
        if self._taps.get(key) is tap:
            del self._taps[key]

    async def stream(self, key: Hashable, handle: Any, request_id: str, wire: bytes, timeout: float):
        """The request's ``Outcome``s as its own stream would give them: ``ok`` chunks, then its end; a
        ``timed_out`` one when ``timeout`` passes first (the caller aborts it on the shard)."""
        tap = self._taps.get(key)
        if tap is None:
            tap = self._taps[key] = _Tap(self, key, handle)
        q = tap.watch(request_id)
        timer = asyncio.get_running_loop().call_later(timeout, q.put, _TIMED_OUT)  # (one timer, not one per chunk)
        try:
            started = await self._submits.serve(key, handle, wire, timeout)
            if not started.ok:  # refused as malformed, or the shard could not take it
                yield started
                return
            while True:
                out = await q.get()
                if out is _TIMED_OUT:
                    yield Outcome(TIMED_OUT, error=TimeoutError(f"request {request_id} did not end within {timeout:g} s"),
                                  elapsed_s=timeout)
                    return
                yield out
                if not (out.kind == OK and isinstance(out.value, Chunk)):
                    return
        finally:
            timer.cancel()
            tap.unwatch(request_id, q)
