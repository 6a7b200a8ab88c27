"""Supervisor of one launcher step on one node: a Ray head, a Ray worker, or the driver.

The sbatch launcher (slurm/rlfleet.sbatch, which embeds this file verbatim) runs one
copy per step through ``srun``, feeding this program on stdin:

    python - head   NODE_IP PORT_BASE MIN_WORKER_PORT MAX_WORKER_PORT
    python - worker NODE_IP PORT_BASE MIN_WORKER_PORT MAX_WORKER_PORT
    python - driver -- COMMAND ...

Standard library only: it runs wherever Ray's Python runs (host or container).
Settings come from RLFLEET_* environment variables the launcher exports.

Guarantees:
- The supervisor is a child subreaper (prctl), so every process it starts, even one
  that daemonizes or whose parent dies first, stays its descendant. On SIGTERM,
  SIGINT, SIGHUP or SIGUSR1 (srun forwards SIGUSR1; scancel sends SIGTERM), and
  whenever its main child ends, it stops its descendants by PID: SIGTERM, then after
  RLFLEET_STOP_GRACE_S seconds SIGKILL. It never runs ``ray stop`` and never signals
  a process that is not its descendant.
- Ports are checked free before Ray starts; a taken port ends the step with exit
  code 98 naming the port, instead of a Ray failure deep in a log.
- The head prints ``RLFLEET_READY <ip> <gcs_port>`` only after its GCS port accepts
  TCP connections and ``ray health-check`` passes, both polled within
  RLFLEET_READY_TIMEOUT_S. The driver step first waits (polling, same deadline) until
  RLFLEET_EXPECTED_NODES Ray nodes are alive, then runs the command.
- Exit code: the driver's own code (128+N if killed by signal N); for a Ray node that
  ended on its own, Ray's code (1 if Ray exited 0 unasked); 0 when stopped on request;
  98 port taken, 124 readiness deadline passed, 64 bad usage.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

EXIT_USAGE, EXIT_PORT_TAKEN, EXIT_NOT_READY = 64, 98, 124
PR_SET_CHILD_SUBREAPER = 36

# Offsets inside a node's block of ten ports (the launcher allots the block).
PORT_OFFSETS = {
    "node_manager": 0,
    "object_manager": 1,
    "runtime_env_agent": 2,
    "dashboard_agent_grpc": 3,
    "dashboard_agent_listen": 4,
    "metrics_export": 5,
    "gcs": 6,  # head only
    "ray_client_server": 7,  # head only
    "dashboard": 8,  # head only: Ray's API server always runs (localhost-only unless the dashboard is on)
}
HEAD_ONLY = ("gcs", "ray_client_server", "dashboard")

_stop_requested = False


def say(line: str) -> None:
    """Print one line; never raises (after scancel, srun may be gone and stdout a broken pipe)."""
    try:
        print(line, flush=True)
    except (OSError, ValueError):
        pass


def log(msg: str) -> None:
    say(f"[rlfleet-step {os.environ.get('SLURMD_NODENAME', '?')} {time.strftime('%H:%M:%S')}] {msg}")


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _on_stop(signum, _frame) -> None:
    global _stop_requested
    if not _stop_requested:
        log(f"received {signal.Signals(signum).name}; stopping")
    _stop_requested = True


def become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log(f"warning: prctl(PR_SET_CHILD_SUBREAPER) failed (errno {ctypes.get_errno()})")
    except (OSError, AttributeError) as exc:
        log(f"warning: cannot become subreaper: {exc}")


# -- process tree ------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may hold spaces.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[0] != "Z":
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def descendants(root: int | None = None) -> list[int]:
    """PIDs below ``root`` (default: this process), live ones only, parents before children."""
    kids = _children_map()
    out, todo = [], [root or os.getpid()]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(main: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM the main child (it stops its own processes), then every descendant; SIGKILL what is left."""
    deadline = time.monotonic() + grace
    if main is not None and main.poll() is None:
        main.terminate()
    while time.monotonic() < deadline and (main is not None and main.poll() is None):
        reap_and_sleep()
    rest = descendants()
    if rest:
        signal_all(rest, signal.SIGTERM)
        end = time.monotonic() + min(2.0, max(grace, 0.5))
        while descendants() and time.monotonic() < end:
            reap_and_sleep()
    rest = descendants()
    if rest:
        log(f"killing {len(rest)} process(es) that outlived SIGTERM: {rest}")
        signal_all(rest, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while descendants() and time.monotonic() < end:
            reap_and_sleep()
    reap()
    left = descendants()
    if left:
        log(f"warning: processes still present after SIGKILL: {left}")


def reap_and_sleep(dt: float = 0.1) -> None:
    reap()
    time.sleep(dt)


def wait_main(main: subprocess.Popen) -> int | None:
    """Wait until the main child ends (its code) or a stop is requested (None)."""
    while not _stop_requested:
        rc = main.poll()
        if rc is not None:
            return rc
        reap_and_sleep(0.2)
    return None


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


# -- Ray nodes -----------------------------------------------------------------------
def node_ports(role: str, base: int) -> dict[str, int]:
    ports = {k: base + off for k, off in PORT_OFFSETS.items()}
    if role != "head":
        for k in HEAD_ONLY:
            ports.pop(k)
    return ports


def taken_ports(ip: str, ports: dict[str, int]) -> list[str]:
    taken = []
    for name, port in ports.items():
        for host in ("", ip):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                taken.append(f"{name}={port} ({exc.strerror})")
                break
            finally:
                s.close()
    return taken


def ray_cli() -> list[str]:
    """The ``ray`` command of the Python running this program (not whatever ``ray`` PATH finds first)."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    if os.access(beside, os.X_OK):
        return [beside]
    return [shutil.which("ray") or "ray"]


def ray_start_argv(role: str, ip: str, ports: dict[str, int], min_wp: int, max_wp: int, temp_dir: str) -> list[str]:
    argv = [
        *ray_cli(), "start", "--block", "--disable-usage-stats",
        f"--node-ip-address={ip}",
        f"--num-cpus={int(os.environ['RLFLEET_CPUS_PER_NODE'])}",
        f"--num-gpus={int(os.environ.get('RLFLEET_GPUS_PER_NODE', '0'))}",
        f"--temp-dir={temp_dir}",
        f"--node-manager-port={ports['node_manager']}",
        f"--object-manager-port={ports['object_manager']}",
        f"--runtime-env-agent-port={ports['runtime_env_agent']}",
        f"--dashboard-agent-grpc-port={ports['dashboard_agent_grpc']}",
        f"--dashboard-agent-listen-port={ports['dashboard_agent_listen']}",
        f"--metrics-export-port={ports['metrics_export']}",
        f"--min-worker-port={min_wp}",
        f"--max-worker-port={max_wp}",
    ]  # fmt: skip
    if role == "head":
        argv += ["--head", f"--port={ports['gcs']}", f"--ray-client-server-port={ports['ray_client_server']}"]
        # Ray 2.60 starts its API server (jobs, state) even without the dashboard UI, on 8265 by
        # default: pin its port, and keep it on localhost unless the dashboard is asked for.
        argv += [f"--dashboard-port={ports['dashboard']}"]
        if os.environ.get("RLFLEET_DASHBOARD", "0") == "1":
            argv += ["--include-dashboard=true", "--dashboard-host=0.0.0.0"]
        else:
            argv += ["--include-dashboard=false", "--dashboard-host=127.0.0.1"]
    else:
        argv += [f"--address={os.environ['RLFLEET_HEAD_ADDRESS']}"]
    argv += os.environ.get("RLFLEET_RAY_START_ARGS", "").split()
    return argv


def tcp_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_head_ready(main: subprocess.Popen, ip: str, port: int, deadline: float) -> str | None:
    """Poll the GCS port, then ``ray health-check``. Returns None when ready, else the reason."""
    while not tcp_open(ip, port):
        if _stop_requested or main.poll() is not None:
            return "ray exited before its GCS port opened"
        if time.monotonic() > deadline:
            return f"GCS port {ip}:{port} did not open"
        reap_and_sleep(0.2)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "ray health-check did not pass"
        try:
            ok = subprocess.run(
                [*ray_cli(), "health-check", f"--address={ip}:{port}"],
                timeout=min(left, 30.0), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ).returncode == 0  # fmt: skip
        except subprocess.TimeoutExpired:
            ok = False
        if ok:
            return None
        if _stop_requested or main.poll() is not None:
            return "ray exited during the health check"
        reap_and_sleep(0.5)


def keep_ray_logs(temp_dir: str, name: str) -> None:
    log_dir = os.environ.get("RLFLEET_LOG_DIR", "")
    src = os.path.join(temp_dir, "session_latest", "logs")
    if os.environ.get("RLFLEET_KEEP_RAY_LOGS", "1") == "1" and os.path.isdir(log_dir) and os.path.isdir(src):
        shutil.copytree(src, os.path.join(log_dir, f"ray-{name}"), dirs_exist_ok=True, ignore_dangling_symlinks=True)
    shutil.rmtree(temp_dir, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(temp_dir))  # the job's folder, once its last node on this host is gone
    except OSError:
        pass


def run_ray_node(role: str, ip: str, base: int, min_wp: int, max_wp: int) -> int:
    name = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    ports = node_ports(role, base)
    taken = taken_ports(ip, ports)
    if taken:
        log(f"ports already in use on {ip}: {', '.join(taken)}; another job or service holds them "
            "(set RLFLEET_PORT_BASE to move this job's ports)")  # fmt: skip
        return EXIT_PORT_TAKEN
    temp_dir = os.path.join(os.environ["RLFLEET_RAY_TMP_ROOT"], name)
    os.makedirs(temp_dir, exist_ok=True)
    argv = ray_start_argv(role, ip, ports, min_wp, max_wp, temp_dir)
    env = dict(os.environ, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    # Ray starts its workers at niceness 15 unless told: the engines (Ray workers and their children) would then
    # yield the CPU to anything else on the node, a colocated trainer included (``fleet.cluster.ray_door``)
    env.setdefault("RAY_worker_niceness", "0")
    log(f"{role} on {ip}: {' '.join(argv)}")
    main = subprocess.Popen(argv, env=env)
    grace = env_float("RLFLEET_STOP_GRACE_S", 10.0)
    rc: int | None = None
    try:
        if role == "head":
            reason = wait_head_ready(main, ip, ports["gcs"], time.monotonic() + env_float("RLFLEET_READY_TIMEOUT_S", 180))
            if reason and not _stop_requested and main.poll() is None:
                log(f"head not ready: {reason}")
                return EXIT_NOT_READY
            if not reason:
                log("head ready")
                say(f"RLFLEET_READY {ip} {ports['gcs']}")
        rc = wait_main(main)
        if rc is not None:
            log(f"ray exited on its own with code {rc}")
            return exit_code(rc) or 1
        return 0
    finally:
        stop_tree(main, grace)
        keep_ray_logs(temp_dir, f"{role}-{name}")
        log(f"{role} stopped; no process of this step is left")


# -- driver --------------------------------------------------------------------------
WAIT_FOR_NODES = r"""
import os, sys, time
import ray
want = int(os.environ["RLFLEET_EXPECTED_NODES"])
deadline = time.monotonic() + float(sys.argv[1])
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="WARNING")
alive = 0
while time.monotonic() < deadline:
    alive = sum(1 for n in ray.nodes() if n["Alive"])
    if alive >= want:
        print(f"RLFLEET_NODES_READY {alive}", flush=True)
        sys.exit(0)
    time.sleep(0.5)
print(f"only {alive} of {want} Ray nodes alive", flush=True)
sys.exit(124)
"""


def run_driver(command: list[str]) -> int:
    if not command:
        log("no driver command given")
        return EXIT_USAGE
    grace = env_float("RLFLEET_STOP_GRACE_S", 10.0)
    timeout = env_float("RLFLEET_READY_TIMEOUT_S", 180)
    waiter = subprocess.Popen([sys.executable, "-c", WAIT_FOR_NODES, str(timeout)])
    rc = wait_main(waiter)
    if rc is None:
        stop_tree(waiter, grace)
        return 0
    if rc != 0:
        log(f"the Ray cluster never reached {os.environ.get('RLFLEET_EXPECTED_NODES')} alive nodes")
        stop_tree(None, grace)
        return EXIT_NOT_READY if rc == 124 else exit_code(rc)
    log(f"driver: {' '.join(command)}")
    try:
        main = subprocess.Popen(command)
    except OSError as exc:
        log(f"cannot run the driver: {exc}")
        return 127
    try:
        rc = wait_main(main)
        if rc is None:
            return 0
        log(f"driver exited with code {exit_code(rc)}")
        return exit_code(rc)
    finally:
        stop_tree(main, grace)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, _on_stop)
    become_subreaper()
    role = argv[0] if argv else ""
    if role in ("head", "worker") and len(argv) == 5:
        ip, base, min_wp, max_wp = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        return run_ray_node(role, ip, base, min_wp, max_wp)
    if role == "driver":
        rest = argv[1:]
        return run_driver(rest[1:] if rest[:1] == ["--"] else rest)
    log(f"usage: head|worker IP PORT_BASE MIN_WORKER_PORT MAX_WORKER_PORT | driver -- COMMAND; got {argv}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
