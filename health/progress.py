"""Liveness as progress: a shard whose engine has work and makes none is stalled. Pure: times are arguments.

A shard actor can answer every ping while the engine core under it is stopped (a
SIGSTOPped process, a wedged GPU kernel, a stuck collective): answering is not
liveness. ``ProgressWatch`` lives in the shard and is fed what it sees, each with
the shard's ``now``: the number of requests it holds (``busy``), each engine step
that produced tokens (``stepped``, from vLLM's per-step stat record), and the
spans in which no step is expected although work is held (``hold``/``release``:
paused for a refit; the core busy with a bounded worker call such as a weight
transfer). ``facts(now)`` is what the shard's ping answer carries.
``stall_verdict(facts, bound_s)`` is the controller's rule: work held and no token
for longer than ``bound_s`` (``FleetConfig.stall_timeout_s``) is a hang, named
with the numbers that condemn it; anything else (idle, held, no step marks from
the backend) is not.

Guarantee on failure: a malformed argument raises ``ValueError`` naming it; the
watch is left unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ProgressFacts", "ProgressWatch", "stall_verdict"]


@dataclass(frozen=True, slots=True)
class ProgressFacts:
    """What a shard says of its engine's progress at ``now`` (plain data for the ping answer).

    ``stalled_s``: seconds it has held work (requests in flight) with no engine step producing a
    token, counted from the latest of: the work arriving, the last token, the last hold ending;
    0.0 when it holds no work or a hold is on; None when the backend gives no step marks.
    ``held``: why the progress clock is stopped (``"paused"``, ``"worker_rpc"``), or None."""

    in_flight: int
    stalled_s: float | None
    last_token_age_s: float | None
    held: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "stalled_s": self.stalled_s,
                "last_token_age_s": self.last_token_age_s, "held": self.held}


def _time(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite time in seconds, got {value!r}")
    return float(value)


class ProgressWatch:
    """The progress clock of one shard (module docstring). Every method takes the shard's ``now``."""

    def __init__(self, now: float, steps: bool = True) -> None:
        self._steps = bool(steps)  # False: the backend gives no step marks, stalls cannot be told
        self._busy_since: float | None = None
        self._token_at: float | None = None
        self._released_at = _time("now", now)
        self._holds: dict[str, int] = {}

    def busy(self, in_flight: int, now: float) -> None:
        """The shard holds ``in_flight`` requests now (call after every admission and every end)."""
        if type(in_flight) is not int or in_flight < 0:
            raise ValueError(f"in_flight must be an integer >= 0, got {in_flight!r}")
        now = _time("now", now)
        if in_flight == 0:
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = now

    def stepped(self, now: float, tokens: int) -> None:
        """An engine step ended; ``tokens``: prompt and generated tokens it processed (0: no progress)."""
        now = _time("now", now)
        if tokens > 0:
            self._token_at = now

    def hold(self, why: str, now: float) -> None:
        """No step is expected until ``release(why)``: the engine is paused, or its core runs a bounded call."""
        _time("now", now)
        self._holds[why] = self._holds.get(why, 0) + 1

    def release(self, why: str, now: float) -> None:
        now = _time("now", now)
        n = self._holds.get(why, 0)
        if n <= 0:
            raise ValueError(f"release({why!r}) without a matching hold")
        if n == 1:
            del self._holds[why]
        else:
            self._holds[why] = n - 1
        self._released_at = max(self._released_at, now)

    def held(self) -> str | None:
        return min(self._holds) if self._holds else None

    def holding(self, why: str) -> bool:
        return self._holds.get(why, 0) > 0

    def facts(self, in_flight: int, now: float) -> ProgressFacts:
        now = _time("now", now)
        age = None if self._token_at is None else max(0.0, now - self._token_at)
        held = self.held()
        if not self._steps:
            return ProgressFacts(in_flight, None, age, held)
        if in_flight == 0 or self._busy_since is None or held is not None:
            return ProgressFacts(in_flight, 0.0, age, held)
        since = max(self._busy_since, self._released_at, self._token_at if self._token_at is not None else -math.inf)
        return ProgressFacts(in_flight, max(0.0, now - since), age, None)


def stall_verdict(facts: ProgressFacts | Mapping[str, Any] | None, bound_s: float) -> str | None:
    """Why these facts are a hang (a sentence with the numbers), or None: work held and no token for
    more than ``bound_s`` seconds. Facts that are missing or say nothing (an old shard, a backend with
    no step marks) are never a hang: ``None``."""
    bound = _time("bound_s", bound_s)
    if bound <= 0:
        raise ValueError(f"bound_s must be > 0, got {bound_s!r}")
    if facts is None:
        return None
    f = facts.as_dict() if isinstance(facts, ProgressFacts) else facts
    stalled, n = f.get("stalled_s"), f.get("in_flight") or 0
    if stalled is None or n <= 0 or f.get("held") is not None or stalled <= bound:
        return None
    return (f"engine made no progress (no token) for {stalled:.1f} s with {n} request(s) in flight "
            f"(stall_timeout_s={bound:g})")
