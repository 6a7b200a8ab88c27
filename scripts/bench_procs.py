"""The server processes of a benchmark arm by role (Ray's and vLLM's process titles), and the CPU they used:
what ``bench_rl_routes`` and ``bench_trl`` report per step."""

from __future__ import annotations

# a process's role, by the first of these its title or command line contains (Ray's and vLLM's process titles)
ROLES = (("EngineCore", "engine core"), ("ray::EngineShard", "shard"), ("ray::SingleController", "controller"),
         ("ray::WeightRelay", "relay"), ("cli.main serve", "front"), ("vllm.entrypoints", "api server"),
         ("ray::", "ray workers"), ("ray", "ray"))


def cpu_by_process(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of every process of the tree under ``root_pid``, and of this process
    (role ``client``)."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    root = psutil.Process(root_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t, title = proc.cpu_times(), " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
        out[proc.pid] = (next((r for key, r in ROLES if key in title), "other"), t.user + t.system)
    me = psutil.Process()
    t = me.cpu_times()
    out[me.pid] = ("client", t.user + t.system)
    return out


def cpu_used_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role used between two ``cpu_by_process`` reads: per process, what it used since the first
    read (all of it for one that started since). A process that ended between the reads is not counted (its
    CPU can no longer be read), so a figure is at most low, never negative."""
    out: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        out[role] = out.get(role, 0.0) + max(0.0, seconds - before.get(pid, (role, 0.0))[1])
    return out
