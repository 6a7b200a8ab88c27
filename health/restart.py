"""Restart policy: a per-slot restart budget and capped exponential backoff.

Pure arithmetic over (restarts already used, now); it keeps no state, so the ledger
owns the per-slot counters and the policy can be shared by every slot. Time comes
only from the ``now`` argument (an injected clock), never from the wall clock.

Guarantee on failure: a policy with invalid numbers cannot be built (``ValueError``
naming the field and what it allows); ``plan`` rejects a negative count the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RestartPlan", "RestartPolicy"]

# 2**64 * any positive base exceeds every sane cap; stop doubling there so huge
# restart counts never overflow a float.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """What the policy says about one dead slot.

    ``allowed``: a restart is within budget. ``attempt``: which restart this would be
    (1-based). ``not_before``: earliest launch time (``None`` when not allowed).
    ``reason``: one line for the event log.
    """

    allowed: bool
    attempt: int
    not_before: float | None
    reason: str


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """``restart_budget`` restarts per slot over the run; the n-th restart (n from 1)
    waits ``min(backoff_cap_s, backoff_base_s * 2**(n-1))`` seconds after the death.

    ``restart_budget == 0`` means never restart (a death retires the slot at once);
    ``backoff_base_s == 0`` means restart immediately.
    """

    restart_budget: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0

    def __post_init__(self) -> None:
        if type(self.restart_budget) is not int or self.restart_budget < 0:
            raise ValueError(
                f"restart_budget must be an integer >= 0, got {self.restart_budget!r}"
            )
        _check_seconds("backoff_base_s", self.backoff_base_s, minimum=0.0)
        _check_seconds("backoff_cap_s", self.backoff_cap_s, minimum=self.backoff_base_s)

    def backoff_s(self, restarts_used: int) -> float:
        """Seconds to wait before the next restart of a slot that has already been
        restarted ``restarts_used`` times (>= 0)."""
        if restarts_used < 0:
            raise ValueError(f"restarts_used must be >= 0, got {restarts_used!r}")
        if self.backoff_base_s == 0.0:
            return 0.0
        if restarts_used >= _MAX_DOUBLINGS:
            return self.backoff_cap_s
        return min(self.backoff_cap_s, self.backoff_base_s * (2.0**restarts_used))

    def plan(self, restarts_used: int, now: float) -> RestartPlan:
        """Decide whether a slot that died at ``now`` after ``restarts_used`` restarts
        may restart, and when."""
        attempt = restarts_used + 1
        if restarts_used >= self.restart_budget:
            return RestartPlan(
                False, attempt, None,
                f"restart budget spent ({restarts_used} of {self.restart_budget} used)",
            )
        delay = self.backoff_s(restarts_used)
        return RestartPlan(
            True, attempt, now + delay,
            f"restart {attempt} of {self.restart_budget} after {delay:g} s backoff",
        )


def _check_seconds(name: str, value: float, *, minimum: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
    ):
        raise ValueError(f"{name} must be a finite number of seconds >= {minimum:g}, got {value!r}")
