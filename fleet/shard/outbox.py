"""What one client's requests on this shard made, sent to it as one answer per interval, however many run.

A request a client watches while it runs (a streaming caller, or one long enough that its output is worth
holding against the engine's death: ``fleet.data.dispatch``) is submitted tapped (``EngineShard.submit``):
its output goes into its client's ``Outbox`` on this shard, and the client takes it with one call
(``EngineShard.take_output``) that answers every request's output at once. The cost of streaming is then
per answer, not per request and answer: at 256 requests and 20 answers a second, 20 actor messages a second
instead of over 5,000. The answer is ordered: for each request, its output in the order the engine made it,
then its end (the result, or the exception its run raised), so a client that took a request's end holds
everything that request made before it.

When an answer leaves: at once when it carries an end, or a first chunk a caller waits on (``urgent``);
otherwise once ``interval_s`` (the smallest of the requests it holds) has passed since the last answer. A
request that ended well drops what it still held (its result carries the whole output); one that failed
keeps it, ahead of its exception, for the client to continue from. ``take`` with nothing to answer returns
empty after ``wait_s``: the client's poll is bounded, and a poll that stops (the client died) leaves an
outbox ``orphaned``, whose requests the shard then aborts.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable

from rlfleet.fleet.types import Chunk, Piece

ORPHAN_S = 30.0  # an outbox nobody polled for this long belongs to a client that is gone


def _loop_time() -> float:
    """The running event loop's clock (a virtual loop's in tests): outboxes live on the shard's loop."""
    return asyncio.get_running_loop().time()


class _Run:
    """Pieces of one completion made at one version, joined as they are offered: an answer carries about one
    piece per request and completion, whatever the engine steps between two answers were (with n > 1, the
    completions' runs side by side: each one's pieces in order, not interleaved). A piece with prompt
    logprobs starts a run; one whose top logprobs are present where the run's are not (or the reverse), or
    whose completion or version differs, starts the next; a completion's last piece (its finish reason and
    the engine's spans) ends it."""

    __slots__ = ("index", "version", "tokens", "logprobs", "text", "tops", "finish", "stop", "spans", "prompt_lps")

    def __init__(self, piece: Piece, version: int) -> None:
        self.index, self.version = piece.index, version
        self.tokens, self.logprobs, self.text = list(piece.token_ids), list(piece.logprobs), [piece.text]
        self.tops = None if piece.top_logprobs is None else list(piece.top_logprobs)
        self.finish, self.stop, self.spans = piece.finish_reason, piece.stop_reason, piece.spans
        self.prompt_lps = piece.prompt_logprobs

    def join(self, piece: Piece, version: int) -> bool:
        """Add ``piece`` if it goes on this run."""
        if (self.finish is not None or piece.index != self.index or version != self.version
                or piece.prompt_logprobs is not None or (piece.top_logprobs is None) != (self.tops is None)):
            return False
        self.tokens += piece.token_ids
        self.logprobs += piece.logprobs
        self.text.append(piece.text)
        if self.tops is not None:
            self.tops += piece.top_logprobs  # type: ignore[arg-type]
        if piece.finish_reason is not None:
            self.finish, self.stop, self.spans = piece.finish_reason, piece.stop_reason, piece.spans
        return True

    def piece(self) -> Piece:
        return Piece(self.index, tuple(self.tokens), tuple(self.logprobs), "".join(self.text), self.version,
                     None if self.tops is None else tuple(self.tops), self.finish, self.stop, self.spans,
                     self.prompt_lps)


def _last_of(runs: list[_Run], index: int) -> _Run | None:
    """The last run of completion ``index`` (the last run, with one completion)."""
    for run in reversed(runs):
        if run.index == index:
            return run
    return None


class Outbox:
    """One client's output on this shard. Not thread-safe: the shard's event loop owns it."""

    def __init__(self, clock: Callable[[], float] = _loop_time) -> None:
        self._clock = clock
        self._held: dict[str, list[_Run]] = {}  # request id -> its output not yet taken
        self._held_interval = math.inf  # the smallest interval of the requests that hold output
        self._prompts: dict[str, tuple[int, ...]] = {}  # request id -> prompt ids, with its first chunk
        self._intervals: dict[str, float] = {}  # request id -> its interval, while it runs
        self._ends: list[tuple[str, Any]] = []  # (request id, result or exception), in the order they ended
        self._urgent = False
        self._last = -math.inf  # when the last answer left
        self._wake = asyncio.Event()
        self._polling = False
        self.polled_at = clock()

    def start(self, request_id: str, interval_s: float) -> None:
        self._intervals[request_id] = interval_s

    def offer(self, request_id: str, pieces: list[Piece], prompt: tuple[int, ...] | None, version: int,
              urgent: bool) -> None:
        """``request_id``'s new output, made at weight ``version`` (``prompt``: the prompt's ids, with its first
        output; ``urgent``: a caller waits on it, send it now). Joined to what the request holds (``_Run``)."""
        wake = urgent
        held = self._held.get(request_id)
        if held is None:  # only what moves the answer's due time earlier wakes the taker
            interval = self._intervals.get(request_id, 0.0)
            wake = wake or interval < self._held_interval
            self._held_interval = min(self._held_interval, interval)
            held = self._held[request_id] = []
        for piece in pieces:
            last = _last_of(held, piece.index)
            if last is None or not last.join(piece, version):
                held.append(_Run(piece, version))
        if prompt is not None:
            self._prompts[request_id] = prompt
        self._urgent = self._urgent or urgent
        if wake:
            self._wake.set()

    def end(self, request_id: str, ending: Any) -> None:
        """``request_id`` ended with ``ending``: a result (what it still held is dropped: the result carries it
        all) or an exception (what it held goes first, for the client to continue from)."""
        self._intervals.pop(request_id, None)
        if not isinstance(ending, BaseException):
            self._held.pop(request_id, None)
            self._prompts.pop(request_id, None)
        self._ends.append((request_id, ending))
        self._wake.set()

    def holds(self) -> bool:
        """Whether anything waits to be taken."""
        return bool(self._held or self._ends)

    def hurry(self) -> None:
        """Let what is held leave with the next answer, due or not."""
        self._urgent = True
        self._wake.set()

    @property
    def running(self) -> list[str]:
        return list(self._intervals)

    @property
    def idle(self) -> bool:
        """Nothing running, nothing to take, nobody waiting on it."""
        return not self._intervals and not self.holds() and not self._polling

    def orphaned(self) -> bool:
        return not self._polling and self._clock() - self.polled_at > ORPHAN_S

    def _due(self) -> float:
        """When the held output may leave (now or earlier: it may)."""
        if self._ends or self._urgent:
            return -math.inf
        return self._last + self._held_interval if self._held else math.inf

    async def take(self, wait_s: float) -> list[tuple[str, Any]]:
        """Everything due, as ``(request id, Chunk | result | exception)`` in order; empty after ``wait_s``."""
        self._polling = True
        try:
            give_up = self._clock() + wait_s
            while True:
                now = self._clock()
                due = self._due()
                if due <= now:
                    break
                left = min(due, give_up) - now
                if left <= 0:
                    return []
                self._wake.clear()
                try:  # (``asyncio.timeout``, not ``wait_for``: no task made per wait)
                    async with asyncio.timeout(left):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            return self._answer(now)
        finally:
            self._polling = False
            self.polled_at = self._clock()

    def _answer(self, now: float) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [(rid, Chunk(tuple([run.piece() for run in runs]), self._prompts.pop(rid, None)))
                                      for rid, runs in self._held.items()]  # fmt: skip
        out += self._ends
        self._held, self._ends, self._urgent, self._last, self._held_interval = {}, [], False, now, math.inf
        return out


class Outboxes:
    """This shard's outboxes, by client (its tap id)."""

    def __init__(self, clock: Callable[[], float] = _loop_time) -> None:
        self._clock = clock
        self._boxes: dict[str, Outbox] = {}

    def open(self, tap: str) -> Outbox:
        box = self._boxes.get(tap)
        if box is None:
            box = self._boxes[tap] = Outbox(self._clock)
        return box

    def get(self, tap: str) -> Outbox | None:
        return self._boxes.get(tap)

    def orphans(self) -> list[str]:
        """Request ids whose client stopped polling; their outboxes are let go."""
        gone = [tap for tap, box in self._boxes.items() if box.orphaned()]
        return [rid for tap in gone for rid in self._boxes.pop(tap).running]

    def idle(self) -> None:
        """Let go of outboxes with nothing running and nothing left to take."""
        for tap in [t for t, b in self._boxes.items() if b.idle]:
            del self._boxes[tap]
