"""Rewrite imports of rlfleet's old top-level packages to the ``rlfleet`` namespace.

Until 0.2 rlfleet installed eleven top-level packages (``fleet``, ``refit``, ``health``, ``recipe``, ``demo``,
``faults``, ``serve``, ``sim``, ``cli``, ``rlapi``, ``slurm``). They are now ``rlfleet.fleet``,
``rlfleet.refit``, ...; the folders stay where they are in the repository (pyproject's ``package-dir`` maps
them under ``rlfleet`` in a wheel). This script made that move here, and rewrites a user's code the same way:

    python scripts/rlfleet_namespace.py PATH...           # rewrite in place, print each file changed
    python scripts/rlfleet_namespace.py --check PATH...   # change nothing; exit 1 naming what still uses old names

It rewrites, in ``.py`` files: ``from fleet.x import y`` and ``import fleet.x as y`` (any of the eleven),
``import health`` (to ``from rlfleet import health``), and quoted module paths (``"cli.main"`` for
``python -m``, ``"fleet.cluster.ray_door.init_local"`` for ``monkeypatch.setattr``), recognised only when the
string's first two or more dotted parts name a module that exists, so ``"fleet.yaml"`` stays. In ``.md``
files: import lines and backticked module paths. ``import fleet.x`` with no ``as`` binds ``fleet``, so its
uses must change too: the script refuses it, naming the line, for a person to write ``import rlfleet.fleet.x
as x`` or similar. Single-word strings (``"slurm"`` as a package for ``importlib.resources``) are not
guessed at: ``--check`` cannot see them either.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PACKAGES = ("fleet", "refit", "health", "recipe", "demo", "faults", "serve", "sim", "cli", "rlapi", "slurm")
ALT = "|".join(PACKAGES)
REPO = Path(__file__).resolve().parents[1]

FROM = re.compile(rf"^(\s*)from ({ALT})((?:\.\w+)*) import ", re.M)
IMPORT_AS = re.compile(rf"^(\s*)import ({ALT})((?:\.\w+)*) as ", re.M)
IMPORT_BARE = re.compile(rf"^([ \t]*)import ({ALT})[ \t]*$", re.M)
IMPORT_DOTTED = re.compile(rf"^[ \t]*import ({ALT})\.[\w.]+[ \t]*$", re.M)
QUOTED = re.compile(rf"""(["'])((?:{ALT})(?:\.\w+)+)((?::\w+)?)\1""")
BACKTICKED = re.compile(rf"(`+)((?:{ALT})(?:\.\w+)+)((?:\(\))?)\1")


def known_modules(root: Path = REPO) -> set[str]:
    """Every module and package under the eleven folders, by its old dotted name."""
    found: set[str] = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found.add(".".join(parts))
    return found


def _is_module_path(dotted: str, modules: set[str]) -> bool:
    """Whether ``dotted``'s first two or more parts name a module (the rest may be attributes)."""
    parts = dotted.split(".")
    return any(".".join(parts[:n]) in modules for n in range(len(parts), 1, -1))


def rewrite(text: str, suffix: str, modules: set[str]) -> tuple[str, list[str]]:
    """``text`` with old names rewritten, and what could not be rewritten (one line each)."""
    refused = [f"`{m.group(0).strip()}` binds the old top-level name: rewrite it and its uses by hand"
               for m in IMPORT_DOTTED.finditer(text)]  # fmt: skip
    text = FROM.sub(r"\1from rlfleet.\2\3 import ", text)
    text = IMPORT_AS.sub(r"\1import rlfleet.\2\3 as ", text)
    if suffix == ".py":
        text = IMPORT_BARE.sub(r"\1from rlfleet import \2", text)
        text = QUOTED.sub(lambda m: f"{m[1]}rlfleet.{m[2]}{m[3]}{m[1]}" if _is_module_path(m[2], modules) else m[0], text)
    elif suffix == ".md":
        text = BACKTICKED.sub(lambda m: f"{m[1]}rlfleet.{m[2]}{m[3]}{m[1]}" if _is_module_path(m[2], modules) else m[0],
                              text)  # fmt: skip
    return text, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="files, or folders to search for .py and .md files")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any file uses old names")
    args = parser.parse_args(argv)
    modules = known_modules()
    files = [f for p in args.paths for f in ([p] if p.is_file() else sorted(p.rglob("*")))
             if f.suffix in (".py", ".md") and ".venv" not in f.parts]  # fmt: skip
    stale, refused_any = 0, False
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue  # its own examples
        old = path.read_text()
        new, refused = rewrite(old, path.suffix, modules)
        for line in refused:
            print(f"{path}: {line}", file=sys.stderr)
        refused_any = refused_any or bool(refused)
        if new == old:
            continue
        stale += 1
        if args.check:
            print(f"{path}: uses the old top-level names", file=sys.stderr)
        else:
            path.write_text(new)
            print(f"rewrote {path}")
    return 2 if refused_any else (1 if args.check and stale else 0)

if __name__ == "__main__":
    sys.exit(main())
