"""Metrics users' dashboards scrape: Ray's metrics API, which Ray exports to Prometheus.

Refit phase durations, serving/suspect/dead counts, gate state, in-flight requests
and the weight version. With metrics disabled (or outside a Ray worker) every call
is a no-op, so the controller's logic never depends on them.
"""

from __future__ import annotations

from typing import Any

from health import ShardState

_STATES = (
    ShardState.HEALTHY, ShardState.STALE, ShardState.SUSPECT, ShardState.HUNG,
    ShardState.DEAD, ShardState.RESTARTING, ShardState.STARTING, ShardState.RETIRED,
)


class FleetMetrics:
    def __init__(self, enabled: bool = True) -> None:
        self._m: dict[str, Any] = {}
        self._shards: dict[ShardState, int] = {}  # the count each "shards" gauge was last set to
        if not enabled:
            return
        try:
            import ray
            from ray.util import metrics as rm

            if not ray.is_initialized():
                return
            self._m = {
                "phase": rm.Histogram(
                    "rlfleet_refit_phase_seconds",
                    description="Duration of each refit lifecycle phase",
                    boundaries=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
                    tag_keys=("phase",),
                ),
                "shards": rm.Gauge("rlfleet_shards", description="Shards per health state", tag_keys=("state",)),
                "gate": rm.Gauge("rlfleet_gate_open", description="1 while dispatch is open"),
                "version": rm.Gauge("rlfleet_weight_version", description="Committed weight version"),
                "in_flight": rm.Gauge("rlfleet_in_flight_requests", description="Requests accepted and not yet ended"),
            }
        except Exception:  # noqa: BLE001 - metrics must never break the controller
            self._m = {}

    def phase(self, name: str, seconds: float) -> None:
        if self._m:
            self._m["phase"].observe(seconds, tags={"phase": name})

    def health(self, ledger: Any) -> None:
        """Shards per health state. Called after every decision, so it reads the ledger's counts
        (O(1), not a walk over every slot) and sets only the gauges whose count changed."""
        if self._m:
            counts = ledger.state_counts()
            for state in _STATES:
                n = counts.get(state, 0)
                if self._shards.get(state) != n:
                    self._shards[state] = n
                    self._m["shards"].set(n, tags={"state": state.value})

    def gate(self, is_open: bool, version: int) -> None:
        if self._m:
            self._m["gate"].set(1 if is_open else 0)
            self._m["version"].set(version)

    def in_flight(self, n: int) -> None:
        if self._m:
            self._m["in_flight"].set(n)
