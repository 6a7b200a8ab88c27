"""The ``rlfleet`` command line: build models, the smoke check, and the demo, faults and slurm subcommands.

Each subcommand is a small function; errors a user can fix (bad config, missing
model) print one clear line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable

from rlfleet.fleet.errors import RlfleetError
from rlfleet.recipe.tinymodel import PRESETS


def _cmd_model_build(args: argparse.Namespace) -> int:
    from rlfleet.recipe.tinymodel import build_model, default_model_dir, digest

    try:
        path = build_model(args.dir or default_model_dir(args.preset), preset=args.preset, seed=args.seed, force=args.force)
    except OSError as exc:
        from rlfleet.fleet.errors import ConfigError

        raise ConfigError("dir", f"cannot build the model there: {exc.strerror or exc}", args.dir) from None
    print(json.dumps({"model_dir": str(path), "preset": args.preset, "seed": args.seed, "sha256": digest(path)}))
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    from rlfleet.cli.smoke import run_smoke

    summary = run_smoke(engines=args.engines, model=args.model)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="build local models").add_subparsers(dest="model_command", required=True)
    build = model.add_parser("build", help="build a deterministic Llama model + tokenizer into DIR")
    build.add_argument("dir", nargs="?", help="output directory (default: the model cache)")
    build.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    build.set_defaults(func=_cmd_model_build)

    smoke = sub.add_parser("smoke", help="start a local Ray and engine shards; generate, pause, resume; print a summary")
    smoke.add_argument("--engines", type=int, default=2)
    smoke.add_argument("--model", default=None, help="model directory (default: the tiny model, built if missing)")
    smoke.set_defaults(func=_cmd_smoke)

    for module in SUBCOMMAND_MODULES:
        _register(sub, module)
    return parser


SUBCOMMAND_MODULES = ("rlfleet.cli.demo", "rlfleet.cli.faults", "rlfleet.cli.slurm", "rlfleet.cli.fleet", "rlfleet.cli.serve")


def _register(sub, module: str) -> None:
    """Register a subcommand module. A module that fails to import still gets its command,
    which then says why it cannot run (a broken import must never make a command vanish).
    The broken command takes any arguments (``main`` passes them through), so
    ``rlfleet demo --engines 3`` names the failed import, not an unknown flag."""
    try:
        importlib.import_module(module).register(sub)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported by the command itself
        name = module.rsplit(".", 1)[-1]
        broken = sub.add_parser(name, help=f"unavailable: {exc}", add_help=False)
        broken.set_defaults(func=_unavailable(name, module, exc), any_args=True)


def _unavailable(name: str, module: str, exc: Exception) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(f"rlfleet {name}: cannot run: importing {module} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "any_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except RlfleetError as exc:
        print(f"rlfleet: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
