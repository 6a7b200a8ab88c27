"""`rlfleet`'s subcommands: every one is registered, and one whose module fails to import
still appears and says why it cannot run (exit 2), whatever arguments it is given.

No Ray: registering a subcommand imports its module, never Ray or an engine.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from rlfleet.cli import main as cli_main

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
    # None in sys.modules makes `import rlfleet.cli.demo` raise ModuleNotFoundError, like a missing dependency.
    monkeypatch.setitem(sys.modules, "rlfleet.cli.demo", None)


@pytest.mark.parametrize("args", [[], ["--engines", "3"], ["-h"], ["--", "x"]])
def test_command_whose_import_fails_says_so_and_exits_2(demo_import_fails, capsys, args):
    assert cli_main.main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert "rlfleet demo: cannot run: importing rlfleet.cli.demo failed: ModuleNotFoundError" in err


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
    from rlfleet.cli.main import main

    assert main(["smoke", "--engines", "0"]) == 2  # refused before Ray or any engine starts
    assert "invalid config engines" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["fleet", "list"], ["fleet", "status", "f"], ["serve", "--connect", "f"]])
def test_a_command_that_finds_no_ray_cluster_says_so_in_one_line(monkeypatch, capsys, argv):
    """Run where no Ray runs (a new user's first try, a typo in RAY_ADDRESS), these ended in Ray's
    ConnectionError traceback; now one line says no cluster was found where, and how to point at one."""
    import ray

    def no_cluster(*args, **kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert cli_main.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlfleet: error: no running Ray cluster on this machine") and "--address" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_model_directory_that_cannot_be_made_is_refused_naming_it(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_main.main(["model", "build", str(blocker / "m")]) == 2
    err = capsys.readouterr().err
    assert "invalid config dir: cannot build the model there" in err and "a-file" in err, err


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, then released
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv", [["fleet", "stop", "f"], ["fleet", "list"]])
def test_an_address_where_nothing_listens_is_refused_at_once_without_asking_ray(monkeypatch, capsys, argv):
    """``--address HOST:PORT`` with a typo in the port: Ray's client retried it for over a minute;
    now one TCP connect finds nothing there and one line says so, naming the address."""
    import ray

    def never(*args, **kwargs):
        raise AssertionError("ray.init was called for an address nothing listens on")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", never)
    address = f"127.0.0.1:{_closed_port()}"
    assert cli_main.main([*argv, "--address", address]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlfleet: error: no running Ray cluster at {address}: nothing accepts connections there"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_only_a_plain_host_and_port_is_checked_before_ray_is_asked():
    import socket

    from rlfleet.fleet.cluster.ray_door import unreachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert unreachable(f"127.0.0.1:{server.getsockname()[1]}") is None
    assert "Refused" in unreachable(f"127.0.0.1:{_closed_port()}")
    for resolved_by_ray in ("auto", "local", "ray://127.0.0.1:1", "", "127.0.0.1"):
        assert unreachable(resolved_by_ray) is None, resolved_by_ray


@pytest.mark.parametrize("where,flag", [("taken", "--port"), ("99999", "--port"), ("192.0.2.77", "--host")])
def test_serve_refuses_an_address_it_cannot_listen_on_before_any_fleet_or_cluster(monkeypatch, capsys, where, flag):
    """A taken or impossible port, or a host that is not this machine's, was found only once the fleet had
    started (38 s with two engines here), and a port over 65535 ended in a traceback."""
    import socket

    import ray

    def never(*args, **kwargs):
        raise AssertionError("Ray was started for a front that cannot listen")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        host, port = ("127.0.0.1", str(taken.getsockname()[1])) if where == "taken" else \
            ("127.0.0.1", where) if where.isdigit() else (where, "8000")
        assert cli_main.main(["serve", "--connect", "f", "--host", host, "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot listen on {host}:{port}" in err and err.endswith(f"pick another {flag} (got '{host}:{port}')"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("args,flag", [(["--tool-call-parser", "nope"], "--tool-call-parser"),
                                       (["--reasoning-parser", "nope"], "--reasoning-parser"),
                                       (["--enable-auto-tool-choice"], "--enable-auto-tool-choice")])
def test_serve_refuses_a_chat_flag_vllm_would_refuse_before_any_fleet_or_cluster(monkeypatch, capsys, args, flag):
    """A parser vLLM does not know, or auto tool choice with no parser, is refused naming the flag (exit 2),
    before Ray or a fleet starts."""
    import ray

    def never(*a, **kw):
        raise AssertionError("Ray was started for a front with a bad chat flag")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", never)
    assert cli_main.main(["serve", "--connect", "f", "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("timeout,over", [("5", {}), ("64.9", {"refit_timeout_s": 60, "lifecycle_grace_s": 5})])
def test_serve_refuses_a_request_timeout_below_the_refit_budget_before_any_fleet_or_cluster(
        monkeypatch, capsys, tmp_path, model_dir, timeout, over):
    """``--request-timeout 5`` with a 360 s refit budget was taken (the front's config was a ``model_copy`` that
    validated nothing): every HTTP request held across a refit got a 503 while the refit was within its deadline.
    It is refused as the config's own ``request_timeout_s`` is, naming the flag and the field (exit 2), before
    Ray or a fleet starts."""
    import json

    import ray

    def never(*a, **kw):
        raise AssertionError("Ray was started for a front whose request timeout the fleet's config refuses")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", never)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"engine": {"model": model_dir}, **over}))
    assert cli_main.main(["serve", "--config", str(path), "--port", "0", "--request-timeout", timeout]) == 2
    err = capsys.readouterr().err.strip()
    budget = "370 s" if not over else "65 s"
    assert "--request-timeout (request_timeout_s)" in err and "the refit budget" in err and budget in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
