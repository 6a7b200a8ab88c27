"""What the fleet exports for dashboards (``fleet.control.metrics`` over a fake metrics sink) and what it writes
per refit and per run step into the summary and the event log (requests held across the pause, step
time, generation tokens/s). Fakes, virtual time; no Ray."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.control.metrics import FleetMetrics, RunMeter
from rlfleet.fleet.types import EngineStats
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual
from rlfleet.fleet.records import RefitHeld, RunStep


class FakeMetric:
    def __init__(self, kind, name, description, tag_keys, boundaries=None):
        self.kind, self.name, self.tag_keys = kind, name, tuple(tag_keys)
        self.values: dict[tuple, float] = {}

    def _key(self, tags):
        tags = tags or {}
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        assert all(isinstance(v, str) for v in tags.values()), tags  # Ray refuses tag values that are not str
        return tuple(tags[k] for k in self.tag_keys)

    def set(self, value, tags=None):
        assert self.kind == "gauge" and isinstance(value, (int, float)), (self.name, value)
        self.values[self._key(tags)] = value

    def inc(self, value=1.0, tags=None):
        assert self.kind == "counter" and value > 0, (self.name, value)  # Ray's Counter.inc raises for <= 0
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0) + value

    def observe(self, value, tags=None):
        assert self.kind == "histogram"
        self.values.setdefault(self._key(tags), []).append(value)


class FakeSink:
    def __init__(self):
        self.metrics: dict[str, FakeMetric] = {}

    def make(self, kind, name, description, tag_keys=(), boundaries=None):
        m = self.metrics[name] = FakeMetric(kind, name, description, tag_keys, boundaries)
        return m

    def by_slot(self, name):
        return {int(k[0]): v for k, v in self.metrics[name].values.items()}


def row(inc=1, cap=8, kv=0.25, running=3, waiting=1, in_flight=4, preemptions=0, tokens=0):
    return {"incarnation": inc, "cap": cap, "kv_cache_usage": kv, "running": running, "waiting": waiting,
            "in_flight": in_flight, "preemptions": preemptions, "generation_tokens": tokens}


# ------------------------------------------------------------------------------ the gauges, on the sink
def test_per_shard_gauges_carry_cap_kv_running_queued_and_in_flight():
    sink = FakeSink()
    m = FleetMetrics(enabled=True, make=sink.make)
    m.shards({0: row(cap=8, kv=0.5, running=3, waiting=2, in_flight=5), 1: row(cap=16, kv=0.0, running=0, waiting=0,
                                                                             in_flight=0)}, now=10.0)
    assert sink.by_slot("rlfleet_shard_in_flight_cap") == {0: 8, 1: 16}
    assert sink.by_slot("rlfleet_shard_kv_cache_usage") == {0: 0.5, 1: 0.0}
    assert sink.by_slot("rlfleet_shard_running_requests") == {0: 3, 1: 0}
    assert sink.by_slot("rlfleet_shard_queued_requests") == {0: 2, 1: 0}
    assert sink.by_slot("rlfleet_shard_in_flight_requests") == {0: 5, 1: 0}


def test_preemptions_are_a_counter_of_increments_across_restarts():
    sink = FakeSink()
    m = FleetMetrics(enabled=True, make=sink.make)
    m.shards({0: row(preemptions=2)}, now=1.0)
    m.shards({0: row(preemptions=2)}, now=2.0)  # no change: no increment (Ray refuses inc(0))
    m.shards({0: row(preemptions=5)}, now=3.0)
    m.shards({0: row(inc=2, preemptions=1)}, now=4.0)  # a restarted engine counts from 0 again
    assert sink.by_slot("rlfleet_shard_preemptions") == {0: 6}


def test_generation_tokens_per_second_per_shard_and_a_slot_that_left_reads_zero():
    sink = FakeSink()
    m = FleetMetrics(enabled=True, make=sink.make)
    m.shards({0: row(tokens=100), 1: row(tokens=0)}, now=10.0)
    m.shards({0: row(tokens=300), 1: row(tokens=50)}, now=12.0)
    assert sink.by_slot("rlfleet_shard_generation_tokens_per_second") == {0: 100.0, 1: 25.0}
    assert sink.by_slot("rlfleet_shard_generation_tokens") == {0: 300, 1: 50}
    m.shards({0: row(tokens=300)}, now=14.0)  # slot 1 is gone (dead, removed): its gauges read 0, not its last load
    assert sink.by_slot("rlfleet_shard_running_requests")[1] == 0
    assert sink.by_slot("rlfleet_shard_in_flight_cap")[1] == 0
    assert sink.by_slot("rlfleet_shard_generation_tokens_per_second") == {0: 0.0, 1: 0}


def test_disabled_metrics_make_nothing():
    sink = FakeSink()
    m = FleetMetrics(enabled=False, make=sink.make)
    m.shards({0: row()}, now=1.0)
    m.refit_held(3)
    assert sink.metrics == {}


def test_the_run_meter_reports_step_time_and_tokens_per_second_between_refits():
    meter = RunMeter(now=0.0)
    meter.observe(0, 1, 0)
    meter.observe(1, 1, 0)
    meter.observe(0, 1, 400)
    meter.observe(1, 1, 200)
    step = meter.step(1, now=4.0)
    assert step == {"version": 1, "step_s": 4.0, "generation_tokens": 600, "generation_tokens_per_s": 150.0}
    meter.observe(1, 2, 100)  # slot 1 restarted: its new engine's tokens count from 0
    meter.observe(0, 1, 500)
    assert meter.step(2, now=6.0) == {"version": 2, "step_s": 2.0, "generation_tokens": 200,
                                      "generation_tokens_per_s": 100.0}


# ------------------------------------------------------------------------------ on the controller
class StatsDoor(FakeDoor):
    """Each shard's engine reports the stats in ``engine`` (slot -> EngineStats fields)."""

    def __init__(self):
        super().__init__(gen_delay=2.0)
        self.engine: dict[int, dict] = {}

    async def _stats(self, s):
        return EngineStats(kv_cache_tokens=32768, max_model_len=512, updated_at=1.0, in_flight=len(s.in_flight),
                           **self.engine.get(s.slot, {}))


def make(model_dir, sink):
    cfg = dict(engine={"model": model_dir}, num_engines=2, min_healthy_engines=1, refit_timeout_s=5.0,
               lifecycle_grace_s=0.1, probe_timeout_s=0.1, suspect_timeout_s=0.3, unhealthy_threshold=2,
               restart_backoff_s=0.0, restart_backoff_cap_s=0.0, metrics=False, request_timeout_s=60.0)
    door = StatsDoor()
    ctl = SingleController(cfg, door=door, transfer=FakeTransfer(door), clock=LoopClock())
    ctl.metrics = FleetMetrics(enabled=True, make=sink.make)
    return ctl, door


def test_the_admission_poll_exports_each_shards_gauges(model_dir):
    async def go():
        sink = FakeSink()
        ctl, door = make(model_dir, sink)
        door.engine = {0: dict(kv_cache_usage=0.75, running=5, waiting=2, preemptions=4),
                       1: dict(kv_cache_usage=0.1, running=1, waiting=0, preemptions=0)}
        await ctl.start()
        await ctl.poll_admission()
        assert sink.by_slot("rlfleet_shard_in_flight_cap") == {0: ctl.admission.cap(0), 1: ctl.admission.cap(1)}
        assert sink.by_slot("rlfleet_shard_kv_cache_usage") == {0: 0.75, 1: 0.1}
        assert sink.by_slot("rlfleet_shard_running_requests") == {0: 5, 1: 1}
        assert sink.by_slot("rlfleet_shard_queued_requests") == {0: 2, 1: 0}
        assert sink.by_slot("rlfleet_shard_preemptions") == {0: 4}
        await ctl.shutdown()

    run_virtual(go())


def test_a_refit_reports_the_requests_held_across_its_pause(model_dir):
    async def go():
        sink = FakeSink()
        ctl, door = make(model_dir, sink)
        await ctl.start()
        reqs = [asyncio.ensure_future(client(ctl).generate([1, 2], {"max_tokens": 2})) for _ in range(6)]
        await asyncio.sleep(0.5)  # every request runs on an engine (each takes 2 s)
        summary = await ctl.sync_weights(1)
        results = await asyncio.gather(*reqs)
        assert all(r.ok and r.result.weight_version == 1 for r in results)  # held across the pause, not aborted
        assert summary["held_across_pause"] == 6
        [held] = RefitHeld.among(ctl.events())
        assert held.version == 1 and held.requests == 6 and sum(held.by_slot.values()) == 6
        assert sink.metrics["rlfleet_refit_held_requests"].values[()] == 6
        quiet = await ctl.sync_weights(2)
        assert quiet["held_across_pause"] == 0 and RefitHeld.among(ctl.events())[-1].requests == 0
        await ctl.shutdown()

    run_virtual(go())


def test_each_refit_closes_a_run_step_with_its_time_and_generation_tokens_per_second(model_dir):
    async def go():
        sink = FakeSink()
        ctl, door = make(model_dir, sink)
        await ctl.start()
        t0 = ctl.clock.now()
        await ctl.poll_admission()
        door.engine = {0: dict(generation_tokens=300), 1: dict(generation_tokens=100)}
        await asyncio.sleep(8)
        await ctl.poll_admission()
        summary = await ctl.sync_weights(1)
        step = summary["run_step"]
        assert step["generation_tokens"] == 400 and step["step_s"] == pytest.approx(ctl.clock.now() - t0, abs=0.5)
        assert step["generation_tokens_per_s"] == pytest.approx(400 / step["step_s"])
        [rec] = RunStep.among(ctl.events())
        assert rec.version == 1 and rec.generation_tokens == 400 and rec.step_s == step["step_s"]
        assert sink.metrics["rlfleet_step_seconds"].values[()] == step["step_s"]
        assert sink.metrics["rlfleet_generation_tokens_per_second"].values[()] == step["generation_tokens_per_s"]
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ the HTTP front's /metrics
def test_the_fronts_prometheus_text_carries_each_shards_load_from_the_status(model_dir):
    """The real controller's ``status()`` through the front's collector (``serve.metrics.FleetCollector``), read
    back with ``prometheus_client``'s parser: each shard's load, under the Ray metrics' names."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from rlfleet.serve.metrics import FleetCollector

    async def go():
        ctl, door = make(model_dir, FakeSink())
        door.engine = {0: dict(kv_cache_usage=0.5, running=3, waiting=1, preemptions=7),
                       1: dict(kv_cache_usage=0.0, running=0, waiting=0, preemptions=0)}
        await ctl.start()
        await ctl.poll_admission()
        status = ctl.status()
        await ctl.shutdown()
        return status

    status = run_virtual(go())
    health = {"gate_open": True, "version": 0, "epoch": 1, "serving": 2, "status": "ok"}
    front = {"responses": {}, "in_flight": 0, "cancelled": 0, "tokens_out": 0, "latency_p50_s": None,
             "latency_p99_s": None, "client": {"accepted": 0, "completed": 0, "returned": 0, "requeued": 0,
                                               "in_progress": 0, "refused": {}}}
    collector = FleetCollector(lambda: (health, front))
    collector.status = status
    registry = CollectorRegistry()
    registry.register(collector)
    got = {(s.name, s.labels.get("slot")): s.value
           for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    cap = status["shard_load"]["0"]["cap"]
    assert {("rlfleet_shard_in_flight_cap", "0"): cap, ("rlfleet_shard_kv_cache_usage", "0"): 0.5,
            ("rlfleet_shard_running_requests", "0"): 3, ("rlfleet_shard_queued_requests", "0"): 1,
            ("rlfleet_shard_preemptions_total", "0"): 7, ("rlfleet_shard_preemptions_total", "1"): 0}.items() \
        <= got.items()
    sink = FakeSink()  # the controller's Ray metrics carry the same names (Ray adds its ``ray_`` prefix)
    FleetMetrics(enabled=True, make=sink.make)
    assert {name for name, _ in got} & {f"{n}_total" if m.kind == "counter" else n for n, m in sink.metrics.items()} \
        >= {"rlfleet_shard_in_flight_cap", "rlfleet_shard_kv_cache_usage", "rlfleet_shard_running_requests",
            "rlfleet_shard_queued_requests", "rlfleet_shard_in_flight_requests", "rlfleet_shard_preemptions_total",
            "rlfleet_engines",
            "rlfleet_gate_open", "rlfleet_weight_version"}
