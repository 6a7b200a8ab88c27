"""A client's requests on a shard, and their output: the caller's side of ``fleet.shard.outbox``.

A request whose output the client watches as it is made (a streaming caller, or a long one whose output is
held against its engine's death) is submitted tapped (``EngineShard.submit``), and its output comes back with
every other such request's on that shard at once, one answer per interval. ``Taps.stream`` gives each request
its own view: the ``Outcome``s a stream of its own would have given (``ok`` chunks, then its result, or its
failure after the chunks sent before it), so ``fleet.data.dispatch`` handles both the same way.

Two carriers, the same outbox on the shard:

- a data link (``fleet.link``), when the client was made ``linking`` and the shard takes one: one TCP
  connection per client and shard carries the submissions (every request ready in one turn of the loop in one
  frame) and the outbox's answers as they come due, with no poll. Plain requests (short, nobody watching) go
  over it too, as submissions whose end alone comes back. A link that breaks ends every request it fed: as
  ``died`` when one actor call to the shard says it died, else with the link's error (the dispatcher re-sends
  them; the shard aborts them);
- actor calls: submissions batched per turn (``fleet.data.batch``), one ``take_output`` poll per answer
  while any request there is watched, plain requests as ``serve``/``serve_many``. A poll that fails ends every
  watched request there with that failure (the shard died: each one's outcome is ``died``), except a poll
  that timed out in transit, which is sent again: a hung shard is the monitor's to find, and each request's
  own deadline still bounds it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from typing import Any, Hashable

from rlfleet.fleet.data.batch import ServeBatcher
from rlfleet.fleet.data.link import Link
from rlfleet.fleet.link import OPEN_S, LinkError
from rlfleet.fleet.outcome import ERROR, OK, TIMED_OUT, Outcome, answer_outcome
from rlfleet.fleet.types import Chunk

log = logging.getLogger(__name__)

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
    """The watched requests on one shard, and what feeds them: its data link, or a poll."""

    def __init__(self, taps: "Taps", key: Hashable, handle: Any) -> None:
        self._taps, self.key, self.handle = taps, key, handle
        self.queues: dict[str, _Inbox] = {}
        self._poll: asyncio.Future | None = None
        self.link: Link | None = None
        self._linking = asyncio.ensure_future(self._open_link()) if taps.linking else None

    async def linked(self) -> Link | None:
        """Its data link once the attempt to open one settled (None: the shard takes actor calls only)."""
        if self._linking is not None and not self._linking.done():
            await asyncio.shield(self._linking)
        return self.link

    async def _open_link(self) -> None:
        out = await self._taps.view.door.call(self.handle, "open_link", timeout=OPEN_S)
        if not out.ok or out.value is None:  # a shard with no links, or a failure the actor calls will meet too
            return
        try:
            self.link = await Link.open(out.value, self._taps.id, self)
            self._taps.links += 1
        except Exception as exc:  # noqa: BLE001 - refused, unreachable, or not an address: actor calls it is
            log.warning("no data link to slot %s (%r): its requests go by actor calls", self.key, exc)

    def watch(self, request_id: str) -> _Inbox:
        q = self.queues[request_id] = _Inbox()
        if self._poll is None and self.link is None:
            self._poll = asyncio.ensure_future(self._polling())
        return q

    def unwatch(self, request_id: str, q: _Inbox) -> None:
        """Stop feeding ``q`` (an attempt's generator may close after the next attempt of its request began
        watching the same shard: that one's queue stays)."""
        if self.queues.get(request_id) is q:
            del self.queues[request_id]

    def fail_all(self, out: Outcome) -> None:
        for q in self.queues.values():
            q.put(out)

    def _deliver(self, items: Any, elapsed_s: float) -> None:
        for request_id, item in items:
            q = self.queues.get(request_id)
            if q is not None:  # one that ended here or was given up on: nobody waits for it
                q.put(answer_outcome(item, elapsed_s))

    # the link's owner (``fleet.data.link.LinkOwner``)
    def batched(self, requests: int) -> None:
        self._taps.link_batched += requests

    def started(self, request_ids: list[str], answers: list[Any]) -> None:
        self._deliver([(rid, a) for rid, a in zip(request_ids, answers) if a is not True], 0.0)

    def out(self, items: list[tuple[str, Any]]) -> None:
        self._taps.answers += 1
        self._deliver(items, 0.0)

    def lost(self, error: BaseException) -> None:
        """The link broke: this tap is done (the next request opens another), and what it fed ends, as died if
        Ray says the shard is gone, else with the link's error (the shard, alive, aborts what ran over it)."""
        self.link = None
        self._taps.drop(self.key, self)
        self._taps.keep(asyncio.ensure_future(self._after_loss(error)))

    async def _after_loss(self, error: BaseException) -> None:
        # a call that takes nothing (a poll would take output a next link of this client's is owed)
        out = await self._taps.view.door.call(self.handle, "in_flight", timeout=POLL_SLACK_S)
        self.fail_all(out if not out.ok and out.kind != TIMED_OUT else
                       Outcome(ERROR, error=LinkError(f"the data link to slot {self.key} broke: {error}")))

    async def _polling(self) -> None:
        door = self._taps.view.door
        try:
            while self.queues:
                out = await door.call(self.handle, "take_output", self._taps.id, POLL_WAIT_S,
                                      timeout=POLL_WAIT_S + POLL_SLACK_S)  # fmt: skip
                self._taps.polls += 1
                if out.ok:
                    self._deliver(out.value, out.elapsed_s)
                elif out.kind != TIMED_OUT:  # the shard failed: so did every request watched there
                    self.fail_all(out)
                    return
        except Exception as exc:  # noqa: BLE001 - a malformed answer: end what waits here, never leave it hanging
            self.fail_all(Outcome(ERROR, error=RuntimeError(f"the poll of slot {self.key} failed: {exc!r}")))
        finally:
            self._poll = None
            if not self.queues and self.link is None:
                self._taps.drop(self.key, self)


class Taps:
    """One client's taps, by shard (``key``: its slot and incarnation). ``linking``: open a data link to each
    shard that takes one (``fleet.link``); otherwise every request goes by actor calls."""

    def __init__(self, view: Any, linking: bool = False) -> None:
        self.view = view  # its ``door`` carries the calls
        self.linking = linking
        self.id = uuid.uuid4().hex  # the shards' outboxes know this client by it
        self._taps: dict[Hashable, _Tap] = {}
        self._submits = ServeBatcher(view, one=None, many="submit", lead=(self.id,))
        self._plain = ServeBatcher(view)  # plain calls ready at once for one shard go as one
        self._work: set[asyncio.Future] = set()  # background work (a lost link's reckoning), referenced until done
        self.polls = 0  # take_output calls answered or failed
        self.links = 0  # data links opened
        self.link_batched = 0  # requests that went in a link's frame with others
        self.answers = 0  # output answers taken over data links (each every request's output that was due)

    @property
    def submits(self) -> int:
        return self._submits.calls

    @property
    def batched(self) -> int:
        """Requests sent with others in one call or frame (``fleet.data.batch``, ``fleet.data.link``)."""
        return self._plain.batched + self.link_batched

    def keep(self, future: asyncio.Future) -> None:
        self._work.add(future)
        future.add_done_callback(self._work.discard)

    def drop(self, key: Hashable, tap: _Tap) -> None:
        if self._taps.get(key) is tap:
            del self._taps[key]

    def close(self) -> None:
        """Close every data link (each shard aborts what this client started there and still runs)."""
        for key, tap in list(self._taps.items()):
            if tap.link is not None:
                tap.link.close()
                tap.link = None
                self.drop(key, tap)
                tap.fail_all(Outcome(ERROR, error=LinkError(f"the data link to slot {key} was closed by its client")))

    async def stream(self, key: Hashable, handle: Any, request_id: str, wire: bytes, timeout: float,
                     watched: bool = True):
        """The request's ``Outcome``s as its own stream would give them: ``ok`` chunks, then its end; a
        ``timed_out`` one when ``timeout`` passes first (the caller aborts it on the shard). ``watched`` False:
        a plain call's request, whose end alone comes (over the shard's data link, or as one ``serve`` call)."""
        tap = self._taps.get(key)
        if tap is None:
            tap = self._taps[key] = _Tap(self, key, handle)
        link = await tap.linked()
        if link is None and not watched:
            yield await self._plain.serve(key, handle, wire, timeout)
            return
        q = tap.watch(request_id)
        timer = asyncio.get_running_loop().call_later(timeout, q.put, _TIMED_OUT)  # (one timer, not one per chunk)
        try:
            if link is not None and not link.closed:
                link.send(request_id, wire, watched)
            elif link is not None:  # it broke while this request waited for it: as if it broke under it
                yield Outcome(ERROR, error=LinkError(f"the data link to slot {key} broke"))
                return
            else:
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
