"""``rlfleet fleet list|status|stop`` from another process, on real Ray (engines with no model: the
``null`` backend, so the test costs seconds): a fleet outlives the driver that started it, so a shell
must be able to find it by name and stop it, leaving no engine behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.errors import ConfigError, FleetStopped
from rlfleet.fleet.cluster.naming import shard_name

pytestmark = pytest.mark.quick  # no vLLM engine: seconds, in the quick lane

NAME = "cli-test-fleet"


def rlfleet(*args: str) -> tuple[int, list[dict]]:
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    proc = subprocess.run([sys.executable, "-m", "rlfleet.cli.main", "fleet", *args, "--address", ray_door.cluster_address()],
                          capture_output=True, text=True, env=env, timeout=180)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, rows


def test_a_fleet_is_listed_inspected_and_stopped_by_name_from_a_shell(ray_local, tiny_model):
    fleet = Fleet.start({"engine": {"model": tiny_model, "backend": "null"}, "num_engines": 2, "name": NAME})
    try:
        assert fleet.generate([[1, 2, 3]])[0][0].ok
        with pytest.raises(ConfigError, match="name"):  # the name is taken while it runs
            Fleet.start({"engine": {"model": tiny_model, "backend": "null"}, "num_engines": 1, "name": NAME})
        code, rows = rlfleet("list")
        assert code == 0 and {"fleet": NAME} in rows
        code, rows = rlfleet("status", NAME)
        assert code == 0 and rows[0]["fleet"] == NAME and rows[0]["gate_open"]
        code, rows = rlfleet("stop", NAME)
        assert code == 0 and rows[0]["shards"] == {"0": "ok", "1": "ok"}
        assert all(ray_door.find_actor(shard_name(NAME, s, 1)) is None for s in range(2))
        code, rows = rlfleet("list")
        assert code == 0 and {"fleet": NAME} not in rows
        code, _ = rlfleet("status", NAME)
        assert code == 2  # "no running fleet of that name", one line, no traceback
        # the driver that started it is told who stopped it, not that its controller "died"
        late = fleet.generate([[1, 2, 3]])[0][0]
        assert not late.ok and "`rlfleet fleet stop`" in late.reason, late
        with pytest.raises(FleetStopped, match=r"the fleet stopped \(shut down by `rlfleet fleet stop` \(process \d+"):
            fleet.status()
        out = fleet.shutdown()
        assert "error" not in out and "`rlfleet fleet stop`" in out["already_stopped"], out
    finally:
        fleet.shutdown()
