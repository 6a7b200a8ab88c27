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

from fleet.eventlog import EventLog
from fleet.records import LoopError


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
