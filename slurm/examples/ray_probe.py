"""A light launcher test driver: one actor per Ray node, a JSON report, then an exit chosen by flags.

    python slurm/examples/ray_probe.py --nodes 2 [--exit-code N] [--hold S]
        [--spawn-orphans] [--kill-worker-raylet] [--kill-head-gcs] [--rendezvous DIR --peers K]

Prints one line ``RLFLEET_PROBE {json}`` with the Ray address, the alive nodes, and
per node the actor's PID, node IP and (with ``--spawn-orphans``) the PID of a
double-forked daemon child: a process whose parent is gone, the kind that escapes a
plain process-tree cleanup. The launcher must still stop it.

Other flags:
- ``--rendezvous DIR --peers K``: write ``DIR/<jobid>`` and wait (up to 120 s) until K
  such files exist, proving K jobs ran at the same time (exit 3 otherwise);
- ``--kill-worker-raylet``: SIGKILL the raylet of a non-head node (its actor's parent),
  then wait: under ``--on-node-loss fail`` the launcher must end the job because that
  worker step died;
- ``--kill-head-gcs``: SIGKILL this job's GCS server (found on the head by the job's Ray
  temp dir in its command line), then wait: the launcher must end the job because the
  head step died, whatever ``--on-node-loss`` says;
- ``--hold S``: sleep S seconds before exiting (a window to scancel the job);
- ``--exit-code N``: exit with N at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0.1)
class NodeProbe:
    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def spawn_orphan(self, seconds: float) -> int:
        """Double fork a sleeper that outlives its parent; returns its PID."""
        out = subprocess.run(
            ["bash", "-c", f"(setsid sleep {seconds} >/dev/null 2>&1 </dev/null & echo $!) &"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return int(out.stdout.strip())

    def kill_raylet(self) -> int:
        raylet = os.getppid()
        os.kill(raylet, signal.SIGKILL)
        return raylet


def kill_head_gcs() -> int:
    """SIGKILL this job's GCS server (this driver runs on the head); returns its PID."""
    temp_root = os.environ["RLFLEET_RAY_TMP_ROOT"] + "/"
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        if argv and argv[0].endswith("gcs_server") and any(temp_root in a for a in argv):
            os.kill(int(entry), signal.SIGKILL)
            return int(entry)
    raise RuntimeError(f"no gcs_server with {temp_root} in its command line")


def rendezvous(folder: str, peers: int, timeout: float = 120.0) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, os.environ.get("SLURM_JOB_ID", str(os.getpid()))), "w") as f:
        f.write(os.environ.get("RAY_ADDRESS", ""))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = sorted(os.listdir(folder))
        if len(seen) >= peers:
            return seen
        time.sleep(0.2)
    raise TimeoutError(f"only {sorted(os.listdir(folder))} of {peers} jobs reached {folder}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--hold", type=float, default=0.0)
    ap.add_argument("--spawn-orphans", action="store_true")
    ap.add_argument("--kill-worker-raylet", action="store_true")
    ap.add_argument("--kill-head-gcs", action="store_true")
    ap.add_argument("--rendezvous")
    ap.add_argument("--peers", type=int, default=1)
    args = ap.parse_args(argv)

    address = os.environ["RAY_ADDRESS"]
    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) != args.nodes:
        print(f"expected {args.nodes} alive nodes, found {len(nodes)}", flush=True)
        return 4
    probes = [
        NodeProbe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    infos = ray.get([p.info.remote() for p in probes], timeout=120)
    if args.spawn_orphans:
        orphans = ray.get([p.spawn_orphan.remote(600) for p in probes], timeout=60)
        for info, pid in zip(infos, orphans):
            info["orphan_pid"] = pid
    report = {
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "ray_address": address,
        "driver_pid": os.getpid(),
        "nodes": [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "port": n["NodeManagerPort"]} for n in nodes],
        "actors": infos,
    }
    if args.rendezvous:
        try:
            report["peers"] = rendezvous(args.rendezvous, args.peers)
        except TimeoutError as exc:
            print(exc, flush=True)
            return 3
    print("RLFLEET_PROBE " + json.dumps(report, sort_keys=True), flush=True)
    if args.kill_worker_raylet:
        workers = [p for p, n in zip(probes, nodes) if "node:__internal_head__" not in n["Resources"]]
        if not workers:
            print("no worker node to kill", flush=True)
            return 6
        victim = workers[0]
        print("killing a worker node's raylet", flush=True)
        victim.kill_raylet.remote()
        time.sleep(120)  # the launcher must end the job before this
        print("the launcher did not stop the job after a worker died", flush=True)
        return 5
    if args.kill_head_gcs:
        print(f"killed the head's GCS server (pid {kill_head_gcs()})", flush=True)
        time.sleep(120)  # the launcher must end the job before this
        print("the launcher did not stop the job after its head died", flush=True)
        return 5
    if args.hold > 0:
        print(f"holding {args.hold:.0f} s", flush=True)
        time.sleep(args.hold)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
