"""``HealthConfig``: the knobs of the health core, validated once at construction.

Guarantee on failure: an invalid config cannot exist. Construction raises
``ValueError`` naming the field, the allowed values and what was given, e.g.
``min_healthy_engines must be between 1 and num_engines (3), got 4``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlfleet.health.restart import RestartPolicy

__all__ = ["HealthConfig", "ON_HANG"]

ON_HANG = ("evict", "stop")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Fleet size, quorum and failure-handling thresholds.

    - ``num_engines``: slots in the fleet (>= 1).
    - ``min_healthy_engines``: quorum; the gate reopens only with at least this many
      engines serving the current weights (1..num_engines).
    - ``unhealthy_threshold``: failed probes that condemn a suspect shard (>= 1).
    - ``suspect_timeout_s``: longest a shard may stay suspect or hung while a refit
      is in progress before it is evicted (> 0 s).
    - ``probe_interval_s``: least time between two probes of one quarantined shard,
      so a probe that fails fast cannot spend ``unhealthy_threshold`` at once (>= 0 s).
    - ``restart_budget``: restarts allowed per slot over the run (>= 0).
    - ``backoff_base_s`` / ``backoff_cap_s``: restart backoff, doubling from base up
      to cap (0 <= base <= cap).
    - ``on_hang``: what a pause or resume that misses its deadline (or a resume answered
      'unavailable') does: ``evict`` kills that engine and counts it dead (the refit goes on
      with the rest when quorum holds); ``stop`` stops the refit with the gate closed.
    """

    num_engines: int
    min_healthy_engines: int = 1
    unhealthy_threshold: int = 3
    suspect_timeout_s: float = 30.0
    probe_interval_s: float = 1.0
    restart_budget: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    on_hang: str = "evict"

    def __post_init__(self) -> None:
        _check_int("num_engines", self.num_engines, 1)
        _check_int("min_healthy_engines", self.min_healthy_engines, 1)
        if self.min_healthy_engines > self.num_engines:
            raise ValueError(
                f"min_healthy_engines must be between 1 and num_engines "
                f"({self.num_engines}), got {self.min_healthy_engines}"
            )
        _check_int("unhealthy_threshold", self.unhealthy_threshold, 1)
        t = self.suspect_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"suspect_timeout_s must be a finite number of seconds > 0, got {t!r}")
        p = self.probe_interval_s
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0:
            raise ValueError(f"probe_interval_s must be a finite number of seconds >= 0, got {p!r}")
        if self.on_hang not in ON_HANG:
            raise ValueError(f"on_hang must be one of {ON_HANG}, got {self.on_hang!r}")
        # Building the policy validates restart_budget and the backoff pair.
        RestartPolicy(self.restart_budget, self.backoff_base_s, self.backoff_cap_s)

    @property
    def restart_policy(self) -> RestartPolicy:
        """The restart policy these knobs describe."""
        return RestartPolicy(self.restart_budget, self.backoff_base_s, self.backoff_cap_s)


def _check_int(name: str, value: int, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
