"""``GET /metrics`` on a front, read as a scraper reads it: ``prometheus_client``'s own text parser.

Every family the front exports is there (the fleet's figures, seed 004's per-shard admission gauges with their
``slot`` label, the latency histograms) and, from the RL weight routes, vLLM's own
``vllm:rl_weight_update_operation_duration_seconds{operation}`` (vLLM's buckets) and
``vllm:rl_weight_update_operations_in_flight{operation}``, counting each route call. Each front has a registry
of its own: two fronts in one process neither clash nor mix. No Ray, no engines: a fake fleet client, a fake
controller door and a fake relay.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.fleet.data.routing_state import RoutingState
from rlfleet.recipe.tinymodel import build_tokenizer
from rlfleet.rlapi.routes import RLSurface
from rlfleet.serve.app import build_app
from rlfleet.serve.front import Front

VLLM_DURATION = "vllm:rl_weight_update_operation_duration_seconds"
VLLM_IN_FLIGHT = "vllm:rl_weight_update_operations_in_flight"
SHARD_GAUGES = ("rlfleet_shard_in_flight_cap", "rlfleet_shard_kv_cache_usage", "rlfleet_shard_running_requests",
                "rlfleet_shard_queued_requests", "rlfleet_shard_in_flight_requests")
# every family, as the parser names them (a counter without its ``_total``)
FAMILIES = {
    "rlfleet_gate_open", "rlfleet_weight_version", "rlfleet_routing_epoch", "rlfleet_serving_engines",
    "rlfleet_stopped", "rlfleet_http_responses", "rlfleet_http_in_flight", "rlfleet_http_cancelled",
    "rlfleet_generated_tokens", "rlfleet_http_request_seconds", "rlfleet_http_time_to_first_token_seconds",
    "rlfleet_http_stream_errors", "rlfleet_http_engine_requests", "rlfleet_http_engine_generated_tokens",
    "rlfleet_requests_accepted", "rlfleet_requests_completed", "rlfleet_requests_returned",
    "rlfleet_requests_requeued", "rlfleet_requests_in_progress", "rlfleet_requests_refused",
    "rlfleet_controller_up", "rlfleet_engines", "rlfleet_refits", "rlfleet_controller_generation",
    "rlfleet_target_engines", *SHARD_GAUGES, "rlfleet_shard_preemptions",
    "rlfleet_http_e2e_request_latency_seconds", "rlfleet_http_time_to_first_token_hist_seconds",
    "rlfleet_http_queue_time_seconds", VLLM_DURATION, VLLM_IN_FLIGHT,
}
CONTROLLER_FAMILIES = {"rlfleet_engines", "rlfleet_refits", "rlfleet_controller_generation", "rlfleet_target_engines",
                       *SHARD_GAUGES, "rlfleet_shard_preemptions"}
STATUS = {
    "ledger": {"slots": [{"state": "healthy"}, {"state": "healthy"}, {"state": "dead"}]},
    "refits": 4, "generation": 1, "target_size": 3,
    # as ``fleet.control.metrics.shard_load`` makes it; slot 2's engine was not read yet (its figures None)
    "shard_load": {"0": {"cap": 8, "kv_cache_usage": 0.5, "running": 3, "waiting": 1, "preemptions": 2, "in_flight": 4},
                   "2": {"cap": 16, "kv_cache_usage": None, "running": None, "waiting": None, "preemptions": None,
                         "in_flight": None}},
}


class _Door:
    def __init__(self, status: dict | None) -> None:
        self.status = status

    async def call(self, handle: Any, method: str, *args: Any, timeout: float = 0.0) -> Any:
        assert method == "status"
        return SimpleNamespace(ok=self.status is not None, value=self.status)


class _Client:
    def __init__(self, status: dict | None) -> None:
        self.door = _Door(status)

    def routing(self) -> RoutingState:
        return RoutingState(5, True, 2)

    def counters(self) -> dict:
        return {"accepted": 3, "completed": 2, "returned": 0, "in_progress": 1, "requeued": 0, "refused": {"full": 2}}


class _Relay:
    """The relay's side of the weight routes: ``start_update`` looks at the in-flight gauge while it runs."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.seen_in_flight: float | None = None

    async def start_update(self) -> None:
        self.seen_in_flight = self.front.metrics.registry.get_sample_value(VLLM_IN_FLIGHT, {"operation": "start"})

    async def receive(self, info: dict, timeout_s: float = 0.0) -> dict:
        return {"tensors": len(info.get("names", []))}

    async def init_transfer(self, info: dict, timeout_s: float = 0.0) -> dict:
        raise RuntimeError("the trainer's rendezvous did not answer")


class _Surface(RLSurface):
    async def _relay(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        return await getattr(self.relay, method)(*args)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def _served(tok, status: dict | None) -> tuple[Front, _Relay, TestClient]:
    front = Front(_Client(status), tok, "m", 512, controller=object())
    relay = _Relay(front)
    fleet = SimpleNamespace(client=SimpleNamespace(routing=lambda: RoutingState(5, True, 2)))
    return front, relay, TestClient(build_app(front, rl=_Surface(fleet, "gloo", relay=relay)))


def _scrape(http: TestClient) -> dict[str, Any]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _values(family: Any, suffix: str = "") -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == family.name + suffix}


def test_metrics_parse_with_every_family_the_shard_gauges_and_vllms_weight_route_metrics(tok):
    front, relay, http = _served(tok, STATUS)
    assert http.post("/start_weight_update").status_code == 200
    assert http.post("/update_weights", json={"update_info": {"names": ["w"]}}).status_code == 200
    assert http.post("/update_weights", json={"update_info": {"names": ["w", "b"]}}).status_code == 200
    assert http.post("/init_weight_transfer_engine", json={"init_info": {"x": 1}}).status_code == 400  # still timed
    assert relay.seen_in_flight == 1.0, "in flight while the relay ran it"
    families = _scrape(http)
    assert FAMILIES <= set(families), FAMILIES - set(families)
    assert {n: families[n].type for n in SHARD_GAUGES} == {n: "gauge" for n in SHARD_GAUGES}
    assert _values(families["rlfleet_shard_in_flight_cap"]) == {(("slot", "0"),): 8, (("slot", "2"),): 16}
    for name, value in zip(SHARD_GAUGES[1:], (0.5, 3, 1, 4)):  # slot 2 not read yet: left out
        assert _values(families[name]) == {(("slot", "0"),): value}, name
    preempted = families["rlfleet_shard_preemptions"]
    assert preempted.type == "counter" and _values(preempted, "_total") == {(("slot", "0"),): 2}
    assert _values(families["rlfleet_engines"]) == {(("state", "dead"),): 1, (("state", "healthy"),): 2}

    duration = families[VLLM_DURATION]
    assert duration.type == "histogram"
    counts = {dict(k)["operation"]: v for k, v in _values(duration, "_count").items()}
    assert counts == {"start": 1, "update": 2, "init": 1}
    bounds = sorted({float(s.labels["le"]) for s in duration.samples if s.name == VLLM_DURATION + "_bucket"})
    assert bounds == [0.01, 0.1, 1, 10, 30, 60, 120, 300, 600, float("inf")]  # vLLM's buckets
    in_flight = families[VLLM_IN_FLIGHT]
    assert in_flight.type == "gauge" and set(_values(in_flight).values()) == {0.0}


def test_a_controller_that_does_not_answer_leaves_its_families_out_and_fronts_keep_their_own_registries(tok):
    front, _, http = _served(tok, None)
    families = _scrape(http)
    assert _values(families["rlfleet_controller_up"]) == {(): 0}
    assert not CONTROLLER_FAMILIES & set(families), "no stale controller figures"
    assert FAMILIES - CONTROLLER_FAMILIES <= set(families)
    other, _, other_http = _served(tok, STATUS)  # a second front in the same process: no clash
    assert http.post("/start_weight_update").status_code == 200
    assert front.metrics.registry.get_sample_value(VLLM_DURATION + "_count", {"operation": "start"}) == 1
    assert other.metrics.registry.get_sample_value(VLLM_DURATION + "_count", {"operation": "start"}) is None
    assert _values(_scrape(other_http)["rlfleet_controller_up"]) == {(): 1}
