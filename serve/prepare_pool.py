"""Blocking request preparation (tokenizing, chat rendering) off the routing loop, bounded in queue and in time.

A multi-megabyte prompt or a hostile chat template (a request's own, under
``--trust-request-chat-template``) can keep a thread busy for seconds or hours. Run on the
loop that routes every request, it would hold ``/health`` and every other request; run on one
plain thread, it would hold every request behind it. Here:

- jobs run on a worker thread, one at a time, in arrival order; each worker has its own
  resources (a ``kit``: tokenizer and chat renderer), because a fast tokenizer used from two
  threads at once fails ("Already borrowed");
- at most ``max_waiting`` jobs wait: past that ``PoolBusy`` at once (the front answers 429);
- a job that runs longer than ``limit_s`` is given up on: its caller gets ``PrepareTimeout``
  (the front answers 400 naming the field), and a fresh worker with a fresh kit takes the
  stuck one's place, so the jobs behind it go on. A thread cannot be killed: the stuck one
  finishes its job and then exits. At most ``max_stuck`` are left running so; with that many,
  a new job gets ``PoolBusy`` until one of them ends.

No Ray, no vLLM: the kits are the caller's.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable


class PoolBusy(RuntimeError):
    """No room for another job (its queue is full, or every worker is held past its time limit)."""


class PrepareTimeout(TimeoutError):
    """A job ran longer than the pool's time limit; its caller no longer waits for it."""


class _Job:
    def __init__(self, fn: Callable, args: tuple, future: asyncio.Future) -> None:
        self.fn, self.args, self.future = fn, args, future
        self.loop = future.get_loop()
        self.started: float | None = None  # time.monotonic() when a worker took it
        self.given_up = False

    def settle(self, ok: bool, value: Any) -> None:  # on the loop
        if self.future.done():
            return
        if ok:
            self.future.set_result(value)
        else:
            self.future.set_exception(value)


class PreparePool:
    def __init__(self, kit: Any, make_kit: Callable[[], Any], limit_s: float = 10.0, max_waiting: int = 256,
                 max_stuck: int = 4, name: str = "rlfleet-prepare") -> None:
        """``kit``: the first worker's resources; ``make_kit()``: a new set for a worker that replaces a stuck
        one (called on that worker's own thread)."""
        self.limit_s = float(limit_s)
        self.max_waiting = int(max_waiting)
        self.max_stuck = int(max_stuck)
        self._make_kit = make_kit
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[int, _Job] = {}  # worker number -> the job it runs
        self._stuck: set[int] = set()  # workers given up on, still running their job
        self._workers = 0
        self.waiting = 0  # jobs submitted and not ended (on the loop's side)
        self.timed_out = 0
        self.replaced = 0
        self._start(kit)

    # ------------------------------------------------------------------ the loop's side
    async def run(self, fn: Callable, *args: Any) -> Any:
        """``fn(kit, *args)`` on a worker; its result, or what it raised. ``PoolBusy`` when there is no room,
        ``PrepareTimeout`` when it ran past ``limit_s``."""
        with self._lock:
            wedged = len(self._stuck) >= self.max_stuck
        if wedged:
            raise PoolBusy(f"every preparing thread is held by a request that ran past {self.limit_s:g} s")
        if self.waiting >= self.max_waiting:
            raise PoolBusy(f"{self.waiting} requests are waiting to be tokenized or rendered, the bound")
        job = _Job(fn, args, asyncio.get_running_loop().create_future())
        self.waiting += 1
        self._queue.put(job)
        try:
            return await self._wait(job)
        finally:
            self.waiting -= 1
            job.given_up = True  # a cancelled caller's job is skipped if no worker took it yet

    async def _wait(self, job: _Job) -> Any:
        wait = self.limit_s
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(job.future), timeout=wait)
            except asyncio.TimeoutError:
                pass
            with self._lock:
                started = job.started
            if started is None:  # still queued behind others: not this job's time yet
                wait = self.limit_s
                continue
            ran = time.monotonic() - started
            if ran < self.limit_s:
                wait = self.limit_s - ran
                continue
            if job.future.done():
                return job.future.result()
            self._give_up(job)
            job.future.cancel()  # what the stuck worker ends with goes nowhere
            raise PrepareTimeout(f"preparing the request took longer than {self.limit_s:g} s (given up on)")

    def _give_up(self, job: _Job) -> None:
        with self._lock:
            worker = next((w for w, j in self._running.items() if j is job), None)
            if worker is None:  # it ended just now
                return
            self._stuck.add(worker)
            self.timed_out += 1
            self.replaced += 1
        self._start(None)

    # ------------------------------------------------------------------ the workers' side
    def _start(self, kit: Any) -> None:
        with self._lock:
            self._workers += 1
            number = self._workers
        threading.Thread(target=self._work, args=(number, kit), name=f"{self._name}-{number}", daemon=True).start()

    def _work(self, number: int, kit: Any) -> None:
        if kit is None:
            kit = self._make_kit()
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.given_up:
                    continue
                job.started = time.monotonic()
                self._running[number] = job
            try:
                ok, value = True, job.fn(kit, *job.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as raised
                ok, value = False, exc
            with self._lock:
                self._running.pop(number, None)
                retire = number in self._stuck
                self._stuck.discard(number)
            try:
                job.loop.call_soon_threadsafe(job.settle, ok, value)
            except RuntimeError:  # its loop closed
                pass
            if retire:  # a fresh worker took this one's place while it ran
                return

    def close(self) -> None:
        """Workers exit once they are idle (a stuck one when its job ends)."""
        with self._lock:
            n = self._workers
        for _ in range(n):
            self._queue.put(None)
