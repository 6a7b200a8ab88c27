"""A real (non-editable) install of rlfleet works away from the checkout.

`pip install --target` of a copy of the working tree (the build writes build/ and
*.egg-info into its source, never into the repository), without dependencies (torch,
vLLM and Ray come from the running venv), offline. Then the installed console script
runs `rlfleet slurm submit --dry-run` from a folder outside the repository, and the
test checks that the modules and the sbatch template came from the install, not from
this checkout (the venv holds an editable install of it that could shadow the copy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import slurm as slurm_cli

pytestmark = pytest.mark.quick  # no vLLM engine: seconds, in the quick lane

REPO = Path(__file__).resolve().parents[2]
SUBMIT_ARGS = ["--nodes", "3", "--cpus-per-node", "4", "--", "python", "-m", "my_recipe"]

# Runs the console script in this process's place and, at exit, reports where the
# modules it used were loaded from.
PROBE = """
import atexit, json, runpy, sys
mods = ("cli", "cli.main", "cli.slurm", "slurm")
atexit.register(lambda: print("ORIGINS " + json.dumps({m: sys.modules[m].__file__ for m in mods if m in sys.modules}), file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _copy_working_tree(dest: Path) -> None:
    """Tracked files and untracked ones git does not ignore: what a fresh checkout would hold."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # skips files deleted in the working tree
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_installed_wheel_submits_a_dry_run_from_outside_the_repository(tmp_path, capsys):
    source, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _copy_working_tree(source)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        cwd=elsewhere, env=env, check=True, timeout=180,
    )  # fmt: skip
    script = target / "bin" / "rlfleet"
    assert script.is_file(), f"pip installed no console script: {sorted(p.name for p in target.iterdir())}"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(script), "slurm", "submit", "--dry-run", *SUBMIT_ARGS],
        cwd=elsewhere, env={**env, "PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr

    origins = json.loads(out.stderr.split("ORIGINS ", 1)[1].splitlines()[0])
    assert set(origins) == {"cli", "cli.main", "cli.slurm", "slurm"}, origins
    for module, path in origins.items():
        assert Path(path).is_relative_to(target), f"{module} was imported from {path}, not from the install in {target}"
    assert (target / "slurm" / slurm_cli.TEMPLATE).is_file()

    assert slurm_cli.main(["submit", "--dry-run", *SUBMIT_ARGS]) == 0  # the same flags, rendered from this checkout
    assert out.stdout == capsys.readouterr().out
    assert out.stdout.startswith("#!/bin/bash\n") and "#SBATCH --nodes=3\n" in out.stdout
    assert "DEFAULT_DRIVER=(python -m my_recipe)" in out.stdout
