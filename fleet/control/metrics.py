"""Metrics users' dashboards scrape: Ray's metrics API, which Ray exports to Prometheus.

Fleet-wide: refit phase durations, shards per health state, gate state, in-flight
requests, the weight version, the requests the last refit held across its pause, and
the last run step's time and generation tokens/s. Per shard (tag ``slot``), from each
admission poll: its in-flight cap, KV-cache usage, running and queued requests, in-flight
requests, generation tokens/s over the poll window, and two counters (exported as
``<name>_total``): preemptions and generation tokens, counted by increments, so a
restarted engine (whose own counts start from 0 again) never makes them go down. A slot
that is no longer polled (dead, removed) reads 0, not its last load. Ray's metrics agent exports
each under ``ray_<name>`` (``ray_rlfleet_shard_in_flight_cap``; a counter as ``ray_<name>_total``).
A figure the HTTP front's ``GET /metrics`` (``serve.metrics``) also exports carries the front's name
(engines per health state, gate, weight version, the per-shard load), so one dashboard query reads
either source with or without the ``ray_`` prefix. The refit phases keep a name of their own: they time
the fleet's lifecycle phases, not vLLM's weight-route operations
(``vllm:rl_weight_update_operation_duration_seconds``), which only the front runs and times.

The metrics are made through one factory, ``make(kind, name, description, tag_keys,
boundaries)`` (``fleet.cluster.ray_door.make_metric`` unless given, the one place Ray is touched;
a unit test passes a fake sink). With metrics disabled, outside a Ray worker, or if the
factory raises, every call is a no-op, so the controller's logic never depends on them.

``RunMeter`` is the pure part of the per-step figures (no metrics backend): it sums each
engine's generation-token increments between two refits. Guarantee on failure: nothing
here raises into the controller.
"""

from __future__ import annotations

from typing import Any, Callable

from rlfleet.health import ShardState

_STATES = (
    ShardState.HEALTHY, ShardState.STALE, ShardState.SUSPECT, ShardState.HUNG,
    ShardState.DEAD, ShardState.RESTARTING, ShardState.STARTING, ShardState.RETIRED,
)
_SLOT = ("slot",)
# key -> (kind, exported name, description, tag keys)
_SPECS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "shards": ("gauge", "rlfleet_engines", "Engines per health state", ("state",)),  # the front's name for it
    "gate": ("gauge", "rlfleet_gate_open", "1 while dispatch is open", ()),
    "version": ("gauge", "rlfleet_weight_version", "Committed weight version", ()),
    "in_flight": ("gauge", "rlfleet_in_flight_requests", "Requests accepted and not yet ended", ()),
    "held": ("gauge", "rlfleet_refit_held_requests", "Requests the last refit held across its pause", ()),
    "step_s": ("gauge", "rlfleet_step_seconds", "Time between the last two committed refits (one run step)", ()),
    "step_tps": ("gauge", "rlfleet_generation_tokens_per_second", "Generation tokens/s over the last run step", ()),
    "cap": ("gauge", "rlfleet_shard_in_flight_cap", "The shard's in-flight cap (admission law)", _SLOT),
    "kv": ("gauge", "rlfleet_shard_kv_cache_usage", "The engine's KV-cache usage (0..1)", _SLOT),
    "running": ("gauge", "rlfleet_shard_running_requests", "Requests the engine is running", _SLOT),
    "queued": ("gauge", "rlfleet_shard_queued_requests", "Requests waiting in the engine's queue", _SLOT),
    "shard_in_flight": ("gauge", "rlfleet_shard_in_flight_requests", "Requests the shard holds", _SLOT),
    "shard_tps": ("gauge", "rlfleet_shard_generation_tokens_per_second", "Generation tokens/s over the poll window",
                  _SLOT),
    "preemptions": ("counter", "rlfleet_shard_preemptions", "Requests the engine preempted", _SLOT),
    "tokens": ("counter", "rlfleet_shard_generation_tokens", "Tokens the engine generated", _SLOT),
}
_PER_SHARD_GAUGES = (("cap", "cap"), ("kv", "kv_cache_usage"), ("running", "running"), ("queued", "waiting"),
                     ("shard_in_flight", "in_flight"))


def _ray_factory() -> Callable[..., Any]:
    from rlfleet.fleet.cluster.ray_door import make_metric  # the door: the only module that imports Ray

    return make_metric


class FleetMetrics:
    def __init__(self, enabled: bool = True, make: Callable[..., Any] | None = None) -> None:
        self._m: dict[str, Any] = {}
        self._shards: dict[ShardState, int] = {}  # the count each "shards" gauge was last set to
        self._seen: dict[int, tuple[int, int, int, float]] = {}  # slot -> (incarnation, preemptions, tokens, at)
        if not enabled:
            return
        try:
            make = make or _ray_factory()
            phase = make("histogram", "rlfleet_refit_phase_seconds", "Duration of each refit lifecycle phase",
                         ("phase",), [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120])
            if phase is None:
                return  # no Ray to export to
            self._m = {"phase": phase}
            for key, (kind, name, description, tags) in _SPECS.items():
                self._m[key] = make(kind, name, description, tags)
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

    def gate(self, is_open: bool, version: int | None) -> None:
        if self._m:
            self._m["gate"].set(1 if is_open else 0)
            self._m["version"].set(version)

    def in_flight(self, n: int) -> None:
        if self._m:
            self._m["in_flight"].set(n)

    def refit_held(self, n: int) -> None:
        if self._m:
            self._m["held"].set(n)

    def run_step(self, step: dict) -> None:
        if self._m:
            self._m["step_s"].set(step["step_s"])
            self._m["step_tps"].set(step["generation_tokens_per_s"])

    def shards(self, rows: dict[int, dict], now: float) -> None:
        """One admission poll: per slot ``incarnation``, ``cap``, ``kv_cache_usage``, ``running``, ``waiting``,
        ``in_flight``, ``preemptions`` and ``generation_tokens`` (the engine's own totals since it started)."""
        if not self._m:
            return
        try:
            for slot, row in rows.items():
                self._shard(slot, row, now)
            for slot in [s for s in self._seen if s not in rows]:  # no longer polled: reads 0
                del self._seen[slot]
                tags = {"slot": str(slot)}
                for key, _ in _PER_SHARD_GAUGES + (("shard_tps", None),):
                    self._m[key].set(0, tags=tags)
        except Exception:  # noqa: BLE001 - metrics must never break the controller
            pass

    def _shard(self, slot: int, row: dict, now: float) -> None:
        m, tags = self._m, {"slot": str(slot)}
        for key, field in _PER_SHARD_GAUGES:
            value = row.get(field)
            if isinstance(value, (int, float)):
                m[key].set(value, tags=tags)
        inc, pre, tok = row["incarnation"], int(row.get("preemptions") or 0), int(row.get("generation_tokens") or 0)
        last: tuple[int, int, int, float | None] | None = self._seen.get(slot)
        if last is None or last[0] != inc:
            last = (inc, 0, 0, None)  # a new engine: its counts start from 0
        if pre > last[1]:
            m["preemptions"].inc(pre - last[1], tags=tags)
        if tok > last[2]:
            m["tokens"].inc(tok - last[2], tags=tags)
        if last[3] is not None and now > last[3]:
            m["shard_tps"].set(max(0, tok - last[2]) / (now - last[3]), tags=tags)
        self._seen[slot] = (inc, max(pre, last[1]), max(tok, last[2]), now)


class RunMeter:
    """Generation tokens between two committed refits (one step of the run), from each engine's own total
    (``EngineStats.generation_tokens``): increments per (slot, incarnation), so a restart loses nothing and
    counts nothing twice. Pure; the caller passes the time."""

    def __init__(self, now: float) -> None:
        self._since = now
        self._tokens = 0
        self._last: dict[int, tuple[int, int]] = {}  # slot -> (incarnation, its engine's total)

    def observe(self, slot: int, incarnation: int, generation_tokens: int) -> None:
        inc, total = self._last.get(slot, (incarnation, 0))
        if inc != incarnation:
            total = 0  # a new engine counts from 0
        if generation_tokens > total:
            self._tokens += generation_tokens - total
            total = generation_tokens
        self._last[slot] = (incarnation, total)

    def step(self, version: int, now: float) -> dict:
        """Close the step that ends with the commit of ``version``: its time and generation tokens/s."""
        step_s = max(0.0, now - self._since)
        out = {"version": version, "step_s": round(step_s, 6), "generation_tokens": self._tokens,
               "generation_tokens_per_s": round(self._tokens / step_s, 3) if step_s > 0 else 0.0}
        self._since, self._tokens = now, 0
        return out


def shard_rows(outs: dict[int, Any], live: dict[int, tuple[int, Any]], caps: Callable[[int], int]) -> dict[int, dict]:
    """The rows ``FleetMetrics.shards`` takes, from one poll's ``stats`` outcomes (slot -> ``Outcome`` of
    ``EngineStats``) and ``live`` (slot -> (incarnation, handle)); a slot whose poll failed is left out."""
    rows = {}
    for slot, out in outs.items():
        if out.ok:
            s = out.value
            rows[slot] = {"incarnation": live[slot][0], "cap": caps(slot), "kv_cache_usage": s.kv_cache_usage,
                          "running": s.running, "waiting": s.waiting, "in_flight": s.in_flight,
                          "preemptions": s.preemptions, "generation_tokens": getattr(s, "generation_tokens", 0)}
    return rows


_LOAD_FIELDS = ("cap", "kv_cache_usage", "running", "waiting", "preemptions", "in_flight")


def shard_load(admission: dict[int, dict]) -> dict[str, dict]:
    """``status()``'s per-shard load (slot as a string -> cap, KV usage, running, waiting, preemptions, in
    flight) from ``AdmissionController.metrics()``: what the HTTP front's ``/metrics`` exports per shard."""
    return {str(slot): {k: row.get(k) for k in _LOAD_FIELDS} for slot, row in sorted(admission.items())}
