"""One import namespace, ``rlfleet``, over the repository's top-level folders.

pyproject's package list and package-dir map every folder that is a package; no file imports the old
top-level names (scripts/rlfleet_namespace.py --check); ``import rlfleet`` loads neither Ray nor vLLM; and a
checkout put on ``PYTHONPATH`` (a worktree, a plain clone) serves its own folders under ``rlfleet.``.
The wheel itself is tested in tests/integration/test_packaging.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = REPO / "scripts" / "rlfleet_namespace.py"
_spec = importlib.util.spec_from_file_location("rlfleet_namespace", NAMESPACE)
assert _spec and _spec.loader
namespace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(namespace)


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", *patterns], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p]


def test_pyproject_maps_every_package_folder_under_rlfleet():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir, packages = tool["package-dir"], set(tool["packages"])
    assert package_dir == {"rlfleet": "rlfleet", **{f"rlfleet.{p}": p for p in namespace.PACKAGES}}
    inits = [p for p in _tracked("*__init__.py") if p.relative_to(REPO).parts[0] in namespace.PACKAGES]
    folders = {"rlfleet"} | {"rlfleet." + ".".join(p.relative_to(REPO).parent.parts) for p in inits}
    assert packages == folders, f"listed but no package: {sorted(packages - folders)}; missing: {sorted(folders - packages)}"


def test_the_rewrite_knows_a_module_path_from_a_file_name():
    modules = namespace.known_modules()
    src = (
        "from fleet.api import Fleet\n"
        "import health\n"
        "    import fleet.data.client as client_mod\n"
        'cmd = [sys.executable, "-m", "cli.main", "serve", "--config", "fleet.yaml"]\n'
        'monkeypatch.setattr("fleet.cluster.ray_door.init_local", f)\n'
        'raise ValueError("fleet.sync_weights: no answer")\n'
    )
    out, refused = namespace.rewrite(src, ".py", modules)
    assert out == (
        "from rlfleet.fleet.api import Fleet\n"
        "from rlfleet import health\n"
        "    import rlfleet.fleet.data.client as client_mod\n"
        'cmd = [sys.executable, "-m", "rlfleet.cli.main", "serve", "--config", "fleet.yaml"]\n'
        'monkeypatch.setattr("rlfleet.fleet.cluster.ray_door.init_local", f)\n'
        'raise ValueError("fleet.sync_weights: no answer")\n'
    )
    assert refused == []
    assert namespace.rewrite(out, ".py", modules) == (out, [])  # a second run changes nothing
    _, refused = namespace.rewrite("import fleet.control.controller\n", ".py", modules)
    assert refused and "fleet.control.controller" in refused[0]
    md, _ = namespace.rewrite("`fleet.status()` and `fleet.api.Fleet`\n", ".md", modules)
    assert md == "`fleet.status()` and `rlfleet.fleet.api.Fleet`\n"


def test_no_tracked_file_uses_the_old_top_level_names(capsys):
    past_moves = REPO / "docs" / "layout.md"  # its table of the moves before this one keeps their names
    here = Path(__file__).resolve()  # its own examples of the old names
    files = [p for p in _tracked("*.py", "*.md") if p not in (NAMESPACE, past_moves, here)]
    assert len(files) > 200
    assert namespace.main(["--check", *map(str, files)]) == 0, capsys.readouterr().err


def test_importing_rlfleet_loads_neither_ray_nor_vllm():
    code = "import sys, rlfleet; print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'vllm', 'torch'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_checkout_on_pythonpath_serves_its_own_folders_under_rlfleet(tmp_path):
    """A worktree beside the installed checkout: its rlfleet.fleet is its own fleet/, not the install's."""
    (tmp_path / "rlfleet").mkdir()
    shutil.copy(REPO / "rlfleet" / "__init__.py", tmp_path / "rlfleet" / "__init__.py")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "__init__.py").write_text("")
    (tmp_path / "fleet" / "only_here.py").write_text("WHERE = 'the worktree'\n")
    code = "import rlfleet.fleet.only_here as m, rlfleet.fleet as f; print(m.WHERE, f.__file__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["the", "worktree", str(tmp_path / "fleet" / "__init__.py")]
