"""`rlfleet slurm submit` and the launcher script, without Slurm: rendering, validation, shell syntax.

Fast (no Slurm, no Ray): these run anywhere bash runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.cli import slurm as slurm_cli
from rlfleet.cli.slurm import JobSpec, SubmitError, render, render_default

pytestmark = pytest.mark.quick  # no vLLM engine: seconds, in the quick lane

REPO = Path(__file__).resolve().parents[2]


def _dry_run(capsys, *args: str) -> str:
    assert slurm_cli.main(["submit", "--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_committed_launcher_equals_the_rendered_template():
    committed = (REPO / "slurm" / "rlfleet.sbatch").read_text()
    assert committed == render_default(), (
        "slurm/rlfleet.sbatch is stale; regenerate it: "
        "python -c 'from rlfleet.cli.slurm import render_default; print(render_default(), end=\"\")' > slurm/rlfleet.sbatch"
    )


def test_embedded_supervisor_is_the_step_program_verbatim():
    script = render_default()
    program = (REPO / "slurm" / "rlfleet_step.py").read_text().rstrip()
    assert program in script
    assert "# @RLFLEET_STEP_PY@" not in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_rendered_scripts_are_valid_bash(tmp_path):
    for text in (render_default(), render(JobSpec(nodes=4, gpus_per_node=8, settings={"RLFLEET_SETUP": "source 'a b'/bin/activate"}))):
        path = tmp_path / "job.sbatch"
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_dry_run_fills_header_settings_and_driver(capsys):
    out = _dry_run(
        capsys, "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-node", "64", "--partition", "h100",
        "--auth", "token", "--setup", "source $HOME/venv/bin/activate", "--sbatch-arg=--mem=0",
        "--", "python", "-m", "my_recipe", "--name", "a b",
    )  # fmt: skip
    header = [line for line in out.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=rlfleet",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=01:00:00",
        "#SBATCH --output=rlfleet-%j.out",
        "#SBATCH --no-kill",
        "#SBATCH --partition=h100",
        "#SBATCH --mem=0",
    ]
    assert 'RLFLEET_GPUS_PER_NODE="8"' in out
    assert 'RLFLEET_ON_NODE_LOSS="continue"' in out
    assert 'RLFLEET_AUTH="token"' in out
    assert 'RLFLEET_SETUP="source \\$HOME/venv/bin/activate"' in out  # expanded in the step, not at render time
    assert "DEFAULT_DRIVER=(python -m my_recipe --name 'a b')" in out
    assert ': "${RLFLEET_DASHBOARD:=0}"' in out  # untouched settings keep their env-overridable default


def test_default_driver_is_the_demo(capsys):
    assert "DEFAULT_DRIVER=(rlfleet demo)" in _dry_run(capsys)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0"], "--nodes"),
        (["--gpus-per-node", "-1"], "--gpus-per-node"),
        (["--time", "soon"], "--time"),
        (["--sbatch-arg=mem=0"], "--sbatch-arg"),
        (["--container-image", "a.sqsh", "--apptainer-image", "b.sif"], "exclude each other"),
        (["--on-node-loss", "sometimes"], "--on-node-loss must be one of continue, fail; got 'sometimes'"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_submitted(capsys, args, message):
    assert slurm_cli.main(["submit", "--dry-run", *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_launcher_files_are_one_line_naming_the_file(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rlfleet.slurm", None)  # as if the install shipped no `rlfleet.slurm` package
    assert slurm_cli.main(["submit", "--dry-run"]) == 2
    assert "launcher file rlfleet.sbatch.in of package rlfleet.slurm not found" in capsys.readouterr().err


def test_unknown_setting_is_refused():
    with pytest.raises(SubmitError, match="RLFLEET_NOPE"):
        render(JobSpec(settings={"RLFLEET_NOPE": "1"}))


def test_on_node_loss_fail_keeps_slurms_kill_and_fixes_the_policy(capsys):
    out = _dry_run(capsys, "--on-node-loss", "fail", "--", "python", "x.py")
    assert "#SBATCH --no-kill" not in out.splitlines()
    assert 'RLFLEET_ON_NODE_LOSS="fail"   # set by rlfleet slurm submit' in out


def test_node_loss_policy_defaults_to_continue_with_no_kill_in_the_committed_launcher():
    """Copy-paste users get the same policy as the CLI's default: a lost worker leaves the job to its driver."""
    script = render_default().splitlines()
    header = script[script.index("# >>> sbatch header") : script.index("# <<< sbatch header")]
    assert "#SBATCH --no-kill" in header
    assert any(line.startswith(': "${RLFLEET_ON_NODE_LOSS:=continue}"') for line in script)


def test_node_loss_policy_is_set_by_its_own_field_not_by_settings():
    with pytest.raises(SubmitError, match="on_node_loss"):
        render(JobSpec(settings={"RLFLEET_ON_NODE_LOSS": "fail"}))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_launcher_refuses_an_unknown_node_loss_policy_naming_it(tmp_path):
    """Set in the environment of sbatch (not through the CLI), a bad value stops the job at once: code 64."""
    path = tmp_path / "job.sbatch"
    path.write_text(render_default())
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "RLFLEET_LOG_ROOT": str(tmp_path), "RLFLEET_ON_NODE_LOSS": "maybe"}
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 64, out.stdout + out.stderr
    assert "RLFLEET_ON_NODE_LOSS (--on-node-loss) must be 'continue' or 'fail', got 'maybe'" in out.stdout + out.stderr


def test_register_adds_slurm_submit_to_a_parent_cli():
    import argparse

    parser = argparse.ArgumentParser(prog="rlfleet")
    slurm_cli.register(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["slurm", "submit", "--nodes", "3", "--dry-run", "--", "python", "x.py"])
    assert ns.func is slurm_cli.submit and ns.nodes == 3 and ns.driver[-2:] == ["python", "x.py"]


def test_launcher_refuses_to_run_outside_slurm(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(render_default())
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert out.returncode == 64 and "SLURM_JOB_ID" in out.stdout + out.stderr
