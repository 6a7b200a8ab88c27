"""`rlfleet`'s subcommands: every one is registered, and one whose module fails to import
still appears and says why it cannot run (exit 2), whatever arguments it is given.

No Ray: registering a subcommand imports its module, never Ray or an engine.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from cli import main as cli_main

COMMANDS = {"demo", "faults", "slurm", "smoke", "model", "fleet"}


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_subcommand_is_registered_and_importable():
    commands = _commands(cli_main.build_parser())
    assert COMMANDS <= set(commands)
    broken = {name for name, p in commands.items() if p.get_default("any_args")}
    assert not broken, f"subcommands whose module failed to import: {sorted(broken)}"


@pytest.fixture
def demo_import_fails(monkeypatch):
    # None in sys.modules makes `import cli.demo` raise ModuleNotFoundError, like a missing dependency.
    monkeypatch.setitem(sys.modules, "cli.demo", None)


@pytest.mark.parametrize("args", [[], ["--engines", "3"], ["-h"], ["--", "x"]])
def test_command_whose_import_fails_says_so_and_exits_2(demo_import_fails, capsys, args):
    assert cli_main.main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert "rlfleet demo: cannot run: importing cli.demo failed: ModuleNotFoundError" in err


def test_a_broken_import_leaves_the_other_commands_working(demo_import_fails):
    commands = _commands(cli_main.build_parser())
    assert COMMANDS <= set(commands)
    assert {name for name, p in commands.items() if p.get_default("any_args")} == {"demo"}


def test_unknown_flags_of_a_working_command_are_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["model", "build", "--bogus"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_smoke_with_no_engines_is_refused_naming_the_field(capsys):
    from cli.main import main

    assert main(["smoke", "--engines", "0"]) == 2  # refused before Ray or any engine starts
    assert "invalid config engines" in capsys.readouterr().err
