"""The demo report's pure parts: numbers read off an event log, the plots, the fault plans and the views."""

from __future__ import annotations

import io

import pytest

from demo.run import DemoConfig, EventWatcher, _nan_to_none, default_plan, load_demo_plan
from demo.view import PlainView, make_view
from fleet.errors import ConfigError
from demo.report import log_numbers, plot_learning, plot_timeline, readmissions, refit_spans, state_segments


def _log() -> list[dict]:
    """A fleet of 2: start, one refit, slot 1 killed, restarted, re-admitted by the next refit, shut down."""
    recs = []

    def ev(t, kind, **f):
        recs.append({"t": t, "seq": len(recs), "kind": kind, **f})

    ev(0.0, "phase", phase="start", edge="begin", engines=2)
    for s in (0, 1):
        ev(5.0, "health", slot=s, incarnation=1, before="starting", after="stale", reason="ready")
        ev(5.1, "health", slot=s, incarnation=1, before="stale", after="healthy", reason="v0")
    ev(5.2, "gate", open=True, version=0, reason="2 serve")
    for i in range(3):
        ev(6.0 + i, "request", event="accepted", request_id=f"r{i}")
        ev(6.5 + i, "request", event="completed", request_id=f"r{i}", slot=i % 2, incarnation=1, version=0, version_start=0)

    def refit(t, version, members):
        ev(t, "phase", phase="close", edge="begin", version=version)
        ev(t, "gate", open=False, version=version - 1, reason="refit")
        ev(t + 0.01, "phase", phase="close", edge="end", version=version, seconds=0.01)
        ev(t + 0.1, "phase", phase="transfer", edge="begin", version=version)
        ev(t + 0.5, "phase", phase="transfer", edge="end", version=version, seconds=0.4)
        ev(t + 0.6, "stamp", version=version, members=members)
        ev(t + 0.7, "phase", phase="reopen", edge="begin", version=version)
        ev(t + 0.7, "gate", open=True, version=version, reason="ok")
        ev(t + 0.8, "phase", phase="reopen", edge="end", version=version, seconds=0.1)

    refit(10.0, 1, [[0, 1], [1, 1]])
    ev(12.0, "fault", slot=1, incarnation=1, point="step_boundary", action="kill", armed=True)
    ev(12.5, "health", slot=1, incarnation=1, before="healthy", after="dead", reason="died")
    ev(13.0, "restart", slot=1, incarnation=2, edge="begin", attempt=1)
    ev(13.0, "health", slot=1, incarnation=2, before="dead", after="restarting", reason="restart")
    refit(14.0, 2, [[0, 1]])
    ev(20.0, "restart", slot=1, incarnation=2, edge="end", outcome="ok")
    ev(20.0, "health", slot=1, incarnation=2, before="restarting", after="stale", reason="ready")
    refit(22.0, 3, [[0, 1], [1, 2]])
    ev(22.6, "health", slot=1, incarnation=2, before="stale", after="healthy", reason="v3")
    ev(23.0, "request", event="accepted", request_id="r9")
    ev(23.5, "request", event="completed", request_id="r9", slot=1, incarnation=2, version=3, version_start=3)
    ev(24.0, "request", event="accepted", request_id="r10")
    ev(30.0, "stopped", reason="controller shut down")
    ev(30.0, "request", event="returned", request_id="r10", reason="fleet stopped: controller shut down")
    ev(30.1, "phase", phase="shutdown", edge="end", shards={})
    return recs


def test_log_numbers_count_faults_recoveries_and_requests():
    n = log_numbers(_log())
    assert n["requests"] == {"accepted": 5, "completed": 4, "returned": 1, "requeued": 0}
    assert n["prompts_lost"] == 0
    assert n["faults_injected"] == 1 and n["deaths"] == 1
    assert n["restarts_started"] == n["restarts_ok"] == 1
    assert n["recoveries"] == 1
    assert n["readmissions"][0] | {} == {"slot": 1, "incarnation": 2, "version": 3, "t": 22.6, "restart_end_t": 20.0,
                                         "served_after": 1}
    assert n["gate_reopenings_after_fault"] == 2
    assert n["stopped"] is None, "the controller's own shutdown is not a stop"
    assert n["refits"] == 3 and n["refit_s_max"] == pytest.approx(0.8)


def test_a_lost_request_and_a_real_stop_show():
    log = _log()[:-3] + [{"t": 31.0, "seq": 999, "kind": "stopped", "reason": "below quorum"}]
    n = log_numbers(log)
    assert n["prompts_lost"] == 1 and n["stopped"] == "below quorum"


def test_restart_without_a_stamp_is_not_a_recovery():
    log = [e for e in _log() if not (e["kind"] == "stamp" and e["version"] == 3)]
    assert readmissions(log) == [] and log_numbers(log)["recoveries"] == 0


def test_segments_and_spans():
    log = _log()
    segs = state_segments(log, 30.1)
    assert [s[2] for s in segs[1]] == ["starting", "stale", "healthy", "dead", "restarting", "stale", "healthy"]
    assert segs[1][-1][3] == 2 and segs[1][-1][1] == 30.1
    assert [s["version"] for s in refit_spans(log)] == [1, 2, 3]


def test_plots_write_pngs(tmp_path):
    from PIL import Image

    rows = [{"step": i, "reward_mean": 0.06 + 0.03 * i, "reward_max": 0.5, "audit_mismatch_max": 1e-6,
             "audit_mismatch_mean": 2e-7, "mismatch_max": 0.3 if i else float("nan")} for i in range(10)]
    a = plot_learning(rows, tmp_path / "l.png", chance=1 / 16, marks=[(3, "kill slot 1", "red")],
                      final={"reward_mean": 0.4, "audit_mismatch_max": 0.0})
    b = plot_timeline(_log(), tmp_path / "t.png", step_times=[10.0, 14.0, 22.0])
    for p in (a, b):
        with Image.open(p) as img:
            assert img.format == "PNG" and img.size[0] >= 600


def test_default_plan_and_plan_errors(tmp_path):
    plan = load_demo_plan(DemoConfig(steps=30, engines=3))
    assert plan.name == "demo-default" and plan.expect == "recovers"
    assert [(f.where, f.what, f.shard, f.step) for f in plan.faults] == [("step_boundary", "kill", 1, 10)]
    assert default_plan(2, 3)["faults"][0]["step"] == 1
    assert load_demo_plan(DemoConfig(fault_plan="none")) is None
    with pytest.raises(ConfigError, match="engines >= 2"):
        load_demo_plan(DemoConfig(engines=1))
    with pytest.raises(ConfigError, match="fault_plan"):
        load_demo_plan(DemoConfig(fault_plan=str(tmp_path / "nope.yaml")))
    p = tmp_path / "p.yaml"
    p.write_text("name: t\nexpect: recovers\nsteps: 4\nfleet: {restart_budget: 1}\n"
                 "faults: [{where: transfer, what: kill, shard: 0, step: 2, delay_s: 0.02}]\n")
    plan = load_demo_plan(DemoConfig(fault_plan=str(p)))
    assert plan.fleet == {"restart_budget": 1} and plan.faults[0].delay_s == 0.02


def test_rejoin_step():
    from health.faultplan import resolve

    cfg = DemoConfig(steps=30)
    firings = resolve(load_demo_plan(cfg), 3)
    assert cfg.rejoin_at(firings) == 20
    assert cfg.rejoin_at([]) is None, "nothing to wait for without faults"
    assert DemoConfig(steps=30, rejoin_step=-1).rejoin_at(firings) is None
    assert DemoConfig(steps=30, rejoin_step=12).rejoin_at(firings) == 12
    late = DemoConfig(steps=3)
    assert late.rejoin_at(resolve(load_demo_plan(late), 3)) == 2


def test_views_and_json_cleaning():
    buf = io.StringIO()
    view = make_view("plain", 3, stream=buf)
    assert isinstance(view, PlainView)
    view.start({"engines": 3, "plan": "demo-default", "kv_policy": "recompute", "seed": 0, "out": "x"})
    status = {"gate_open": True, "ledger": {"slots": [{"slot": 0, "state": "healthy", "incarnation": 1}]}}
    view.step({"step": 0, "version": 0, "reward_mean": float("nan"), "wall_s": 1.0, "refit_s": None}, status)
    view.note("FAULT: kill slot 1")
    text = buf.getvalue()
    assert "step   1/3" in text and "serving 1" in text and "gate open" in text and "FAULT" in text
    assert isinstance(make_view("auto", 3, stream=io.StringIO()), PlainView)  # not a TTY
    with pytest.raises(ValueError):
        make_view("fancy", 3)
    assert _nan_to_none({"a": [float("nan"), 1.0], "b": float("inf")}) == {"a": [None, 1.0], "b": None}


class _FakeFleet:
    def __init__(self, log):
        self.log = log

    def events(self, since=0, kinds=None):
        return [e for e in self.log[since:] if kinds is None or e["kind"] in kinds]


def test_event_watcher_notes_death_restart_and_readmission():
    w = EventWatcher(_FakeFleet(_log()))
    notes = w.poll()
    assert any("healthy -> dead" in n for n in notes)
    assert any("restarting as incarnation 2" in n for n in notes)
    assert any("re-admitted: stamped v3" in n for n in notes)
    assert w.poll() == []
