"""`rlfleet faults run`: table, last-line JSON summary and exit code, with the runner stubbed (no Ray)."""

import json

import pytest

from rlfleet.cli import main as cli
from rlfleet.faults.runner import VariantReport

FIRED = {"slot": 2, "incarnation": 1, "point": "pause", "action": "kill", "t": 10.0, "left_for": "dead",
         "fault_to_reopen_s": 1.5, "recover_s": 9.0}


@pytest.fixture
def stub_runner(monkeypatch):
    seen = {}

    def fake_run_variants(model, variants, log=print, **kw):
        seen["names"] = [v.name for v in variants]
        return [VariantReport(v.name, v.plan["expect"], v.plan["expect"], passed=(i != seen.get("fail_at")),
                              accepted=4, completed=4, fault_to_reopen_s=1.5 if i == 0 else None,
                              faults=[{**FIRED, "slot": i}] if i == 0 else [])
                for i, v in enumerate(variants)]

    monkeypatch.setattr("rlfleet.faults.runner.run_variants", fake_run_variants)
    monkeypatch.setattr("rlfleet.fleet.cluster.ray_door.init_local", lambda **kw: None)
    monkeypatch.setattr("rlfleet.fleet.cluster.ray_door.shutdown", lambda: None)
    return seen


def test_matrix_prints_table_and_json_summary(stub_runner, capsys, tmp_path):
    rc = cli.main(["faults", "run", "--matrix", "--only", "kill-during-pause", "hang-past-deadline", "--model", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert rc == 0 and summary["variants"] == 2 and summary["passed"] == 2
    assert summary["prompts_lost"] == 0 and summary["wrong_version_tags"] == 0
    assert any("kill-during-pause" in line and "PASS" in line for line in out)
    row = next(line for line in out if line.startswith("kill-during-pause"))
    assert "s0/i1 pause:kill" in row and "1.5" in row, "a row lists the fault it fired and its fault -> reopen"
    assert "none" in next(line for line in out if line.startswith("hang-past-deadline"))
    assert summary["per_variant"] == {
        "kill-during-pause": {"passed": True, "fault_to_reopen_s": 1.5, "faults": [
            {"slot": 0, "incarnation": 1, "point": "pause", "action": "kill", "fault_to_reopen_s": 1.5}]},
        "hang-past-deadline": {"passed": True, "fault_to_reopen_s": None, "faults": []},
    }


def test_a_missed_variant_fails_the_run(stub_runner, capsys, tmp_path):
    stub_runner["fail_at"] = 1
    rc = cli.main(["faults", "run", "--matrix", "--only", "kill-during-pause", "hang-past-deadline", "--model", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and summary["failed"] == ["hang-past-deadline"]


def test_a_bad_plan_file_is_refused_naming_the_field(stub_runner, tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    plan.write_text("name: x\nexpect: recovers\nfaults:\n  - {where: pause, what: melt, shard: 0}\n")
    rc = cli.main(["faults", "run", "--plan", str(plan), "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "faults[0].what" in err and "melt" in err and "names" not in stub_runner


def test_a_trainer_s_fault_is_listed_without_a_slot():
    from rlfleet.cli.faults import _fault_cells

    row = {"fault_to_reopen_s": 0.6, "faults": [{"slot": None, "incarnation": None, "point": "update",
                                                 "action": "corrupt_shape", "fault_to_reopen_s": 0.6}]}
    assert _fault_cells(row) == {"fired": "update:corrupt_shape", "fault_to_reopen_s": "0.6"}


@pytest.mark.parametrize("case", ["not-yaml", "missing-file", "unknown-variant"])
def test_a_plan_or_variant_the_user_got_wrong_is_one_line_and_exit_2(stub_runner, tmp_path, capsys, case):
    """Each of these was a traceback (exit 1) before: a YAML typo, a plan path that is not there, a misspelt
    variant name. Now one line names the file or flag and what is wrong with it, and nothing starts."""
    plan = tmp_path / "p.yaml"
    plan.write_text("name: x\nfaults: [\n  - {where: pause\n")
    argv = {"not-yaml": ["--plan", str(plan)], "missing-file": ["--plan", str(tmp_path / "gone.yaml")],
            "unknown-variant": ["--matrix", "--only", "kill-during-pauze"]}[case]
    rc = cli.main(["faults", "run", *argv, "--model", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "names" not in stub_runner and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith("rlfleet: error: ")
    expect = {"not-yaml": ("p.yaml", "not valid YAML at line 3"), "missing-file": ("gone.yaml", "No such file"),
              "unknown-variant": ("--only", "kill-during-pauze")}[case]
    assert all(part in err for part in expect), err


def test_a_signal_mid_run_reports_the_variants_that_finished_and_exits_128_plus_it(monkeypatch, tmp_path, capsys):
    """The runner is interrupted in the second variant (as ``fleet.interrupt`` raises it in the main thread):
    the first variant's row and the summary are printed, ``interrupted`` names the signal, exit 143."""
    import signal

    from rlfleet.fleet import interrupt

    def interrupted_run(model, variants, log=print, done=None, **kw):
        done.append(VariantReport(variants[0].name, "recovers", "recovers", passed=True, accepted=4, completed=4))
        interrupt._raise_interrupted(signal.SIGTERM, None)

    monkeypatch.setattr("rlfleet.faults.runner.run_variants", interrupted_run)
    monkeypatch.setattr("rlfleet.fleet.cluster.ray_door.init_local", lambda **kw: None)
    monkeypatch.setattr("rlfleet.fleet.cluster.ray_door.shutdown", lambda: None)
    monkeypatch.setattr("rlfleet.fleet.cluster.ray_door.local_ray_down", lambda wait_s=2.0: [])  # Ray still up: shut down in order
    rc = cli.main(["faults", "run", "--matrix", "--only", "kill-during-pause", "hang-past-deadline", "--model", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert rc == 128 + signal.SIGTERM and summary["interrupted"] == "SIGTERM"
    assert summary["variants"] == 1 and list(summary["per_variant"]) == ["kill-during-pause"]
    assert any("interrupted by SIGTERM: 1 of 2 variant(s) finished" in line for line in out), out
    assert signal.getsignal(signal.SIGTERM) is not interrupt._raise_interrupted  # the caller's handlers are back
