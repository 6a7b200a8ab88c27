"""Ending the processes a local Ray leaves behind when a signal stopped its daemons (no Ray import: ``psutil``).

``fleet.cluster.ray_door.local_ray_down`` calls it once it found the daemons gone.
"""

from __future__ import annotations

import os
import time

import psutil

STRANDED_GRACE_S = 3.0  # how long a stranded worker has to end on SIGTERM before it is killed


def end_stranded_workers(session_name: str, grace_s: float = STRANDED_GRACE_S) -> list[int]:
    """End the processes of the Ray ``session_name`` that outlived its daemons (its workers, an agent) and
    their children (a shard's engine core). Ray puts each worker in a process group of its own, so a signal
    sent to the driver's group stops the daemons but misses every worker: one that registered notices its
    raylet went and exits, but one still starting (importing vLLM for a restarted engine) learns it only when
    its import ends, a minute later on a loaded machine. Each gets SIGTERM, and SIGKILL after ``grace_s``.
    Returns their pids."""

    def live(procs: list) -> list:  # a zombie has ended (its parent reaps it, or init does once that exits)
        out = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except psutil.Error:
                pass
        return out

    def signal_all(procs: list, kill: bool) -> None:
        for proc in procs:
            try:
                proc.kill() if kill else proc.terminate()
            except psutil.Error:
                pass

    mark = f"--session-name={session_name}"
    workers = [proc for proc in psutil.process_iter(["cmdline"])
               if proc.pid != os.getpid() and mark in (proc.info["cmdline"] or ())]
    family = list(workers)
    for proc in workers:
        try:
            family += proc.children(recursive=True)
        except psutil.Error:
            pass
    family = live(family)
    ended = [proc.pid for proc in family]
    for kill in (False, True):
        signal_all(family, kill)
        deadline = time.monotonic() + grace_s
        while (family := live(family)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not family:
            break
    return ended
