"""``rlfleet demo`` (and ``rlfleet faults run``) ended by a signal, as a batch system or an operator ends it: it writes its report.

Each case runs the demo as a process in its own session (one real vLLM-CPU engine, no
fault plan), waits until training steps are done, then sends SIGTERM:

- to the whole process group (what ``timeout``, Slurm's ``scancel`` or Ctrl-C on a terminal
  do): the local Ray the demo started stops with it. The demo exits 143 within seconds, its
  report names the signal, the requests it had in flight are returned and logged (no prompt
  lost, every invariant holds), and no process of its session is left;
- to the demo's process only (``kill PID``): Ray is still up, so the demo shuts the fleet
  down in order, writes the same report and exits 143, leaving nothing behind.

Before this, a SIGTERM ended the demo through Ray's own handler (``sys.exit``) past the code
that writes the report: the run left no ``summary.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.fleet_helpers import cli_env, session, session_gone, signal_and_wait, wait_for
from rlfleet.fleet.records import Phase

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["process-group", "process"])
def test_sigterm_ends_the_demo_with_its_report_and_nothing_left_behind(tiny_model, tmp_path, target):
    out = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli.main", "demo", "--engines", "1", "--fault-plan", "none", "--steps", "200",
         "--model", tiny_model, "--out", str(out), "--progress", "plain"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        wait_for(lambda: any("step   3/200" in line for line in lines) or proc.poll() is not None, 240,
                 what="the demo's third training step")
        assert proc.poll() is None, f"the demo ended on its own: {''.join(lines[-20:])}{''.join(errors[-40:])}"
        assert len(session(proc.pid)) > 3  # the local Ray's daemons run in the session the signal may reach
        # bounded: past it the demo is SIGKILLed and its exit status is not 143 (the group's case stops Ray too)
        code, took = signal_and_wait(proc, group=target == "process-group", timeout=30 if target == "process-group" else 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    detail = "".join(lines[-30:]) + "".join(errors[-40:])
    assert code == 128 + signal.SIGTERM, (code, f"{took:.1f} s", detail)
    digest = json.loads(lines[-1])
    assert digest["interrupted"] == "SIGTERM" and digest["ok"] is False, detail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] == "interrupted by SIGTERM" and summary["steps"] >= 3, detail
    assert summary["prompts_lost"] == 0 and summary["invariant_violations"] == [], detail
    assert bool(summary["ray_gone"]) is (target == "process-group"), detail  # the signal reached Ray, or did not
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.startswith("{")]
    if target == "process":  # Ray was up: the fleet was shut down in order, by its controller
        assert any(Phase.matches(e) and e.get("phase") == "shutdown" and e.get("edge") == "end" for e in events), detail
    session_gone(proc.pid)


@pytest.mark.timeout(180)
def test_sigterm_while_the_fleet_starts_ends_faults_run_at_once_with_nothing_left(tmp_path):
    """``rlfleet faults run`` signalled (whole process group) while its fleet's engines start: the signal
    lands in ``Fleet.start``, which used to shut the half-started fleet down through the Ray the signal had
    just stopped; that waited 60 s on the dead GCS and died with exit 1 and no summary. Now the fleet is
    abandoned (nothing is left to ask), the run reports what finished (nothing) and exits 143 in seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli.main", "faults", "run", "--matrix", "--only", "kill-during-pause"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        wait_for(lambda: any("starting a fleet" in line for line in lines) or proc.poll() is not None, 120,
                 what="the fleet's start")
        time.sleep(3.0)  # well inside the start: three engines take tens of seconds to come up
        assert proc.poll() is None and not any("PASS in" in line or "FAIL in" in line for line in lines), lines
        code, took = signal_and_wait(proc, timeout=20)  # bounded: past it, SIGKILL (exit status not 143)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    detail = "".join(lines[-30:])
    assert code == 128 + signal.SIGTERM, (code, took, detail)
    assert any("interrupted by SIGTERM: 0 of 1 variant(s) finished" in line for line in lines), detail
    summary = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    assert summary["interrupted"] == "SIGTERM" and summary["variants"] == 0, detail
    # the workers still starting sit in process groups of their own, which the signal missed: the run ends
    # them before it exits (they used to import vLLM for up to a minute before noticing their raylet went)
    session_gone(proc.pid, within_s=20)
