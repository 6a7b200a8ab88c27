"""The demo's pure parts: the plots, the fault plans and their firing, the views and the event notes.

The numbers read off the event log are ``faults.timeline``'s (tests/unit/test_timeline.py).
"""

from __future__ import annotations

import io
import os

import pytest

from rlfleet.demo.report import continuation_figures, continuation_line, on_purpose_line, plot_learning, plot_timeline, state_segments
from rlfleet.demo.run import DemoConfig, EventWatcher, _nan_to_none, default_plan, load_demo_plan
from rlfleet.demo.view import PlainView, make_view
from rlfleet.faults.firing import FaultFiring
from rlfleet.fleet.errors import ConfigError
from rlfleet.fleet.records import of_kinds
from rlfleet.health.faultplan import Firing
from tests.unit.test_timeline import demo_log as _log


def test_segments():
    segs = state_segments(_log(), 30.1)
    assert [s[2] for s in segs[1]] == ["starting", "stale", "healthy", "dead", "restarting", "stale", "healthy"]
    assert segs[1][-1][3] == 2 and segs[1][-1][1] == 30.1


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


def _summary(counters, continued, fired):
    return {**continuation_figures(counters, continued), "fault_plan": {"fired": fired}}


KILL = {"step": 10, "slot": 1, "what": "kill", "where": "step_boundary"}


def test_continuation_line_reports_the_client_counters_after_a_shard_kill():
    """The report says what continuation saved: requests continued (counted from the results) and the
    tokens reused and discarded (the client's counters), once the run killed a shard."""
    counters = {"accepted": 64, "completed": 64, "returned": 0, "tokens_reused": 1234, "tokens_discarded": 0}
    summary = _summary(counters, 7, [KILL])
    assert (summary["requests_continued"], summary["tokens_reused"], summary["tokens_discarded"]) == (7, 1234, 0)
    assert continuation_line(summary) == ("continuation: 7 requests continued after the shard kill, "
                                          "1234 tokens reused (not generated again)")
    one = continuation_line(_summary({"tokens_reused": 1, "tokens_discarded": 5}, 1, [KILL]))
    assert one == ("continuation: 1 request continued after the shard kill, 1 token reused (not generated again); "
                   "5 tokens discarded (requests that started over)")


def test_the_report_names_every_process_the_plan_killed_on_purpose_so_rays_death_reports_read_as_kills():
    """Issue 49: Ray prints "A worker died or was killed ... SYSTEM_ERROR" for each kill the plan fires; the run's
    own output names those processes. Nothing killed: no line."""
    controller = {"step": 15, "slot": None, "what": "kill_controller", "where": "transfer", "controller": {"pid": 8925}}
    line = on_purpose_line(_summary({}, 0, [KILL, controller]))
    assert line.startswith("killed on purpose by the fault plan: slot 1's engine shard (step 10), "
                           "the controller (pid 8925) (step 15); Ray reports each of these deaths"), line
    assert on_purpose_line(_summary({}, 0, [])) is None
    assert on_purpose_line(_summary({}, 0, [{"step": 3, "slot": 0, "what": "hang", "where": "generate"}])) is None


def test_the_demo_command_lets_ray_print_each_death_report_where_it_happens(monkeypatch):
    """Ray's log deduplication held the controller's death report back and printed it after "shutting down";
    the demo command turns it off before anything imports Ray (an explicit setting is kept)."""
    import argparse
    import sys

    from rlfleet.cli import demo as cli_demo

    seen = {}

    def fake_run_demo(cfg):
        seen["dedup"] = os.environ.get("RAY_DEDUP_LOGS")
        raise SystemExit(0)

    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
    monkeypatch.setitem(sys.modules, "rlfleet.demo.run", type(sys)("rlfleet.demo.run"))
    sys.modules["rlfleet.demo.run"].DemoConfig = lambda **kw: kw
    sys.modules["rlfleet.demo.run"].run_demo = fake_run_demo
    sys.modules["rlfleet.demo.run"]._nan_to_none = lambda x: x
    args = argparse.Namespace(steps=1, engines=3, fault_plan="none", kv_policy="recompute", out="/tmp/x", seed=0,
                              model=None, progress="off", rejoin_step=None)
    with pytest.raises(SystemExit):
        cli_demo._cmd_demo(args)
    assert seen["dedup"] == "0"
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")
    with pytest.raises(SystemExit):
        cli_demo._cmd_demo(args)
    assert seen["dedup"] == "1"


def test_continuation_line_when_nothing_was_continued():
    """A kill with nothing mid-generation says so; a run that killed no shard and continued nothing has no
    line; counters never read (the fleet did not start) count as zero."""
    assert continuation_line(_summary({"tokens_reused": 0}, 0, [KILL])) == (
        "continuation: 0 requests continued after the shard kill, 0 tokens reused (not generated again) "
        "(no request was mid-generation on the shard when it died)")
    controller_only = [{"step": 15, "slot": None, "what": "kill_controller", "where": "transfer"}]
    assert continuation_line(_summary({}, 0, controller_only)) is None
    assert continuation_line(_summary(None, 0, [])) is None
    assert continuation_figures(None, 0) == {"requests_continued": 0, "tokens_reused": 0, "tokens_discarded": 0}


def test_default_plan_and_plan_errors(tmp_path):
    plan = load_demo_plan(DemoConfig(steps=30, engines=3))
    assert plan.name == "demo-default" and plan.expect == "recovers"
    assert [(f.where, f.what, f.shard, f.step) for f in plan.faults] == [
        ("stream", "kill", 1, 10), ("transfer", "kill_controller", None, 15)]
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
    p.write_text("name: t\nfaults: [\n  - {where: pause\n")  # a YAML typo: named, with its line
    with pytest.raises(ConfigError, match=r"fault_plan: fault plan: not valid YAML at line 3"):
        load_demo_plan(DemoConfig(fault_plan=str(p)))


@pytest.mark.parametrize("field", ["out", "model"])
def test_a_report_directory_or_model_that_cannot_be_used_is_refused_before_anything_starts(tmp_path, field):
    """Both ended a run late before: an unwritable ``--out`` in a traceback from ``mkdir``, a missing
    ``--model`` after Ray had started. ``DemoRun`` refuses them as it is built, naming the field."""
    from rlfleet.demo.run import DemoRun

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = {"out": {"out": str(blocker / "report")}, "model": {"model": str(tmp_path / "no-model"), "out": str(tmp_path)}}
    with pytest.raises(ConfigError) as err:
        DemoRun(DemoConfig(fault_plan="none", **bad[field]))
    assert err.value.field == field, err.value


def test_rejoin_step():
    from rlfleet.health.faultplan import resolve

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
    def __init__(self, log=(), states=None):
        self.log = list(log)
        self.states = dict(states or {})
        self.calls: list[tuple] = []

    def events(self, since=0, kinds=None):
        return of_kinds(self.log[since:], kinds)

    def status(self):
        return {"ledger": {"slots": [{"slot": s, "state": st, "incarnation": 1} for s, st in self.states.items()]}}

    def fault_injector(self):  # the fake fleet is its own injector
        return self

    def kill_shard(self, slot):
        self.calls.append(("kill_shard", slot))
        return True

    def arm_fault(self, slot, point, action, delay_s=0.0, after_calls=0):
        self.calls.append(("arm_fault", slot, point, action, delay_s) + ((after_calls,) if after_calls else ()))
        return True


def test_event_watcher_notes_death_restart_and_readmission():
    w = EventWatcher(_FakeFleet(_log()))
    notes = w.poll()
    assert any("healthy -> dead" in n for n in notes)
    assert any("restarting as incarnation 2" in n for n in notes)
    assert any("re-admitted: stamped v3" in n for n in notes)
    assert w.poll() == []


def test_event_watcher_tells_each_record_once_when_a_late_client_record_shifts_the_merged_log():
    """``Fleet.events`` merges the controller's log with the client's by time: a client record stamped before
    records already read lands among them and pushes them past ``since``; they are not told again."""
    log = _log()
    fleet = _FakeFleet(log)
    w = EventWatcher(fleet)
    first = w.poll()
    fleet.log = log[:1] + [{"t": log[0]["t"], "kind": "request", "event": "requeued", "request_id": "r"}] + log[1:]
    fleet.log = [{**e, "seq": i} for i, e in enumerate(fleet.log)]
    assert first and w.poll() == []


def test_fault_firing_fires_each_step_s_faults_at_their_hook_points():
    fleet = _FakeFleet(states={0: "healthy", 1: "stale", 2: "healthy"})
    firings = [Firing(1, "step_boundary", "kill", 1), Firing(1, "transfer", "freeze", 0, 0.5),
               Firing(1, "stream", "kill", 2, 0.0, 40), Firing(2, "step_boundary", "slow", 2), Firing(5, "pause", "kill", 2)]
    firing = FaultFiring(fleet, firings)
    assert firing.at(0) == [] and fleet.calls == []
    assert firing.at(1) == firings[:3]
    assert fleet.calls == [("kill_shard", 1), ("arm_fault", 0, "transfer", "freeze", 0.5),
                           ("arm_fault", 2, "stream", "kill", 0.0, 40)], "a count of calls to let pass goes with the arming"
    firing.fire(firings[3])
    assert fleet.calls[-1] == ("arm_fault", 2, "ping", "slow", 0.0), "a step-boundary fault other than a kill: at the probe"
    assert [(f["step"], f["slot"], f["what"]) for f in firing.fired] == [(1, 1, "kill"), (1, 0, "freeze"), (1, 2, "kill"),
                                                                          (2, 2, "slow")]
    assert firing.beyond(2) == firings[4:] and firing.due(5) == firings[4:]


def test_a_kill_waits_for_the_slot_to_be_up_then_fires_anyway():
    fleet = _FakeFleet(states={0: "restarting"})
    notes = []
    FaultFiring(fleet, log=notes.append, up_timeout_s=0.01).fire(Firing(1, "step_boundary", "kill", 0))
    assert fleet.calls == [("kill_shard", 0)] and "gave up waiting for slot 0" in notes[0]
