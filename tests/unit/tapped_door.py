"""Scripted shards for unit tests, answering the data plane's watched requests as ``EngineShard`` does.

A test door scripts each request's output as the ``Outcome``s a shard's work on it comes to (``ok``
chunks, then the result, or a failure). ``TappedShards`` runs those scripts behind ``EngineShard.submit`` and
``take_output``, into the shard's own ``fleet.shard.outbox.Outbox`` (on the event loop's clock, so virtual
time paces it): what leaves when, in what order, and what a failed request's held output comes with, are
the shard's. A script that fails as a shard does (``died``, ``unavailable``) fails that shard's polls, as a
dead actor's calls fail, once the output it held went out (a shard that sent what it made, then died: a
real death may lose the last interval's output, which the fault matrix shows on real engines); a hang
(``timed_out`` that is not the shard's own deadline) never answers.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from rlfleet.fleet.errors import BadRequestError, DeadlineExceeded
from rlfleet.fleet.outcome import DIED, OK, TIMED_OUT, UNAVAILABLE, Outcome
from rlfleet.fleet.shard.outbox import Outbox
from rlfleet.fleet.types import Chunk
from rlfleet.fleet.wire import decode_request

Script = Callable[[Any, bytes, float], AsyncIterator[Outcome]]
TAPPED = ("submit", "take_output")


class TappedShards:
    """``submit`` and ``take_output`` over per-request scripts (``script(handle, request, timeout)``)."""

    def __init__(self, script: Script, key: Callable[[Any], Any] = id) -> None:
        self._script, self._key = script, key
        self._boxes: dict[tuple[Any, str], Outbox] = {}
        self._failed: dict[Any, asyncio.Future] = {}
        self._tasks: set[asyncio.Future] = set()
        self.submitted: list[Any] = []  # (handle, request id) in the order submitted

    def _box(self, handle: Any, tap: str) -> Outbox:
        k = (self._key(handle), tap)
        if k not in self._boxes:
            self._boxes[k] = Outbox(asyncio.get_running_loop().time)
        return self._boxes[k]

    def _failure(self, handle: Any) -> asyncio.Future:
        k = self._key(handle)
        if k not in self._failed:
            self._failed[k] = asyncio.get_running_loop().create_future()
        return self._failed[k]

    async def answer(self, handle: Any, method: str, args: tuple, timeout: float) -> Outcome:
        if method == "submit":
            return self._submit(handle, args[0], args[1], timeout)
        return await self._take(handle, args[0], args[1])

    def _submit(self, handle: Any, tap: str, requests: list[bytes], timeout: float) -> Outcome:
        failed = self._failure(handle)
        if failed.done():
            return failed.result()
        box = self._box(handle, tap)
        answers: list[Any] = []
        for wire in requests:
            try:
                r = decode_request(wire)
            except BadRequestError as exc:
                answers.append(exc)
                continue
            assert r.request_id is not None
            box.start(r.request_id, r.interval_s)
            self.submitted.append((handle, r.request_id))
            task = asyncio.ensure_future(self._feed(handle, box, r.request_id, r.first_at_once,
                                                    self._script(handle, wire, timeout)))  # fmt: skip
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            answers.append(True)
        return Outcome(OK, value=answers)

    async def _feed(self, handle: Any, box: Outbox, rid: str, first_at_once: bool,
                    items: AsyncIterator[Outcome]) -> None:
        first = True
        async for out in items:
            if out.ok and isinstance(out.value, Chunk):
                chunk = out.value
                box.offer(rid, list(chunk.pieces), chunk.prompt_token_ids,
                          chunk.pieces[0].version if chunk.pieces else 0, urgent=first_at_once and first)
                first = False
                continue
            if out.ok:
                box.end(rid, out.value)
            elif out.kind in (DIED, UNAVAILABLE):  # the shard failed: every poll of it does now
                failed = self._failure(handle)
                if not failed.done():
                    failed.set_result(out)
            elif out.kind == TIMED_OUT and not isinstance(out.error, DeadlineExceeded):
                pass  # hung: nothing more comes
            else:
                box.end(rid, out.error)
            return

    async def _take(self, handle: Any, tap: str, wait_s: float) -> Outcome:
        box, failed = self._box(handle, tap), self._failure(handle)
        if not failed.done():
            take = asyncio.ensure_future(box.take(wait_s))
            await asyncio.wait({take, failed}, return_when=asyncio.FIRST_COMPLETED)
            if take.done():
                return Outcome(OK, value=take.result())
            take.cancel()
        if box.holds():  # what it made before it failed goes out first
            box.hurry()
            return Outcome(OK, value=await box.take(0.0))
        return failed.result()

