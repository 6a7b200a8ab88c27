"""Time sources for the health core.

Nothing in ``health/`` reads the wall clock on its own: every function that needs
the time takes ``now`` (seconds, monotonic) from a ``Clock`` the caller injects.
Production code passes ``MonotonicClock``; tests pass ``FakeClock`` and move it by
hand, so every timeout and backoff is exercised deterministically and instantly.

Guarantee on failure: ``FakeClock`` refuses to move backwards (``ValueError`` naming
the offending value) and is left unchanged, so a test cannot build a non-monotonic
timeline by mistake.
"""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "MonotonicClock"]


@runtime_checkable
class Clock(Protocol):
    """A monotonic source of seconds. ``now()`` never decreases."""

    def now(self) -> float:
        """Return the current time in seconds."""
        ...


class MonotonicClock:
    """The production clock: ``time.monotonic()``, immune to wall-clock jumps."""

    __slots__ = ()

    def now(self) -> float:
        """Return ``time.monotonic()``."""
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to; for tests and benchmarks.

    Preconditions: ``start`` is a finite number. Guarantees: ``now()`` returns the
    last value set, and never a smaller one than before.
    """

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"FakeClock start must be a finite number, got {start!r}")
        self._now = float(start)

    def now(self) -> float:
        """Return the current fake time."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0, finite) and return the new time."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(
                f"FakeClock.advance needs a finite number of seconds >= 0, got {seconds!r}"
            )
        self._now += seconds
        return self._now

    def set(self, when: float) -> float:
        """Jump to ``when`` (finite, >= the current time) and return it."""
        if not (math.isfinite(when) and when >= self._now):
            raise ValueError(
                f"FakeClock.set needs a finite time >= {self._now}, got {when!r}"
            )
        self._now = float(when)
        return self._now

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now})"
