"""``rlfleet slurm submit``: fill the sbatch launcher from flags and submit it.

The launcher lives in the ``rlfleet.slurm`` package (``slurm/`` in a checkout, shipped as
package data in a wheel, read with ``importlib.resources``): ``rlfleet.sbatch.in``
(the shell logic, with an ``#SBATCH`` header block and a settings block) and
``rlfleet_step.py`` (the per-step supervisor, embedded into the script as a heredoc).
``render`` fills both blocks and embeds the supervisor, so the submitted script is
one self-contained file; the committed ``slurm/rlfleet.sbatch`` is
``render_default()`` (a test keeps them equal).

Guarantees: flags are validated before anything is submitted (``SubmitError`` names
the flag); ``--dry-run`` prints the exact script and submits nothing; with ``--wait``
the exit code is the job's own (``sbatch --wait`` propagates it); a launcher file the
install lacks is one line naming it (``LauncherMissing``), exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Sequence

LAUNCHER_PACKAGE = "rlfleet.slurm"
TEMPLATE = "rlfleet.sbatch.in"
STEP_PROGRAM = "rlfleet_step.py"
STEP_MARKER = "# @RLFLEET_STEP_PY@"
HEREDOC_END = "RLFLEET_STEP_PY_END"
DEFAULT_DRIVER = ("rlfleet", "demo")
ON_NODE_LOSS = ("continue", "fail")  # the first is the default

_SETTING = re.compile(r'^: "\$\{(RLFLEET_[A-Z0-9_]+):=(.*)\}"(\s+#.*)?$')


class SubmitError(ValueError):
    """A flag value the launcher cannot use; the message names the flag."""


class LauncherMissing(RuntimeError):
    """The launcher files are not installed; the message names the file."""


@dataclass
class JobSpec:
    """What one submission asks for. Empty / None fields keep the launcher's defaults."""

    nodes: int = 2
    gpus_per_node: int = 0
    cpus_per_node: int = 8
    time: str = "01:00:00"
    job_name: str = "rlfleet"
    output: str = "rlfleet-%j.out"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    exclusive: bool = False
    sbatch_args: list[str] = field(default_factory=list)
    settings: dict[str, str] = field(default_factory=dict)  # RLFLEET_* -> value (fixed in the script)
    driver: list[str] = field(default_factory=lambda: list(DEFAULT_DRIVER))
    # A worker node lost after the cluster came up: "continue" (sbatch --no-kill; the job's exit code stays
    # the driver's) or "fail" (the job ends with that node's step code; Slurm may kill the job itself).
    on_node_loss: str = ON_NODE_LOSS[0]

    def validate(self) -> None:
        if self.nodes < 1:
            raise SubmitError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise SubmitError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_node < 1:
            raise SubmitError(f"--cpus-per-node must be >= 1, got {self.cpus_per_node}")
        if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|\d+", self.time):
            raise SubmitError(f"--time must look like [D-]HH:MM:SS or minutes, got {self.time!r}")
        for arg in self.sbatch_args:
            if not arg.startswith("--") or "\n" in arg:
                raise SubmitError(f"--sbatch-arg takes one long sbatch option like --mem=0, got {arg!r}")
        for key, value in self.settings.items():
            if "\n" in value:
                raise SubmitError(f"{key} must be one line")
        if not self.driver:
            raise SubmitError("the driver command after -- is empty")
        if "RLFLEET_ON_NODE_LOSS" in self.settings:
            raise SubmitError("set the node-loss policy with on_node_loss (--on-node-loss), not settings")
        if self.on_node_loss not in ON_NODE_LOSS:
            raise SubmitError(f"--on-node-loss must be one of {', '.join(ON_NODE_LOSS)}; got {self.on_node_loss!r}")


def header(spec: JobSpec) -> list[str]:
    lines = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={spec.cpus_per_node}",
    ]
    if spec.gpus_per_node:
        lines.append(f"--gpus-per-node={spec.gpus_per_node}")
    lines += [f"--time={spec.time}", f"--output={spec.output}"]
    if spec.on_node_loss == "continue":
        lines.append("--no-kill")  # Slurm removes a failed node from the job instead of killing the job
    for flag, value in (("partition", spec.partition), ("account", spec.account), ("qos", spec.qos)):
        if value:
            lines.append(f"--{flag}={value}")
    if spec.exclusive:
        lines.append("--exclusive")
    lines += spec.sbatch_args
    return [f"#SBATCH {line}" for line in lines]


def _dq(value: str) -> str:
    """Quote for a double-quoted shell word."""
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def _replace_block(text: str, name: str, new_lines: list[str]) -> str:
    start, end = f"# >>> {name}\n", f"# <<< {name}\n"
    i, j = text.index(start), text.index(end)
    return text[: i + len(start)] + "".join(f"{line}\n" for line in new_lines) + text[j:]


def _fill_settings(text: str, spec: JobSpec) -> str:
    start, end = "# >>> settings\n", "# <<< settings\n"
    i, j = text.index(start) + len(start), text.index(end)
    known, out = set(), []
    for line in text[i:j].splitlines():
        m = _SETTING.match(line)
        if m and m.group(1) in spec.settings:
            known.add(m.group(1))
            line = f"{m.group(1)}={_dq(spec.settings[m.group(1)])}   # set by rlfleet slurm submit"
        elif line.startswith("DEFAULT_DRIVER="):
            line = f"DEFAULT_DRIVER=({shlex.join(spec.driver)})"
        else:
            known.update({m.group(1)} if m else set())
        out.append(line)
    unknown = set(spec.settings) - known
    if unknown:
        raise SubmitError(f"unknown launcher settings: {sorted(unknown)}")
    return text[:i] + "".join(f"{line}\n" for line in out) + text[j:]


def _embed_step(text: str, program: str) -> str:
    if HEREDOC_END in program:
        raise SubmitError(f"{STEP_PROGRAM} may not contain the line {HEREDOC_END}")
    block = (
        f"# The per-step supervisor (slurm/{STEP_PROGRAM}), fed to Python on stdin by every srun step.\n"
        f"IFS= read -r -d '' RLFLEET_STEP_PY <<'{HEREDOC_END}' || true\n{program.rstrip()}\n{HEREDOC_END}"
    )
    return text.replace(STEP_MARKER, block, 1)


def _read(name: str, source: Traversable | None) -> str:
    """One launcher file, from ``source`` or the installed ``rlfleet.slurm`` package."""
    try:
        return ((source or resources.files(LAUNCHER_PACKAGE)) / name).read_text()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise LauncherMissing(
            f"launcher file {name} of package {LAUNCHER_PACKAGE} not found ({exc}); reinstall rlfleet, it ships them as package data"
        ) from exc


def render(spec: JobSpec, source: Traversable | None = None) -> str:
    """The complete sbatch script for ``spec``. Raises ``SubmitError`` for bad values.

    ``spec.on_node_loss`` is fixed in the script (``RLFLEET_ON_NODE_LOSS``) and, for ``continue``,
    adds ``#SBATCH --no-kill``: the header and the launcher's policy never disagree.
    """
    spec.validate()
    text = _read(TEMPLATE, source)
    text = _replace_block(text, "sbatch header", header(spec))
    spec = replace(spec, settings={**spec.settings, "RLFLEET_ON_NODE_LOSS": spec.on_node_loss})
    text = _fill_settings(text, spec)
    return _embed_step(text, _read(STEP_PROGRAM, source))


def render_default(source: Traversable | None = None) -> str:
    """The committed ``slurm/rlfleet.sbatch``: the template with its own defaults."""
    return _embed_step(_read(TEMPLATE, source), _read(STEP_PROGRAM, source))


# -- argparse ---------------------------------------------------------------------------
def _add_submit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("allocation")
    g.add_argument("--nodes", "-N", type=int, default=2, help="nodes; the Ray head runs on the first (default 2)")
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node for Ray and Slurm (default 0)")
    g.add_argument("--cpus-per-node", type=int, default=8, help="CPUs per node for Ray and Slurm (default 8)")
    g.add_argument("--time", "-t", default="01:00:00", help="time limit (default 01:00:00)")
    g.add_argument("--job-name", "-J", default="rlfleet")
    g.add_argument("--partition", "-p")
    g.add_argument("--account", "-A")
    g.add_argument("--qos")
    g.add_argument("--exclusive", action="store_true", help="whole nodes")
    g.add_argument("--output", default="rlfleet-%j.out", help="the batch script's own output file")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="--OPT=VAL", help="extra #SBATCH line (repeatable)")
    r = p.add_argument_group("ray and logs")
    r.add_argument("--log-root", help="folder that receives <jobid>-logs/ (default: the submit folder)")
    r.add_argument("--auth", choices=["disabled", "token"], help="Ray authentication mode (launcher default: disabled)")
    r.add_argument("--dashboard", action="store_true", help="start the Ray dashboard on the head (off by default)")
    r.add_argument("--ready-timeout", type=int, metavar="S", help="seconds for the cluster to come up (default 180)")
    r.add_argument("--port-base", type=int, help="first port of the launcher's range (default 7000)")
    r.add_argument("--setup", help="shell code every step runs first, e.g. 'source ~/venv/bin/activate'")
    r.add_argument("--python", help="the Python with Ray (default python3)")
    r.add_argument(
        "--on-node-loss", default=ON_NODE_LOSS[0], metavar="|".join(ON_NODE_LOSS),
        help="a worker node lost after the cluster came up: 'continue' (default; sbatch --no-kill, the job "
        "goes on and ends with the driver's exit code) or 'fail' (the job ends with that node's step code). "
        "A lost head always ends the job",
    )  # fmt: skip
    c = p.add_argument_group("containers (pick one)")
    c.add_argument("--container-image", help="pyxis: srun --container-image for every step")
    c.add_argument("--container-mounts", help="pyxis: srun --container-mounts (the log folder is added)")
    c.add_argument("--apptainer-image", help="apptainer: run every step in `apptainer exec IMAGE`")
    c.add_argument("--apptainer-binds", help="apptainer: extra --bind list (the log folder is added)")
    o = p.add_argument_group("submission")
    o.add_argument("--dry-run", action="store_true", help="print the filled script and the sbatch command; submit nothing")
    o.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends, with its exit code")
    p.add_argument("driver", nargs=argparse.REMAINDER, help="-- then the driver command (default: rlfleet demo)")


def spec_from_args(ns: argparse.Namespace) -> JobSpec:
    driver = list(ns.driver)
    if driver[:1] == ["--"]:
        driver = driver[1:]
    if ns.container_image and ns.apptainer_image:
        raise SubmitError("--container-image (pyxis) and --apptainer-image exclude each other")
    settings = {}
    optional = {
        "RLFLEET_LOG_ROOT": ns.log_root and os.path.abspath(ns.log_root),
        "RLFLEET_AUTH": ns.auth,
        "RLFLEET_DASHBOARD": "1" if ns.dashboard else None,
        "RLFLEET_READY_TIMEOUT_S": None if ns.ready_timeout is None else str(ns.ready_timeout),
        "RLFLEET_PORT_BASE": None if ns.port_base is None else str(ns.port_base),
        "RLFLEET_SETUP": ns.setup,
        "RLFLEET_PYTHON": ns.python,
        "RLFLEET_CONTAINER_IMAGE": ns.container_image,
        "RLFLEET_CONTAINER_MOUNTS": ns.container_mounts,
        "RLFLEET_APPTAINER_IMAGE": ns.apptainer_image,
        "RLFLEET_APPTAINER_BINDS": ns.apptainer_binds,
    }
    settings.update({k: v for k, v in optional.items() if v})
    settings["RLFLEET_GPUS_PER_NODE"] = str(ns.gpus_per_node)
    settings["RLFLEET_CPUS_PER_NODE"] = str(ns.cpus_per_node)
    return JobSpec(
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        cpus_per_node=ns.cpus_per_node,
        time=ns.time,
        job_name=ns.job_name,
        output=ns.output,
        partition=ns.partition,
        account=ns.account,
        qos=ns.qos,
        exclusive=ns.exclusive,
        sbatch_args=list(ns.sbatch_arg),
        settings=settings,
        driver=driver or list(DEFAULT_DRIVER),
        on_node_loss=ns.on_node_loss,
    )


def submit(ns: argparse.Namespace) -> int:
    try:
        script = render(spec_from_args(ns))
    except (SubmitError, LauncherMissing) as exc:
        print(f"rlfleet slurm submit: {exc}", file=sys.stderr)
        return 2
    cmd = ["sbatch", "--wait"] if ns.wait else ["sbatch", "--parsable"]
    if ns.dry_run:
        sys.stdout.write(script)
        print(f"# would run: {shlex.join(cmd)} < <this script>", file=sys.stderr)
        return 0
    if shutil.which("sbatch") is None:
        print("rlfleet slurm submit: sbatch not found on PATH (run on a Slurm login node)", file=sys.stderr)
        return 127
    return subprocess.run(cmd, input=script, text=True).returncode


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``slurm`` (with ``submit``) to an argparse subparsers object; returns the ``slurm`` parser."""
    slurm = subparsers.add_parser("slurm", help="run rlfleet on a Slurm cluster", description=__doc__.split("\n\n")[0])
    sub = slurm.add_subparsers(dest="slurm_command", required=True)
    p = sub.add_parser(
        "submit",
        help="fill the sbatch launcher from flags and submit it",
        description="Launch a Ray cluster over N Slurm nodes and run a driver on its head.",
        epilog="example: rlfleet slurm submit --nodes 2 --gpus-per-node 8 --cpus-per-node 64 -- python -m my_recipe",
    )
    _add_submit_args(p)
    p.set_defaults(func=submit)
    return slurm


def main(argv: Sequence[str] | None = None) -> int:
    """``rlfleet slurm ...`` on its own: ``main(["submit", ...])`` or ``main(["slurm", "submit", ...])``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["slurm"]:
        args.insert(0, "slurm")
    parser = argparse.ArgumentParser(prog="rlfleet")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(args)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
