"""``GET /metrics``: one front's Prometheus exposition, built with ``prometheus_client`` (the library vLLM uses).

Each front owns a ``CollectorRegistry`` of its own, never the process-wide default: several fronts (and vLLM,
which registers its own collectors globally) can live in one process without clashing or mixing series. In it:

- three latency histograms the front observes as requests end (``Front.metrics.histograms``);
- vLLM's own weight-route metrics (``vllm.entrypoints.rl.online.metrics.WeightOperationMetrics``, made against
  this registry): ``vllm:rl_weight_update_operation_duration_seconds{operation}`` and
  ``vllm:rl_weight_update_operations_in_flight{operation}``, recorded by ``rlapi.routes`` around each weight
  route as ``vllm serve`` records them, so a dashboard built for ``vllm serve`` reads the fleet's under the
  same names, labels and buckets;
- ``FleetCollector``: the values other parts own (the routing state, the front's counters, the controller's
  ``status()``, seed 004's per-shard admission figures), read at scrape time, never copied into gauges that
  could go stale.

The controller's ``status()`` is awaited by the route before the (synchronous) exposition and handed in; a
controller that does not answer leaves its families out and sets ``rlfleet_controller_up`` to 0. Nothing
here raises into a request: a scrape that fails is the route's 500.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from vllm.entrypoints.rl.online.metrics import WeightOperationMetrics

__all__ = ["CONTENT_TYPE_LATEST", "FleetCollector", "FrontMetrics", "LATENCY_BUCKETS_S"]

# Upper bounds (seconds) of the latency histograms' buckets: from a cached short answer to a long generation
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# The front's histograms: (``FrontMetrics.histograms`` key, metric name, help)
_HISTOGRAMS = (
    ("e2e", "rlfleet_http_e2e_request_latency_seconds", "Request latency through the fleet, arrival to last token"),
    ("ttft", "rlfleet_http_time_to_first_token_hist_seconds", "Streamed requests: arrival to the first token"),
    ("queue", "rlfleet_http_queue_time_seconds",
     "Time a request waited at the front before the fleet took it (tokenizing or rendering, and its queue)"),
)

# seed 004's per-shard figures, as ``status()["shard_load"]`` carries them: (field, metric name, kind, help). The
# names are the controller's Ray metrics' (``fleet.control.metrics``), which Ray exports under ``ray_<name>``.
_SHARD_METRICS = (
    ("cap", "rlfleet_shard_in_flight_cap", "gauge", "The shard's in-flight cap (admission law)"),
    ("kv_cache_usage", "rlfleet_shard_kv_cache_usage", "gauge", "The engine's KV-cache usage (0..1)"),
    ("running", "rlfleet_shard_running_requests", "gauge", "Requests the engine is running"),
    ("waiting", "rlfleet_shard_queued_requests", "gauge", "Requests waiting in the engine's queue"),
    ("in_flight", "rlfleet_shard_in_flight_requests", "gauge", "Requests the shard holds"),
    ("preemptions", "rlfleet_shard_preemptions_total", "counter", "Requests the engine preempted since it started"),
)

Samples = Iterable[tuple[tuple[str, ...], float]]


def _family(kind: str, name: str, help_: str, labels: tuple[str, ...] = ()) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, help_, labels=labels)
    if kind == "gauge":
        return GaugeMetricFamily(name, help_, labels=labels)
    return Metric(name, help_, kind)  # a summary of window quantiles: samples added by hand (no _sum/_count)


def _one(value: float) -> Samples:
    return [((), value)]


def _quantiles(front: dict, keys: tuple[str, str]) -> Samples:
    return [((q,), front[key]) for q, key in zip(("0.5", "0.99"), keys) if front.get(key) is not None]


def _states(status: dict) -> Samples:
    states: dict[str, int] = {}
    for s in status["ledger"]["slots"]:
        states[s["state"]] = states.get(s["state"], 0) + 1
    return [((k,), v) for k, v in sorted(states.items())]


def _per_shard(field: str) -> Callable[[dict, dict, dict], Samples]:
    """Per shard (label ``slot``), as of the controller's last admission poll; a figure not read yet is left out."""
    def samples(health: dict, front: dict, status: dict) -> Samples:
        load = status.get("shard_load") or {}
        return [((slot,), row[field]) for slot, row in sorted(load.items(), key=lambda kv: int(kv[0]))
                if isinstance(row.get(field), (int, float))]
    return samples


def _per_engine(field: str) -> Callable[[dict, dict, dict | None], Samples]:
    def samples(health: dict, front: dict, status: dict | None) -> Samples:
        engines = sorted((front.get("engines") or {}).items(), key=lambda kv: int(kv[0]))
        return [((slot,), row[field]) for slot, row in engines]
    return samples


def _client(key: str) -> Callable[[dict, dict, dict | None], Samples]:
    return lambda h, f, s: _one(f["client"][key])


_Spec = tuple[str, str, str, tuple[str, ...], Callable[..., Samples]]

# Always exported: (kind, name, help, label names, samples(health, front counters, status or None))
_FRONT: tuple[_Spec, ...] = (
    ("gauge", "rlfleet_gate_open", "1 while the fleet's gate is open", (),
     lambda h, f, s: _one(1 if h["gate_open"] else 0)),
    ("gauge", "rlfleet_weight_version", "Committed weight version", (), lambda h, f, s: _one(h["version"])),
    ("gauge", "rlfleet_routing_epoch", "Routing state epoch this front holds", (), lambda h, f, s: _one(h["epoch"])),
    ("gauge", "rlfleet_serving_engines", "Engines in the serving set", (), lambda h, f, s: _one(h["serving"])),
    ("gauge", "rlfleet_stopped", "1 once the fleet stopped", (),
     lambda h, f, s: _one(1 if h["status"] == "stopped" else 0)),
    ("counter", "rlfleet_http_responses_total", "HTTP responses by endpoint and status code", ("endpoint", "code"),
     lambda h, f, s: [(tuple(k.rsplit(" ", 1)), n) for k, n in f["responses"].items()]),
    ("gauge", "rlfleet_http_in_flight", "Requests the front is running", (), lambda h, f, s: _one(f["in_flight"])),
    ("counter", "rlfleet_http_cancelled_total", "Requests whose HTTP client disconnected (aborted)", (),
     lambda h, f, s: _one(f["cancelled"])),
    ("counter", "rlfleet_generated_tokens_total", "Tokens generated for this front", (),
     lambda h, f, s: _one(f["tokens_out"])),
    ("summary", "rlfleet_http_request_seconds", "Request latency through the fleet (recent window)", ("quantile",),
     lambda h, f, s: _quantiles(f, ("latency_p50_s", "latency_p99_s"))),
    ("summary", "rlfleet_http_time_to_first_token_seconds", "Streamed requests: time to the first token (recent "
     "window)", ("quantile",), lambda h, f, s: _quantiles(f, ("ttft_p50_s", "ttft_p99_s"))),
    ("counter", "rlfleet_http_stream_errors_total",
     "Streams ended by an error event after their first tokens (the request was returned mid-stream)", (),
     lambda h, f, s: _one(f.get("stream_errors", 0))),
    ("counter", "rlfleet_http_engine_requests_total", "Requests answered for this front, by the slot that finished "
     "them", ("slot",), _per_engine("requests")),
    ("counter", "rlfleet_http_engine_generated_tokens_total", "Tokens generated for this front, by the slot that "
     "finished the request", ("slot",), _per_engine("tokens")),
    *(("counter", f"rlfleet_requests_{key}_total", f"Requests {key} by this front's fleet client", (), _client(key))
      for key in ("accepted", "completed", "returned", "requeued")),
    ("gauge", "rlfleet_requests_in_progress", "Requests accepted and not yet ended", (), _client("in_progress")),
    ("counter", "rlfleet_requests_refused_total", "Shard refusals by reason (re-routed at no cost)", ("reason",),
     lambda h, f, s: [((r,), n) for r, n in sorted(f["client"]["refused"].items())]),
    ("gauge", "rlfleet_controller_up", "1 if the controller answered the last status call", (),
     lambda h, f, s: _one(0 if s is None else 1)),
)

# Exported while the controller answers (``status()`` not None)
_CONTROLLER: tuple[_Spec, ...] = (
    ("gauge", "rlfleet_engines", "Engines per health state", ("state",), lambda h, f, s: _states(s)),
    ("counter", "rlfleet_refits_total", "Refits the controller ran", (), lambda h, f, s: _one(s["refits"])),
    ("gauge", "rlfleet_controller_generation", "Controller restarts adopted (0: never restarted)", (),
     lambda h, f, s: _one(s["generation"])),
    ("gauge", "rlfleet_target_engines", "Serving engines the fleet is sized to", (),
     lambda h, f, s: _one(s["target_size"])),
    *((kind, name, help_, ("slot",), _per_shard(field)) for field, name, kind, help_ in _SHARD_METRICS),
)


class FleetCollector:
    """The fleet's gauges and counters, read at scrape time. ``read()``: (``Front.health()``'s body,
    ``Front.counters()``); ``status``: the controller's ``status()`` for the scrape under way (None: not
    answering), set by ``FrontMetrics.exposition``."""

    def __init__(self, read: Callable[[], tuple[dict, dict]]) -> None:
        self._read = read
        self.status: dict | None = None

    def describe(self) -> Iterator[Metric]:
        """Every family this collector can export, so the registry refuses a clash with another collector's."""
        for kind, name, help_, labels, _ in _FRONT + _CONTROLLER:
            yield _family(kind, name, help_, labels)

    def collect(self) -> Iterator[Metric]:
        health, front = self._read()
        status = self.status
        for kind, name, help_, labels, samples in _FRONT + (_CONTROLLER if status is not None else ()):
            family = _family(kind, name, help_, labels)
            for values, value in samples(health, front, status):
                if kind == "summary":
                    family.add_sample(name, dict(zip(labels, values)), float(value))
                else:
                    family.add_metric(list(values), float(value))  # type: ignore[attr-defined]
            yield family


class FrontMetrics:
    """One front's registry: its histograms, vLLM's weight-route metrics and the fleet's collector."""

    def __init__(self, read: Callable[[], tuple[dict, dict]]) -> None:
        self.registry = CollectorRegistry()
        self.histograms = {key: Histogram(name, help_, buckets=LATENCY_BUCKETS_S, registry=self.registry)
                           for key, name, help_ in _HISTOGRAMS}
        self.weights = WeightOperationMetrics(self.registry)  # ``weights.record(operation)`` around a weight route
        self._fleet = FleetCollector(read)
        self.registry.register(self._fleet)

    def exposition(self, status: dict | None) -> bytes:
        """The text format (``CONTENT_TYPE_LATEST``). Synchronous from setting ``status`` to the last byte, so
        two scrapes on one event loop never see each other's status."""
        self._fleet.status = status
        try:
            return generate_latest(self.registry)
        finally:
            self._fleet.status = None
