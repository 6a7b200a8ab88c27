"""``EngineShard``'s side of a client's watched requests (``fleet.shard.outbox`` holds the outbox and its rules;
``fleet.data.taps`` is the client's side): a mixin, so the shard's own module keeps to serving and the
refit's calls. ``self`` is the ``EngineShard``."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from rlfleet.fleet.errors import BadRequestError
from rlfleet.fleet.shard.link_server import LinkServer
from rlfleet.fleet.shard.outbox import Outbox, Outboxes
from rlfleet.fleet.shard.stream_pace import StreamPace
from rlfleet.fleet.types import Chunk, Piece
from rlfleet.fleet.wire import ServeRequest, decode_request


class TapMethods:
    _outboxes: Outboxes
    _tasks: set[asyncio.Future]
    _hooks: Any
    _link: LinkServer | None
    _node_ip: Callable[[], str | None]
    _pace: StreamPace
    _gathered: dict[int, int]

    # what the shard itself provides (``EngineShard``'s own methods come first in its MRO)
    def _who(self) -> str:
        raise NotImplementedError

    async def _abort_quietly(self, request_ids: Any) -> None:
        raise NotImplementedError

    async def _run(self, prompt, sampling, request_id, cache_salt, timeout, ticket, carried, emit,
                   gather: int = 1) -> Any:
        raise NotImplementedError

    async def submit(self, tap: str, requests: list[bytes]) -> list[bool | BaseException]:
        """Start requests whose output the client ``tap`` takes as it comes (``take_output``; see
        ``fleet.shard.outbox``): each item True once started, or the ``BadRequestError`` that refused it. Every
        started request ends in the outbox, with its result or the exception its run raised (a refusal too)."""
        return self.submit_on(tap, requests)

    def submit_on(self, tap: str, requests: list[bytes], watched: list[bool] | None = None,
                  started: set[str] | None = None) -> list[bool | BaseException]:
        """``submit``, also for a data link (``fleet.shard.link_server``): ``watched[i]`` False runs request i
        with no output until its end (a plain call's request); ``started`` collects the ids started."""
        for rid in self._outboxes.orphans():  # clients that stopped taking: their requests stop
            self._spawn(self._abort_quietly([rid]))
        self._outboxes.idle()
        box = self._outboxes.open(tap)
        answers: list[bool | BaseException] = []
        for i, wire in enumerate(requests):
            try:
                r = decode_request(wire)
                if r.request_id is None:
                    raise BadRequestError("a submitted request needs its request_id (its output is told by it)")
            except BadRequestError as exc:
                answers.append(exc)
                continue
            self._start_tapped(box, r, watched is None or bool(watched[i]))
            if started is not None:
                started.add(r.request_id)
            answers.append(True)
        return answers

    async def open_link(self) -> tuple[str, int, bytes] | None:
        """Where this shard takes data links (``fleet.link``): its address, port and the links' secret; None
        where it takes none (outside Ray). Listens from the first call on."""
        if self._link is None:
            host = self._node_ip()
            if host is None:
                return None
            self._link = LinkServer(self, host)
        return await self._link.address()

    def _start_tapped(self, box: Outbox, r: ServeRequest, watched: bool = True) -> None:
        rid = r.request_id
        assert rid is not None
        box.start(rid, r.interval_s)
        wanted = r.first_at_once

        def emit(pieces: list[Piece], prompt: tuple[int, ...] | None, version: int) -> None:
            box.offer(rid, pieces, prompt, version, urgent=wanted and prompt is not None)  # a first chunk awaited

        def ended(run: asyncio.Future) -> None:
            box.end(rid, asyncio.CancelledError(f"request {rid} was cancelled on {self._who()}") if run.cancelled()
                    else (run.exception() or run.result()))

        gather = 1  # a plain request has one output, its end
        if watched:  # a watched one's output in gathers that fit its interval
            gather = self._pace.gather(r.interval_s)
            self._gathered[gather] = self._gathered.get(gather, 0) + 1
        run = self._spawn(self._run(r.prompt, r.sampling, rid, r.cache_salt, None, r.ticket(), r.carried,
                                    emit if watched else None, gather))
        run.add_done_callback(ended)

    def _spawn(self, work) -> asyncio.Future:
        """Run ``work`` on the shard's loop, referenced until it is done."""
        future = asyncio.ensure_future(work)
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)
        return future

    async def take_output(self, tap: str, wait_s: float = 1.0) -> list[tuple[str, Any]]:
        """What the client ``tap``'s submitted requests made since its last take, every request's at once
        (``fleet.shard.outbox.Outbox.take``): empty after ``wait_s`` (at most 10 s) if nothing came."""
        answer = await self._outboxes.open(tap).take(min(float(wait_s), 10.0))
        if self._hooks.armed_at("stream"):  # mid-generation, as output goes out: once per request's chunk in it
            for _ in range(sum(isinstance(item, Chunk) for _, item in answer)):
                await self._hooks.at("stream")
        return answer
