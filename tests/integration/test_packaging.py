"""A real (non-editable) install of rlfleet works away from the checkout, under one import name.

The wheel is built from a copy of the working tree (the build writes build/ and *.egg-info into its source,
never into the repository), offline and without dependencies, then installed into a fresh virtual
environment outside the checkout. That environment reaches torch, vLLM and Ray through one path line to the
running venv's site-packages: a path added that way is not a site directory, so the running venv's editable
install of this checkout (its ``.pth`` hook) is not loaded there, and every ``rlfleet`` module must come from
the wheel. The test reads the installed top-level names from the wheel's RECORD, runs the console script,
imports ``Fleet``, loads the vLLM plugin entry point through vLLM's own loader, and renders a Slurm launcher
from the package data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlfleet.cli import slurm as slurm_cli

pytestmark = pytest.mark.quick  # no vLLM engine: seconds, in the quick lane

REPO = Path(__file__).resolve().parents[2]
SUBMIT_ARGS = ["--nodes", "3", "--cpus-per-node", "4", "--", "python", "-m", "my_recipe"]

# Run in the fresh environment: where each module came from, and what vLLM's plugin loader found.
PROBE = """
import json, sys
import rlfleet
from rlfleet import Fleet
import rlfleet.cli.main, rlfleet.cli.slurm, rlfleet.slurm
from vllm.plugins import load_plugins_by_group
plugins = load_plugins_by_group("vllm.general_plugins")
register = plugins["rlfleet_gloo_weights"]
register()
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
mods = ("rlfleet", "rlfleet.fleet.api", "rlfleet.cli.main", "rlfleet.cli.slurm", "rlfleet.slurm", register.__module__)
print("PROBE " + json.dumps({
    "origins": {m: sys.modules[m].__file__ for m in mods},
    "fleet": f"{Fleet.__module__}.{Fleet.__qualname__}",
    "plugin": f"{register.__module__}:{register.__qualname__}",
    "gloo_registered": "gloo" in WeightTransferEngineFactory._registry,
    "version": rlfleet.__version__,
}))
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


def _installed_top_level(site: Path) -> set[str]:
    """The top-level names the wheel put into ``site``: its RECORD's first path parts, less its dist-info."""
    (record,) = site.glob("rlfleet-*.dist-info/RECORD")
    paths = [line.split(",", 1)[0] for line in record.read_text().splitlines() if line]
    return {p.split("/", 1)[0] for p in paths if not p.startswith("..") and ".dist-info/" not in p}


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory):
    """A wheel of the working tree, installed into a fresh venv outside the checkout: (venv, its site-packages)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("the packaging test needs a git checkout (it builds the wheel from the tracked files)")
    root = tmp_path_factory.mktemp("packaging")
    source, wheels, venv = root / "src", root / "wheels", root / "venv"
    _copy_working_tree(source)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels),
                    str(source)], cwd=root, env=env, check=True, timeout=180)  # fmt: skip
    (wheel,) = wheels.glob("rlfleet-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   cwd=root, env=env, check=True, timeout=180)  # fmt: skip
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    # torch, vLLM, Ray from the running venv, as a path line (not a site dir: its .pth hooks are not run)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv, site, env


def test_the_wheel_installs_one_top_level_package_rlfleet(fresh_install):
    venv, site, _ = fresh_install
    assert _installed_top_level(site) == {"rlfleet"}
    installed = {p.name for p in (site / "rlfleet").iterdir() if (p / "__init__.py").is_file()}
    assert installed == {"fleet", "refit", "health", "recipe", "demo", "faults", "serve", "sim", "cli", "rlapi",
                         "slurm"}, installed  # fmt: skip
    assert (site / "rlfleet" / "slurm" / slurm_cli.TEMPLATE).is_file()  # package data


def test_the_installed_console_script_imports_and_plugin_load_from_the_wheel(fresh_install, tmp_path):
    venv, site, env = fresh_install
    help_out = subprocess.run([str(venv / "bin" / "rlfleet"), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert help_out.returncode == 0, help_out.stderr
    assert help_out.stdout.startswith("usage: rlfleet") and "serve" in help_out.stdout

    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.split("PROBE ", 1)[1].splitlines()[0])
    assert probe["fleet"] == "rlfleet.fleet.api.Fleet"
    assert probe["plugin"] == "rlfleet.rlapi.vllm_gloo:register" and probe["gloo_registered"]
    assert probe["version"] != "0+unknown"
    for module, path in probe["origins"].items():
        assert Path(path).is_relative_to(site), f"{module} was imported from {path}, not from the wheel in {site}"


def test_the_installed_wheel_submits_a_slurm_dry_run_from_its_package_data(fresh_install, tmp_path, capsys):
    venv, _, env = fresh_install
    out = subprocess.run([str(venv / "bin" / "rlfleet"), "slurm", "submit", "--dry-run", *SUBMIT_ARGS],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr

    assert slurm_cli.main(["submit", "--dry-run", *SUBMIT_ARGS]) == 0  # the same flags, rendered from this checkout
    assert out.stdout == capsys.readouterr().out
    assert out.stdout.startswith("#!/bin/bash\n") and "#SBATCH --nodes=3\n" in out.stdout
    assert "DEFAULT_DRIVER=(python -m my_recipe)" in out.stdout
