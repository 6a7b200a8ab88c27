"""The controller's background loops, each a body run once per tick, that no exception ends.

Ray Serve's controller wraps every manager update of its one control loop, because an unhandled
exception there must never halt it. Here each loop (the health timers, the liveness monitor, the
admission poll) is ``run_loop``: an exception from one tick is logged as a ``loop_error`` record naming
the loop, the error, and how many ticks of that loop have failed so far, and the loop goes on at the next
tick. Only cancellation (shutdown) ends a loop.
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Awaitable, Callable

from rlfleet.fleet.eventlog import EventLog
from rlfleet.fleet.records import Fault, LoopError

LOOPS = ("health timers", "liveness monitor", "admission")


async def run_loop(name: str, interval: Callable[[], float], tick: Callable[[], Awaitable[None]],
                   log: EventLog) -> None:
    """Every ``interval()`` seconds, ``await tick()``; an exception from it is logged and the loop goes on."""
    failed = 0
    while True:
        await asyncio.sleep(interval())
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a loop that dies stops restarts, evictions or admission for good
            failed += 1
            where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            log.emit(LoopError(loop=name, error=f"{type(exc).__name__}: {exc}"[:500], failed_ticks=failed,
                               at=None if where is None else f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"))


class InjectedLoopError(RuntimeError):
    """A tick of a background loop raised on purpose (``LoopFaults``)."""


class LoopFaults:
    """Fault injection: the next ``times`` ticks of a named loop raise ``InjectedLoopError`` before they run."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._armed: dict[str, int] = {}

    def arm(self, loop: str, times: int = 1) -> bool:
        if loop not in LOOPS:
            raise ValueError(f"arm_loop_fault: loop must be one of {LOOPS}, got {loop!r}")
        if isinstance(times, bool) or not isinstance(times, int) or not 1 <= times <= 100:
            raise ValueError(f"arm_loop_fault: times must be an integer in [1, 100], got {times!r}")
        self._armed[loop] = times
        self._log.emit(Fault(target="controller", point=loop, action="loop_error", armed=True))
        return True

    def wrap(self, loop: str, tick: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        async def faulty() -> None:
            left = self._armed.get(loop, 0)
            if left:
                self._armed[loop] = left - 1
                self._log.emit(Fault(target="controller", point=loop, action="loop_error", fired=True))
                raise InjectedLoopError(f"injected into a tick of the {loop} loop")
            await tick()

        return faulty
