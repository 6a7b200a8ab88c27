"""Simulated time: an asyncio event loop whose clock jumps to its next timer.

Whenever nothing is ready to run, ``VirtualTimeLoop`` moves its time to the next
scheduled timer instead of sleeping, so ``asyncio.sleep``, ``wait_for`` deadlines,
probe intervals, restart backoffs and engine start times all pass in no real time,
in a deterministic order. ``LoopClock`` is the controller's clock on that loop (the
same seconds the loop's timers use). Real CPU time is not simulated: code that runs
between two timers takes no simulated time at all, which is what lets the simulator
measure the controller's own CPU cost separately (``time.process_time``).

Real I/O is still served: the selector is polled first, and blocks for real only when
no timer is pending at all.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Coroutine

__all__ = ["LoopClock", "VirtualTimeLoop", "run_virtual"]

MAXIMUM_SELECT_TIMEOUT = 24 * 3600  # asyncio's own cap on a select's timeout (``base_events``)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only by jumping to the next timer when nothing else can run."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0
        poll = self._selector.select

        def select(timeout: float | None = None):
            events = poll(0)
            if events or (timeout is not None and timeout <= 0):
                self._reach_timers_run_now()
                return events
            if timeout is None:
                return poll(None)
            # Nothing is ready: jump to the next timer itself, not to now + timeout. At a large virtual time a
            # timeout below the float's resolution there leaves now + timeout == now, and the loop would spin
            # forever on a timer it never reaches (issue 47: a 5 ns timer at 3e7 s).
            target = self._virtual_now + timeout
            if self._scheduled and timeout < MAXIMUM_SELECT_TIMEOUT:
                target = max(target, self._scheduled[0]._when)
                if target + self._clock_resolution == target:  # asyncio runs a timer once now + resolution passes it
                    target = math.nextafter(target, math.inf)
            self._virtual_now = target
            return []

        self._selector.select = select

    def _reach_timers_run_now(self) -> None:
        """After a select, asyncio runs every timer due before now + its clock resolution (1 ns): with work ready
        (no jump), one due a few ulps from now runs early, at a time before its own. Code that waits until a
        deadline then finds it not passed and waits the few ulps left again, forever at one virtual instant
        (issue 47: a request held by a closed gate, 2e-16 s before its timeout). The clock moves to that timer."""
        if self._scheduled:
            when = self._scheduled[0]._when
            if self._virtual_now < when < self._virtual_now + self._clock_resolution:
                self._virtual_now = when

    def time(self) -> float:
        return self._virtual_now


class LoopClock:
    """The running loop's time as a ``health.Clock`` (virtual seconds on a ``VirtualTimeLoop``)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()


def run_virtual(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
