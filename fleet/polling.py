"""Polling a condition from synchronous code, on tenacity: the driver's waits, the fault runner's, the demo's.

``poll`` calls a function every ``every_s`` until its result is done or ``timeout_s`` has passed and returns
the last result (the caller reads from it why it stopped); ``wait_until`` is the boolean form. Both are
bounded and never raise for a condition that does not come true: the function's own exceptions pass through.
Waits inside the controller's event loop are ``asyncio`` sleeps, never these.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from tenacity import Retrying, retry_if_result, wait_fixed

T = TypeVar("T")


def poll(fn: Callable[[], T], done: Callable[[T], object], timeout_s: float, every_s: float,
         clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None) -> T:
    """Call ``fn`` every ``every_s`` until ``done(result)`` is true or ``timeout_s`` has passed on ``clock``
    (``time.monotonic``, sleeping with ``sleep``: a caller's own, which its tests may replace); the last result."""
    clock = clock or time.monotonic
    deadline = clock() + max(0.0, float(timeout_s))
    last: list[T] = []

    def attempt() -> T:
        last[:] = [fn()]
        return last[0]

    retrying = Retrying(stop=lambda _state: clock() >= deadline, wait=wait_fixed(every_s), sleep=sleep or time.sleep,
                        retry=retry_if_result(lambda r: not done(r)), retry_error_callback=lambda _state: last[0],
                        reraise=True)
    return retrying(attempt)


def wait_until(predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.5) -> bool:
    """Poll ``predicate`` every ``poll_s`` until it is true (True) or ``timeout_s`` has passed (False)."""
    return bool(poll(lambda: bool(predicate()), bool, timeout_s, poll_s))
