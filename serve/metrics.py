"""``GET /metrics``: the fleet's gauges, counters and histograms in the Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import bisect

# Upper bounds (seconds) of the latency histograms' buckets: from a cached short answer to a long generation
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """A Prometheus histogram: counts per bucket (cumulative when written), the sum and the count of what it saw."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": self.count}


def _histogram(out: list[str], name: str, help_: str, snap: dict) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} histogram")
    running = 0
    for bound, n in zip(list(snap["bounds"]) + ["+Inf"], snap["counts"]):
        running += n
        out.append(f'{name}_bucket{{le="{bound if bound == "+Inf" else format(float(bound), "g")}"}} {running}')
    out.append(f"{name}_sum {float(snap['sum']):g}")
    out.append(f"{name}_count {snap['count']}")


# The front's histograms: (``Front.counters()["histograms"]`` key, metric name, help)
_HISTOGRAMS = (
    ("e2e", "rlfleet_http_e2e_request_latency_seconds", "Request latency through the fleet, arrival to last token"),
    ("ttft", "rlfleet_http_time_to_first_token_hist_seconds", "Streamed requests: arrival to the first token"),
    ("queue", "rlfleet_http_queue_time_seconds",
     "Time a request waited at the front before the fleet took it (tokenizing or rendering, and its queue)"),
)



def _line(out: list[str], name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        out.append(f"{name}{{{lab}}} {float(value):g}" if lab else f"{name} {float(value):g}")


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# seed 004's per-shard figures: (status field, metric name, kind, help)
_SHARD_METRICS = (
    ("cap", "rlfleet_shard_in_flight_cap", "gauge", "The shard's in-flight cap (admission law)"),
    ("kv_cache_usage", "rlfleet_shard_kv_cache_usage", "gauge", "The engine's KV-cache usage (0..1)"),
    ("running", "rlfleet_shard_running_requests", "gauge", "Requests the engine is running"),
    ("waiting", "rlfleet_shard_queued_requests", "gauge", "Requests waiting in the engine's queue"),
    ("preemptions", "rlfleet_shard_preemptions_total", "counter", "Requests the engine preempted since it started"),
)


def _shard_lines(out: list[str], load: dict) -> None:
    """Per shard (label ``slot``), as of the controller's last admission poll; a figure not read yet is left out."""
    for field, name, kind, help_ in _SHARD_METRICS:
        samples = [({"slot": slot}, row[field]) for slot, row in sorted(load.items(), key=lambda kv: int(kv[0]))
                   if isinstance(row.get(field), (int, float))]
        _line(out, name, kind, help_, samples)


def prometheus_text(health: dict, front: dict, status: dict | None) -> str:
    """``health``: ``Front.health()``'s body; ``front``: ``Front.counters()``; ``status``: the controller's
    ``status()`` (None while it does not answer: its gauges are left out and ``rlfleet_controller_up`` is 0)."""
    out: list[str] = []
    _line(out, "rlfleet_gate_open", "gauge", "1 while the fleet's gate is open", [({}, 1 if health["gate_open"] else 0)])
    _line(out, "rlfleet_weight_version", "gauge", "Committed weight version", [({}, health["version"])])
    _line(out, "rlfleet_routing_epoch", "gauge", "Routing state epoch this front holds", [({}, health["epoch"])])
    _line(out, "rlfleet_serving_engines", "gauge", "Engines in the serving set", [({}, health["serving"])])
    _line(out, "rlfleet_stopped", "gauge", "1 once the fleet stopped", [({}, 1 if health["status"] == "stopped" else 0)])
    _line(out, "rlfleet_http_responses_total", "counter", "HTTP responses by endpoint and status code",
          [({"endpoint": k.rsplit(" ", 1)[0], "code": k.rsplit(" ", 1)[1]}, n) for k, n in front["responses"].items()])
    _line(out, "rlfleet_http_in_flight", "gauge", "Requests the front is running", [({}, front["in_flight"])])
    _line(out, "rlfleet_http_cancelled_total", "counter", "Requests whose HTTP client disconnected (aborted)",
          [({}, front["cancelled"])])
    _line(out, "rlfleet_generated_tokens_total", "counter", "Tokens generated for this front", [({}, front["tokens_out"])])
    lat = [({"quantile": q}, front[key]) for q, key in (("0.5", "latency_p50_s"), ("0.99", "latency_p99_s"))
           if front[key] is not None]
    _line(out, "rlfleet_http_request_seconds", "summary", "Request latency through the fleet (recent window)", lat)
    ttft = [({"quantile": q}, front[key]) for q, key in (("0.5", "ttft_p50_s"), ("0.99", "ttft_p99_s"))
            if front.get(key) is not None]
    _line(out, "rlfleet_http_time_to_first_token_seconds", "summary",
          "Streamed requests: time to the first token (recent window)", ttft)
    _line(out, "rlfleet_http_stream_errors_total", "counter",
          "Streams ended by an error event after their first tokens (the request was returned mid-stream)",
          [({}, front.get("stream_errors", 0))])
    for key, name, help_ in _HISTOGRAMS:
        if key in front.get("histograms", {}):
            _histogram(out, name, help_, front["histograms"][key])
    engines = sorted((front.get("engines") or {}).items(), key=lambda kv: int(kv[0]))
    _line(out, "rlfleet_http_engine_requests_total", "counter", "Requests answered for this front, by the slot that "
          "finished them", [({"slot": slot}, row["requests"]) for slot, row in engines])
    _line(out, "rlfleet_http_engine_generated_tokens_total", "counter", "Tokens generated for this front, by the "
          "slot that finished the request", [({"slot": slot}, row["tokens"]) for slot, row in engines])
    client = front["client"]
    for key in ("accepted", "completed", "returned", "requeued"):
        _line(out, f"rlfleet_requests_{key}_total", "counter", f"Requests {key} by this front's fleet client",
              [({}, client[key])])
    _line(out, "rlfleet_requests_in_progress", "gauge", "Requests accepted and not yet ended", [({}, client["in_progress"])])
    _line(out, "rlfleet_requests_refused_total", "counter", "Shard refusals by reason (re-routed at no cost)",
          [({"reason": r}, n) for r, n in sorted(client["refused"].items())])
    _line(out, "rlfleet_controller_up", "gauge", "1 if the controller answered the last status call",
          [({}, 0 if status is None else 1)])
    if status is not None:
        states: dict[str, int] = {}
        for s in status["ledger"]["slots"]:
            states[s["state"]] = states.get(s["state"], 0) + 1
        _line(out, "rlfleet_engines", "gauge", "Engines per health state", [({"state": k}, v) for k, v in sorted(states.items())])
        _line(out, "rlfleet_refits_total", "counter", "Refits the controller ran", [({}, status["refits"])])
        _line(out, "rlfleet_controller_generation", "gauge", "Controller restarts adopted (0: never restarted)",
              [({}, status["generation"])])
        _line(out, "rlfleet_target_engines", "gauge", "Serving engines the fleet is sized to", [({}, status["target_size"])])
        _shard_lines(out, status.get("shard_load") or {})
    return "\n".join(out) + "\n"
