"""The Slurm launcher against a real Slurm: slurmctld, two slurmd and munge on this machine.

A module fixture brings the local cluster up once (slurm/localcluster.sh, which
installs Debian's packages when missing) and down at the end, even on failure. Jobs
go through the real CLI (``python -m cli.slurm submit``) and ``sbatch``.

What each test proves:
- a failing driver: the job's exit code is the driver's code;
- a worker whose Ray dies, under ``--on-node-loss fail``: the job ends early with that
  step's non-zero code;
- a head whose Ray dies: the job ends with the head's code even under ``continue``;
- a worker node lost mid-training (every process of it SIGKILLed, Slurm marks it DOWN),
  under the default ``continue``: the fleet finds the lost shards dead in one decision,
  drops them in one membership epoch step, keeps serving and refitting on the head's
  shard, loses no request, and the job exits 0; before the loss its first refit reached the
  engines on both nodes intact (their samples' logprobs match the trainer's), and the launcher
  left its environment, one log file per step and its exit line (this job is also the two-node
  fleet job: a separate one cost a minute of engine starts);
- scancel mid-run: no process of the job remains, including daemonized children that
  escaped their parents (which a plain process-tree cleanup leaks);
- two jobs at once on the same nodes: disjoint ports, both succeed;
- (bonus) each node in its own network namespace: distinct node IPs, shards on both.

Needs root (slurmd, munge, namespaces). Leak checks look only for this job's
processes (its Ray temp dir, its SLURM_JOB_ID, its ports), never a global `pgrep ray`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rlfleet.fleet.records import Health

import psutil  # noqa: E402 - installed with ray[default]

REPO = Path(__file__).resolve().parents[2]
LOCALCLUSTER = REPO / "slurm" / "localcluster.sh"
FLEET_CHECK = REPO / "slurm" / "examples" / "fleet_check.py"
NODE_LOSS = REPO / "slurm" / "examples" / "node_loss.py"
RAY_PROBE = REPO / "slurm" / "examples" / "ray_probe.py"
PY = sys.executable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="a local Slurm needs Linux and root"),
    pytest.mark.skipif(
        shutil.which("slurmctld") is None and shutil.which("apt-get") is None,
        reason="no Slurm and no apt-get to install it",
    ),
]


# -- the local cluster and its jobs ------------------------------------------------------
@dataclass
class LocalSlurm:
    scratch: Path
    ctld_port: int
    first_job_id: int = 1
    netns: bool = False
    nodes: int = 2

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RLFLEET_SLURM_DIR=str(self.scratch),
            RLFLEET_SLURMCTLD_PORT=str(self.ctld_port),
            RLFLEET_SLURM_FIRST_JOB_ID=str(self.first_job_id),
            SLURM_CONF=str(self.scratch / "slurm.conf"),
            PATH=f"{Path(PY).parent}:{env.get('PATH', '')}",
        )
        env.pop("RLFLEET_RAY_TMP", None)
        return env

    def up(self) -> None:
        cmd = [str(LOCALCLUSTER), "up", "--nodes", str(self.nodes)] + (["--netns"] if self.netns else [])
        subprocess.run(cmd, env=self.env(), check=True, timeout=600)

    def down(self) -> None:
        subprocess.run([str(LOCALCLUSTER), "down"], env=self.env(), check=False, timeout=120)

    def submit_argv(self, log_root: Path, driver: list[str], wait: bool, launcher: tuple[str, ...] = ()) -> list[str]:
        return [
            PY, "-m", "rlfleet.cli.slurm", "submit", "--nodes", str(self.nodes), "--cpus-per-node", "2",
            "--time", "00:10:00", "--log-root", str(log_root), "--python", PY, "--ready-timeout", "150",
            *(["--wait"] if wait else []), *launcher, "--", PY, *driver,
        ]  # fmt: skip

    def run_job(self, log_root: Path, driver: list[str], timeout: float = 300, launcher: tuple[str, ...] = ()) -> int:
        """Submit through the CLI with --wait (``launcher``: more submit flags); returns the job's exit code."""
        log_root.mkdir(parents=True, exist_ok=True)
        argv = self.submit_argv(log_root, driver, True, launcher)
        return subprocess.run(argv, cwd=log_root, env=self.env(), timeout=timeout).returncode

    def start_job(self, log_root: Path, driver: list[str]) -> int:
        """Submit through the CLI without waiting; returns the job id."""
        log_root.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            self.submit_argv(log_root, driver, False), cwd=log_root, env=self.env(),
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return int(out.stdout.strip().split(";")[0])

    def next_job_id(self) -> int:
        out = subprocess.run(["scontrol", "show", "config"], env=self.env(), capture_output=True, text=True, check=True)
        return int(re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", out.stdout).group(1))

    def job_listed(self, job_id: int) -> bool:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%i"], env=self.env(), capture_output=True, text=True)
        return str(job_id) in out.stdout.split()

    def scontrol(self, *args: str) -> str:
        return subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True, check=True).stdout

    def node_state(self, node: str) -> str:
        """Slurm's state of ``node``: idle, allocated, down, down* (not responding)..."""
        out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], env=self.env(), capture_output=True, text=True)
        return out.stdout.strip()

    def slurmd_pid(self, node: str) -> int | None:
        """The PID of ``node``'s slurmd, if it runs (as localcluster.sh recorded it)."""
        try:
            pid = int((self.scratch / "pids" / f"slurmd-{node}").read_text().split()[0])
            argv = psutil.Process(pid).cmdline()
            ours = os.path.basename(argv[0]) == "slurmd" and argv[argv.index("-N") + 1] == node
        except (OSError, ValueError, IndexError, psutil.Error):
            return None
        return pid if ours and _alive(pid) else None

    def restart_node(self, node: str) -> None:
        """Bring a killed node back (its slurmd, resumed if DOWN) and wait until it is idle again."""
        if self.slurmd_pid(node) is None:
            subprocess.run([str(LOCALCLUSTER), "restart-node", node], env=self.env(), check=True, timeout=120)
        wait_for(lambda: self.node_state(node) == "idle", 120, f"node {node} idle again (state {self.node_state(node)!r})")


@dataclass
class JobLogs:
    folder: Path

    @classmethod
    def only_one(cls, log_root: Path) -> "JobLogs":
        found = sorted(log_root.glob("*-logs"))
        assert len(found) == 1, f"expected one <jobid>-logs folder under {log_root}, found {found}"
        return cls(found[0])

    @property
    def job_id(self) -> int:
        return int(self.folder.name.split("-")[0])

    def text(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace") if path.exists() else ""

    def env(self) -> dict[str, str]:
        out = {}
        for line in self.text("launcher.env").splitlines():
            key, _, value = line.partition("=")
            out[key] = value.strip('"')
        return out

    def port_ranges(self, fixed_only: bool = False) -> list[range]:
        """The port ranges the launcher gave this job, all nodes: fixed blocks, and unless
        ``fixed_only`` the Ray worker-port windows."""
        ranges = []
        for key, value in self.env().items():
            if key.startswith("RLFLEET_NODE_"):
                for kind, lo, hi in re.findall(r"(\w*ports)=(\d+)-(\d+)", value):
                    if kind == "ports" or not fixed_only:
                        ranges.append(range(int(lo), int(hi) + 1))
        return ranges

    def marker(self, tag: str) -> dict:
        for line in self.text("driver.log").splitlines():
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1 :])
        raise AssertionError(f"no {tag} line in {self.folder}/driver.log:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        parts = []
        for f in sorted(self.folder.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"== {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def job_processes(logs: JobLogs) -> list[str]:
    """Processes that belong to this job: its Ray temp dir in the command line, its SLURM_JOB_ID
    in the environment, or a listening socket on one of its fixed ports (the launcher picks a
    block nobody listened on at start). Never anyone else's Ray: worker-port windows are not
    used here, since other Ray instances on a shared host pick worker ports in 10002-19999 too."""
    temp_root = logs.env()["RLFLEET_RAY_TMP_ROOT"]
    marker = f"SLURM_JOB_ID={logs.job_id}"
    ranges = logs.port_ranges(fixed_only=True)
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if temp_root + "/" in cmd or cmd.endswith(temp_root):
                found[proc.pid] = f"{proc.pid} (Ray temp dir) {cmd[:120]}"
                continue
            if proc.environ().get("SLURM_JOB_ID") == str(logs.job_id):
                found[proc.pid] = f"{proc.pid} ({marker}) {cmd[:120]}"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid and any(conn.laddr.port in r for r in ranges):
            found.setdefault(conn.pid, f"{conn.pid} (listens on {conn.laddr.port} of this job)")
    return sorted(found.values())


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def assert_nothing_left(logs: JobLogs, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    left = job_processes(logs)
    while left and time.monotonic() < deadline:
        time.sleep(0.3)
        left = job_processes(logs)
    assert not left, f"job {logs.job_id} left processes behind:\n" + "\n".join(left)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _socket_inodes(pid: int, prefix: str) -> set[str]:
    """Inodes of the unix sockets whose path starts with ``prefix``, as ``pid``'s network namespace lists them."""
    inodes = set()
    try:
        with open(f"/proc/{pid}/net/unix") as f:
            for line in list(f)[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith(prefix):
                    inodes.add(f"socket:[{parts[6]}]")
        return inodes
    except OSError:
        return set()


def _holds_socket(pid: int, prefix: str) -> bool:
    inodes = _socket_inodes(pid, prefix)
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def node_processes(cluster: LocalSlurm, node: str, logs: JobLogs) -> dict[int, str]:
    """Every process of emulated node ``node`` that is the job's there, and the node's slurmd: pid -> what.

    Found by what marks them, never by a program name alone: the slurmd localcluster.sh recorded
    for ``node``; each slurmstepd of the job's steps there (it holds the step's socket in the
    node's own spool folder, ``<spool>/<node>/<node>_<job>.<step>``) and every process below it
    (the step's supervisor, ``ray start``, the raylet, Ray's agents and workers, vLLM's engine-core
    children); any process with the job's id and the node's name in its environment, or the
    node's Ray temp dir on its command line (one that left the tree).
    """
    found: dict[int, str] = {}
    slurmd = cluster.slurmd_pid(node)
    if slurmd:
        found[slurmd] = f"slurmd -N {node}"
    sockets = f"{cluster.scratch}/spool/{node}/{node}_{logs.job_id}."
    ray_tmp = f"{logs.env()['RLFLEET_RAY_TMP_ROOT']}/{node}"
    stepds = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if not _alive(proc.pid) or proc.pid == os.getpid():
                continue
            if cmd.startswith("slurmstepd:") and f"[{logs.job_id}." in cmd and _holds_socket(proc.pid, sockets):
                stepds.append(proc)
                found[proc.pid] = cmd
            elif ray_tmp + "/" in cmd or cmd.endswith(ray_tmp):
                found[proc.pid] = cmd[:100]
            elif (env := proc.environ()).get("SLURM_JOB_ID") == str(logs.job_id) and env.get("SLURMD_NODENAME") == node:
                found[proc.pid] = cmd[:100]
        except psutil.Error:
            continue
    for stepd in stepds:
        try:
            found.update({c.pid: " ".join(c.cmdline())[:100] for c in stepd.children(recursive=True) if _alive(c.pid)})
        except psutil.Error:
            continue
    return found


def kill_node(cluster: LocalSlurm, node: str, logs: JobLogs) -> list[str]:
    """SIGKILL every process ``node_processes`` finds, as a power cut would: each is stopped first
    (SIGSTOP, so none reacts to another's death or starts a new one), the search repeats until it
    finds nothing new, then all are killed at once. Returns what was killed, one line each."""
    stopped: dict[int, str] = {}
    for _ in range(10):
        fresh = {pid: what for pid, what in node_processes(cluster, node, logs).items() if pid not in stopped}
        if not fresh:
            break
        for pid in fresh:
            _signal(pid, signal.SIGSTOP)
        stopped.update(fresh)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    wait_for(lambda: not any(_alive(pid) for pid in stopped), 15, f"the killed processes of {node} to be gone")
    return [f"{pid} {what}" for pid, what in sorted(stopped.items())]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- fixtures ----------------------------------------------------------------------------
def _bring_up(cluster: LocalSlurm):
    cluster.down()  # an aborted earlier run: `down` stops only what that `up` recorded
    try:
        t0 = time.monotonic()
        cluster.up()
        print(f"local Slurm up in {time.monotonic() - t0:.1f} s ({cluster.scratch})")
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from _bring_up(LocalSlurm(scratch=Path("/tmp/rlfleet-slurm-pytest"), ctld_port=6947, first_job_id=1000))


@pytest.fixture(scope="module")
def slurm_netns_cluster():
    yield from _bring_up(LocalSlurm(scratch=Path("/tmp/rlfleet-slurm-pytest-ns"), ctld_port=6957, first_job_id=1050, netns=True))


# -- tests -------------------------------------------------------------------------------
def _assert_fleet_summary(logs: JobLogs, distinct_ips: bool) -> dict:
    summary = logs.marker("RLFLEET_FLEET_CHECK")
    node_ids = [n["node_id"] for n in summary["nodes"]]
    assert len(node_ids) == 2 and len(set(node_ids)) == 2, summary["nodes"]
    shard_nodes = [s["node_id"] for s in summary["shards"]]
    assert sorted(shard_nodes) == sorted(node_ids), f"shards not one per node: {shard_nodes} vs {node_ids}"
    assert [(s["tokens_before"], s["tokens_after"]) for s in summary["shards"]] == [(8, 8), (8, 8)]
    assert summary["refit"]["paused"] == 2 and summary["refit"]["resumed"] == 2
    assert summary["refit"]["kind"] == "weights" and summary["refit"]["complete"] == 2
    assert summary["refit"]["bytes_sent"] > 0 and summary["refit"]["logprob_gap"] < 1e-4
    ips = [n["ip"] for n in summary["nodes"]]
    if distinct_ips:
        assert len(set(ips)) == 2, f"nodes share an IP: {ips}"
    return summary


def test_worker_whose_ray_dies_ends_the_job_with_that_steps_code(slurm_cluster, tmp_path):
    """Under ``--on-node-loss fail`` (the default ``continue`` leaves a lost worker to the driver)."""
    driver = [str(RAY_PROBE), "--nodes", "2", "--kill-worker-raylet"]
    # bounded: a job that ran on after its worker died would pass 110 s (TimeoutExpired)
    rc = slurm_cluster.run_job(tmp_path, driver, timeout=110, launcher=("--on-node-loss", "fail"))
    logs = JobLogs.only_one(tmp_path)
    launcher = logs.text("launcher.log")
    m = re.search(r"step worker-n2 ended early \(code (\d+)\)", launcher)
    assert m, logs.tail()
    assert rc != 0 and rc == (int(m.group(1)) or 1), (rc, launcher)
    assert logs.env()["RLFLEET_ON_NODE_LOSS"] == "fail"
    assert "#SBATCH --no-kill" not in logs.text("job.sbatch").splitlines()
    assert "did not stop the job" not in logs.text("driver.log")
    assert_nothing_left(logs)


def test_head_whose_ray_dies_ends_the_job_even_when_node_loss_is_tolerated(slurm_cluster, tmp_path):
    """Under the default ``--on-node-loss continue``: without its head there is no Ray cluster."""
    rc = slurm_cluster.run_job(tmp_path, [str(RAY_PROBE), "--nodes", "2", "--kill-head-gcs"])
    logs = JobLogs.only_one(tmp_path)
    launcher = logs.text("launcher.log")
    m = re.search(r"step head ended early \(code (\d+)\)", launcher)
    assert m, logs.tail()
    assert rc != 0 and rc == (int(m.group(1)) or 1), (rc, launcher)
    assert logs.env()["RLFLEET_ON_NODE_LOSS"] == "continue"
    assert "killed the head's GCS server" in logs.text("driver.log")
    assert "did not stop the job" not in logs.text("driver.log")
    assert_nothing_left(logs)


def test_cancel_mid_run_leaves_no_process_behind(slurm_cluster, tmp_path):
    """Also: a port block with a port already listening is skipped (here one the test holds)."""
    expected_block = slurm_cluster.next_job_id() % 100
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("0.0.0.0", 7000 + expected_block * 30 + 3))
    squatter.listen()
    try:
        job = slurm_cluster.start_job(tmp_path, [str(RAY_PROBE), "--nodes", "2", "--spawn-orphans", "--hold", "300"])
        logs = JobLogs(tmp_path / f"{job}-logs")
        wait_for(lambda: "RLFLEET_NODE_n2" in logs.text("launcher.env"), 120, f"job {job} port choice")
        assert job % 100 == expected_block
    finally:
        squatter.close()
    assert f"port block {expected_block} has ports in use" in logs.text("launcher.log")
    assert all(7000 + expected_block * 30 + 3 not in r for r in logs.port_ranges()), logs.env()
    try:
        wait_for(lambda: "RLFLEET_PROBE" in logs.text("driver.log"), 180, f"job {job} driver report")
        report = logs.marker("RLFLEET_PROBE")
        pids = [report["driver_pid"]] + [a["pid"] for a in report["actors"]] + [a["orphan_pid"] for a in report["actors"]]
        assert all(psutil.pid_exists(p) for p in pids), pids
        before = job_processes(logs)
        # The check must see the job while it runs: Ray daemons by temp dir, workers by env or port.
        assert len(before) >= 8, before
        orphan_parents = {psutil.Process(a["orphan_pid"]).ppid() for a in report["actors"]}
        assert 1 not in orphan_parents, "a daemonized child escaped to init while the job ran"
    finally:
        subprocess.run(["scancel", str(job)], env=slurm_cluster.env(), check=False)
    wait_for(lambda: not slurm_cluster.job_listed(job), 60, f"job {job} to leave the queue")
    assert_nothing_left(logs)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes of cancelled job {job} still alive: {alive}"
    assert "stopped; no process of this step is left" in logs.text("head-n1.log")


def test_two_jobs_at_once_on_the_same_nodes_use_disjoint_ports_and_keep_their_exit_codes(slurm_cluster, tmp_path):
    """Job a's driver succeeds, job b's driver fails with 7: each job ends with its own driver's code."""
    rdv = tmp_path / "rendezvous"
    roots = [tmp_path / "a", tmp_path / "b"]
    driver = [str(RAY_PROBE), "--nodes", "2", "--rendezvous", str(rdv), "--peers", "2"]
    for root in roots:
        root.mkdir()
    procs = [
        subprocess.Popen(slurm_cluster.submit_argv(root, driver + extra, True), cwd=root, env=slurm_cluster.env())
        for root, extra in zip(roots, ([], ["--exit-code", "7"]))
    ]
    rcs = [p.wait(timeout=300) for p in procs]
    logs = [JobLogs.only_one(root) for root in roots]
    assert rcs == [0, 7], "\n".join(lg.tail() for lg in logs)
    assert "driver exited with code 7" in logs[1].text("launcher.log")
    assert f"job {logs[1].job_id} exits with code 7" in logs[1].text("launcher.log")
    reports = [lg.marker("RLFLEET_PROBE") for lg in logs]
    assert reports[0]["peers"] == reports[1]["peers"] == sorted(str(lg.job_id) for lg in logs)  # ran at the same time
    envs = [lg.env() for lg in logs]
    assert envs[0]["RLFLEET_NODES"] == envs[1]["RLFLEET_NODES"] == "n1 n2"  # the same nodes
    assert envs[0]["RAY_ADDRESS"] != envs[1]["RAY_ADDRESS"]
    ports = [set().union(*lg.port_ranges()) for lg in logs]
    assert all(len(p) > 0 and max(p) <= 19999 for p in ports)
    assert not ports[0] & ports[1], f"jobs share ports: {sorted(ports[0] & ports[1])[:10]}"
    fixed = [{p for r in lg.port_ranges() if len(r) == 10 for p in r} for lg in logs]
    assert all(max(f) < 10002 for f in fixed), "fixed ports must stay below Ray's worker range"
    node_ids = [{n["node_id"] for n in r["nodes"]} for r in reports]
    assert not node_ids[0] & node_ids[1], "the two jobs joined one Ray cluster"
    for lg in logs:
        assert_nothing_left(lg)


# Ray's GCS declares a silent node dead after 12 missed health checks 1 s apart (Ray's default: 5 x 3 s,
# each allowed 10 s). That is after the shards' own probes (3, 1 s apart) have found them dead, as under
# Ray's defaults on a real cluster, and soon enough that the test waits seconds, not half a minute. (The
# other order, the cluster's verdict first, is tests/unit/test_node_loss.py's.) The names are those Ray
# 2.60's GCS reads from its environment (RAY_<config name>); the launcher passes RAY_* on to every step.
NODE_DEATH_AFTER_PROBES = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "5000",
    "RAY_health_check_failure_threshold": "12",
}


def _end_job(cluster: LocalSlurm, root: Path, submitter: subprocess.Popen) -> None:
    """A test that failed half way: cancel its job (if it got one) and its ``sbatch --wait``."""
    if submitter.poll() is not None:
        return
    for folder in root.glob("*-logs"):
        subprocess.run(["scancel", folder.name.split("-")[0]], env=cluster.env(), check=False)
    try:
        submitter.wait(timeout=60)
    except subprocess.TimeoutExpired:
        submitter.kill()


def test_job_that_loses_a_worker_node_trains_on_and_exits_zero(slurm_cluster, tiny_model, tmp_path):
    """Every process of node n2 SIGKILLed between two training steps, then n2 marked DOWN.

    The driver (slurm/examples/node_loss.py) runs a fleet of three vLLM-CPU engines: one on the
    head (with the controller and the trainer), two on n2; quorum is one. After step 2 it says it
    is ready and keeps requests flowing; the test kills n2 (its slurmd, the job's slurmstepd there
    and everything below it: the raylet, Ray's workers, the two shards and their engine cores),
    marks n2 DOWN as slurmctld would after SlurmdTimeout (300 s by default), and tells the driver
    to go on. What must hold: Slurm keeps the job (``--no-kill``: it removes n2 from it) and the
    launcher lets it run; the fleet finds both lost shards dead (by their own probes, before Ray's
    verdict on the node), records the node's loss naming both when the verdict comes, and drops them
    in one membership epoch step; it kept serving through the loss and trains on on the head's shard;
    no request is lost; the lost slots wait to be placed again (restarting) instead of failing;
    the job exits 0 and nothing of it is left running.
    """
    root, scratch = tmp_path / "job", tmp_path / "scratch"
    root.mkdir()
    steps, lose_after = 4, 2
    driver = [str(NODE_LOSS), "--scratch", str(scratch), "--model-dir", tiny_model,
              "--steps", str(steps), "--lose-after", str(lose_after)]  # fmt: skip
    env = {**slurm_cluster.env(), **NODE_DEATH_AFTER_PROBES}
    submitter = subprocess.Popen(slurm_cluster.submit_argv(root, driver, True), cwd=root, env=env)
    killed, logs = [], None
    try:
        wait_for(lambda: (scratch / "ready.json").exists() or submitter.poll() is not None, 420, "the driver's ready.json")
        logs = JobLogs.only_one(root)
        assert submitter.poll() is None, f"the job ended before it lost a node:\n{logs.tail()}"
        killed = kill_node(slurm_cluster, "n2", logs)
        left = node_processes(slurm_cluster, "n2", logs)
        assert not left, f"processes of n2 survived the kill: {left}"
        slurm_cluster.scontrol("update", "NodeName=n2", "State=DOWN", "Reason=rlfleet node-loss test")
        (scratch / "go").write_text("\n".join(killed) + "\n")
        rc = submitter.wait(timeout=300)
    finally:
        _end_job(slurm_cluster, root, submitter)
        slurm_cluster.restart_node("n2")
        if logs is not None:  # n2's Ray temp dir: its step never got to remove it
            shutil.rmtree(logs.env().get("RLFLEET_RAY_TMP_ROOT", "/nonexistent"), ignore_errors=True)
    assert rc == 0, logs.tail()
    report = logs.marker("RLFLEET_NODE_LOSS")
    assert report["failures"] == [], report["failures"]

    # the launcher's two-node job: its environment, one log per step, the head's readiness, the exit line
    env = logs.env()
    assert env["RLFLEET_NODES"] == "n1 n2" and env["RAY_AUTH_MODE"] == "disabled", env
    assert 1024 < int(env["RAY_ADDRESS"].rsplit(":", 1)[1]) < 10002, env["RAY_ADDRESS"]
    for name in ("launcher.log", "head-n1.log", "worker-n2.log", "driver.log", "launcher.env", "job.sbatch"):
        assert (logs.folder / name).is_file(), f"{name} missing from {logs.folder}"
    assert "RLFLEET_READY" in logs.text("head-n1.log")

    # before the loss, the first update reached the engines on both nodes intact (logprobs against the trainer's)
    assert report["nodes"]["head"]["node_id"] != report["nodes"]["worker"]["node_id"], report["nodes"]
    assert report["weights"]["slots"] == sorted(report["placement"]["head_slots"] + report["placement"]["lost_slots"])
    assert report["weights"]["version"] == 1 and report["weights"]["logprob_gap"] < 1e-4, report["weights"]

    # what died: every process of n2, the two shards and their engine cores among them
    what = "\n".join(killed)
    assert "slurmd -N n2" in what and "slurmstepd: [" in what and "raylet" in what, what
    assert what.count("ray::EngineShard") == 2, what
    where = report["placement"]
    head, lost = where["head_slots"], where["lost_slots"]
    assert where["controller"] == "head" and len(head) == 1 and len(lost) == 2, where

    # Slurm and the launcher: n2 left the job, the job went on
    launcher = logs.text("launcher.log")
    assert "node n2 is lost; the job goes on" in launcher and "node(s) lost while the job ran: n2" in launcher, launcher
    assert f"job {logs.job_id} exits with code 0" in launcher
    assert f"Removing failed node n2 from JobId={logs.job_id}" in (slurm_cluster.scratch / "log" / "slurmctld.log").read_text()

    # the fleet: both lost shards found dead by their own probes (a killed process refuses connections at
    # once), within one detection bound of each other; the cluster's verdict on the node, seconds later,
    # is recorded once, naming both slots as having died before it.
    deaths = [e for e in report["records"]["lost_shards"]
              if Health.matches(e) and e["after"] == "dead" and e["incarnation"] == 1]  # fmt: skip
    assert sorted(e["slot"] for e in deaths) == lost, report["records"]["lost_shards"]
    assert all("failed probe" in e["reason"] for e in deaths), deaths
    assert max(e["t"] for e in deaths) - min(e["t"] for e in deaths) <= report["hang_detection_bound_s"], deaths
    verdict = report["records"]["node_lost"]
    worker = report["nodes"]["worker"]["node_id"]
    assert [(e["node"], e["slots"], e["died_before"]) for e in verdict] == [(worker, lost, lost)], verdict
    assert verdict[0]["t"] > max(e["t"] for e in deaths), (verdict, deaths)

    # ... and dropped from membership in one epoch step: the next refit's epoch is the last one's + 1
    runs = report["steps"]
    assert [s["step"] for s in runs] == list(range(1, steps + 1))
    before, after = runs[lose_after - 1]["refit"], runs[lose_after]["refit"]
    assert sorted(before["participants"]) == sorted(head + lost), before
    assert after["epoch"] == before["epoch"] + 1 and after["participants"] == head, (before, after)
    assert [e["epoch"] for e in report["records"]["epochs"] if e["epoch"] > before["epoch"]] == [after["epoch"]]
    assert all(s["refit"]["epoch"] == after["epoch"] for s in runs[lose_after:]), [s["refit"] for s in runs]

    # it kept serving through the loss, and trained on on the head's shard
    assert report["while_losing"]["completed"] > 0, report["while_losing"]
    per_step = report["args"]["prompts"] * report["args"]["samples"]
    for s in runs[lose_after:]:
        assert s["completed"] == per_step and s["served_by"] == head and s["refit"]["complete"] == head, s
    final = report["final"]
    assert final["serving"] == head and final["gate_open"] and final["stopped"] is None, final
    assert final["version"] == steps, final

    # nothing lost: every accepted request completed or was explicitly returned
    req = report["requests"]
    assert req["in_progress"] == 0 and req["accepted"] == req["completed"] + req["returned"], req
    assert report["unaccounted"] == []

    # nothing could place the lost slots again: they wait (restarting), they did not fail
    assert {final["slots"][str(s)]["state"] for s in lost} == {"restarting"}, final["slots"]
    assert_nothing_left(logs)


def test_two_node_job_with_a_network_namespace_per_node(slurm_netns_cluster, tmp_path):
    """Each emulated node has its own IP: Ray sees two hosts, actors land on both, nothing leaks.

    (The full fleet_check job passes here too; CI runs the light probe to stay in budget.
    Set RLFLEET_SLURM_NETNS_FLEET=1 to run fleet_check instead.)
    """
    if os.environ.get("RLFLEET_SLURM_NETNS_FLEET") == "1":
        from rlfleet.recipe.tinymodel import build_model

        model = str(build_model(Path.home() / ".cache" / "rlfleet" / "models" / "tiny"))
        rc = slurm_netns_cluster.run_job(tmp_path, [str(FLEET_CHECK), "--nodes", "2", "--model-dir", model])
        logs = JobLogs.only_one(tmp_path)
        assert rc == 0, logs.tail()
        ips = [n["ip"] for n in _assert_fleet_summary(logs, distinct_ips=True)["nodes"]]
    else:
        rc = slurm_netns_cluster.run_job(tmp_path, [str(RAY_PROBE), "--nodes", "2"])
        logs = JobLogs.only_one(tmp_path)
        assert rc == 0, logs.tail()
        report = logs.marker("RLFLEET_PROBE")
        ips = [n["ip"] for n in report["nodes"]]
        assert sorted(a["ip"] for a in report["actors"]) == sorted(ips)
        assert len({a["node_id"] for a in report["actors"]}) == 2
    assert sorted(ips) == ["10.213.0.11", "10.213.0.12"], ips
    assert logs.env()["RAY_ADDRESS"].startswith("10.213.0.11:")
    assert_nothing_left(logs)
