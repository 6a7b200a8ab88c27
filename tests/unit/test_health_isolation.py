"""health/ must stay importable and testable without Ray or vLLM (DESIGN.md)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from rlfleet import health

HEALTH_DIR = pathlib.Path(health.__file__).resolve().parent
REPO_ROOT = HEALTH_DIR.parent
FORBIDDEN = re.compile(r"^\s*(import\s+(ray|vllm)\b|from\s+(ray|vllm)(\.|\s))", re.MULTILINE)


def test_forbidden_pattern_catches_every_spelling():
    # The guard itself must be able to fail.
    for line in ("import ray", "import vllm.engine", "from ray import exceptions",
                 "from vllm.v1 import x", "    import ray  # lazy", "from ray.exceptions import A"):
        assert FORBIDDEN.search(line), line
    for line in ("import rayon", "from raylib import x", "# import ray is forbidden", "x = 'ray'"):
        assert not FORBIDDEN.search(line), line


def test_no_module_under_health_imports_ray_or_vllm():
    sources = sorted(HEALTH_DIR.rglob("*.py"))
    assert len(sources) >= 10, f"expected the health package, found {sources}"
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {m.group(0).strip()}"
        for path in sources
        for m in FORBIDDEN.finditer(path.read_text())
    ]
    assert offenders == []


def test_importing_health_loads_neither_ray_nor_vllm():
    code = (
        "import sys, rlfleet.health, rlfleet.health.testing\n"
        "import rlfleet.health.core, rlfleet.health.quorum, rlfleet.health.membership, rlfleet.health.classify\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'torch'))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_control_plane_logic_and_its_unit_fakes_load_no_ray():
    """Only the door (``fleet.cluster.ray_door``) may import Ray: the control plane, the data plane's
    dispatch, the outcomes, the weight port and the unit tests' fakes run without it."""
    code = (
        "import sys, rlfleet.fleet.control.controller, rlfleet.fleet.control.lifecycle, rlfleet.fleet.control.slots, "
        "rlfleet.fleet.control.monitor, rlfleet.fleet.data.dispatch, rlfleet.fleet.outcome, "
        "rlfleet.fleet.control.transfer_port, rlfleet.fleet.records\n"
        "import tests.unit.fleet_fakes\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
