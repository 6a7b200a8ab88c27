"""scripts/bench_health.py runs and ends with one JSON line (small run, for CI)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_health.py"


def test_benchmark_reports_events_per_second_as_its_last_line():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--events", "20000", "--slots", "64", "--seed", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["events"] == 20000 and result["slots"] == 64 and result["seed"] == 3
    assert result["events_per_s"] > 0 and result["seconds"] > 0
    # The random mix really exercises the core, not only the late path.
    for key in ("ok", "dead", "suspect", "hung", "late"):
        assert result["decisions"].get(key, 0) > 0, key
    for action in ("Probe", "Restart", "Evict", "AbortRefit"):
        assert result["actions"].get(action, 0) > 0, action
    # every refit ends in a gate verdict (the random mix aborts most of them: an unacknowledged resume stops one)
    assert result["actions"].get("OpenGate", 0) + result["actions"].get("KeepGateClosed", 0) >= result["refits"] > 0
