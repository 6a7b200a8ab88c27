"""TRL's GRPOTrainer against ``vllm serve`` and against ``rlfleet serve``, one engine each, in one run.

    python scripts/bench_trl.py [--steps 30] [--rounds 3] [--warmup-rounds 1] [--max-tokens 6]

The same TRL run (``rlapi.trl_run``: TRL's own ``GRPOTrainer`` in server mode, the tiny model, 4 prompts x 4
completions of 6 tokens a step, a weight sync through vLLM's RL routes before every generation) trains
against each server in turn, each server started fresh as a subprocess with the same engine settings:
``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend": "gloo"}'``: rlfleet's
gloo engine, loaded by vLLM's plugin entry point) and ``rlfleet serve`` (one engine: its relay, then a refit
of the fleet through the whole lifecycle). Both take TRL's own launch flags (``rlapi.trl.launch_flags``:
``--enable-scale-out``, the weight transfer with gloo for NCCL, ``--logprobs-mode processed_logprobs``,
``--max-logprobs -1``). Only one server runs at a time; rounds alternate the order (vllm first in even
rounds) so drift on this shared machine falls on both arms.

The same footing for both arms:
- the first ``--warmup-rounds`` (1) rounds run both arms and are not counted (the first start of each
  server pays for cold file caches and compiled code, which on a quiet machine made the first round's
  vLLM arm 1.8 steps/s against 10 in the next);
- the engines run at the same CPU priority: Ray starts its workers (rlfleet's engine shards) at niceness 15
  and ``vllm serve`` runs at the caller's, so the rlfleet arm's Ray is told ``RAY_worker_niceness=0``; each
  arm's processes' niceness is reported (``niceness``), read during the run;
- each arm's CPU per counted step by process (``cpu_ms_per_step``: the server's processes by role, as
  ``bench_rl_routes`` reads them, and ``trainer``: the TRL run's process, its start-up included, over the same
  step count), so a round that another process slowed shows as wall time its processes did not spend.

A run's steps/s counts the steps after the first (the first carries TRL's start-up and the first sync)
over their summed time. The last line is one JSON object: ``trl_rlfleet_vs_vllm_steps_per_s`` (the median
over the counted rounds of rlfleet's steps/s over vLLM's in the same round; goal >= 0.8), each arm's steps/s
per round, CPU per step and niceness, and each arm's mean reward over its last 5 steps (both arms train the
same task from the same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_http import Server, free_port, vllm_command  # noqa: E402
from bench_procs import ROLES, cpu_by_process, cpu_used_by_role  # noqa: E402
from rlfleet.fleet.config.engine import EngineConfig  # noqa: E402
from rlfleet.recipe.tinymodel import build_model, default_model_dir  # noqa: E402
from rlfleet.rlapi.trl import launch_flags  # noqa: E402


def command(name: str, cfg: EngineConfig, port: int, workdir: str) -> list[str]:
    """Each server with TRL's launch flags as TRL writes them (gloo for NCCL on CPU)."""
    if name == "vllm":
        return vllm_command(cfg, port) + launch_flags("gloo")
    path = os.path.join(workdir, "fleet.yaml")
    with open(path, "w") as f:
        f.write(f"engine:\n  model: {cfg.model}\n"
                f"  kv_cache_memory_bytes: {cfg.kv_cache_memory_bytes}\nnum_engines: 1\nmin_healthy_engines: 1\n")
    return [sys.executable, "-m", "rlfleet.cli.main", "serve", "--config", path, "--port", str(port), *launch_flags("gloo")]


def niceness_by_role(root_pid: int) -> dict[str, list[int]]:
    """The niceness of every process under the server, by role (``bench_rl_routes.ROLES``)."""
    import psutil

    out: dict[str, set[int]] = {}
    root = psutil.Process(root_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            title, nice = " ".join(proc.cmdline()) or proc.name(), proc.nice()
        except psutil.Error:
            continue
        out.setdefault(next((r for key, r in ROLES if key in title), "other"), set()).add(nice)
    return {role: sorted(v) for role, v in sorted(out.items())}


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def arm(name: str, cfg: EngineConfig, args, workdir: str) -> dict:
    port = free_port()
    env = {**os.environ, **cfg.process_env(), "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("RAY_ADDRESS", None)
    if name == "rlfleet":
        env["RAY_worker_niceness"] = "0"  # Ray's default is 15 for its workers; vllm serve's engine runs at ours
    server = Server(name, command(name, cfg, port, workdir), env, port, workdir)
    try:
        server.wait_ready(args.start_timeout)
        nice = niceness_by_role(server.proc.pid)
        cpu0, trainer0 = cpu_by_process(server.proc.pid), _children_cpu_s()
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "rlfleet.rlapi.trl_run", "--url", server.url, "--steps", str(args.steps),
                              "--max-tokens", str(args.max_tokens)],
                             cwd=ROOT, capture_output=True, text=True, timeout=args.run_timeout,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        cpu1, trainer1 = cpu_by_process(server.proc.pid), _children_cpu_s()
        if out.returncode != 0:
            raise server.fail(f"the TRL run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        run = json.loads(out.stdout.strip().splitlines()[-1])
        run["wall_s"] = time.perf_counter() - t0
    finally:
        run_stop = server.stop()
    steps = run["step_s"][1:]
    rewards = run["rewards"]
    cpu = {role: round(s * 1000 / args.steps, 1) for role, s in cpu_used_by_role(cpu0, cpu1).items() if role != "client"}
    cpu["trainer"] = round((trainer1 - trainer0) * 1000 / args.steps, 1)
    result = {"steps_per_s": len(steps) / sum(steps), "last5_reward": statistics.mean(rewards[-5:]),
              "first_step_s": run["step_s"][0], "wall_s": run["wall_s"], "stop": run_stop, "cpu_ms_per_step": cpu,
              "niceness": nice}
    print(f"{name}: {result['steps_per_s']:.3f} steps/s, last-5 reward {result['last5_reward']:.3f}, "
          f"first step {result['first_step_s']:.1f} s; CPU ms a step: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
          + f"; niceness {nice}", flush=True)
    return result


def alternating_rounds(rounds: int, arm_of, prefix: str):
    """Each round runs ``arm_of(name, cfg, workdir)`` for both servers on the tiny model, vllm first in even
    rounds and rlfleet first in odd ones (drift on this shared machine falls on both arms); one work
    directory for the whole run. Yields each round's ``{name: arm's result}`` as it ends."""
    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))
    cfg = EngineConfig(model=model)  # the logprobs mode is TRL's flag
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        for r in range(rounds):
            yield {name: arm_of(name, cfg, workdir) for name in (("vllm", "rlfleet") if r % 2 == 0 else ("rlfleet", "vllm"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)  # an odd count: the median is one round, not a mean of two
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted")
    p.add_argument("--max-tokens", type=int, default=6, help="each completion's length (6: the TRL test's run; "
                   "longer completions weigh generation against the fleet's per-step costs)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=900.0)
    args = p.parse_args()

    def both(name: str, cfg: EngineConfig, workdir: str) -> dict:
        return arm(name, cfg, args, workdir)

    rounds, warmup = [], []
    for r, got in enumerate(alternating_rounds(args.warmup_rounds + args.rounds, both, "rlfleet-bench-trl-")):
        got["ratio"] = got["rlfleet"]["steps_per_s"] / got["vllm"]["steps_per_s"]
        counted = r >= args.warmup_rounds
        print(f"round {r}{'' if counted else ' (warm-up, not counted)'}: rlfleet/vllm steps/s {got['ratio']:.3f}",
              flush=True)
        (rounds if counted else warmup).append(got)

    def cpu(name: str) -> dict[str, float]:
        roles = sorted({k for g in rounds for k in g[name]["cpu_ms_per_step"]})
        return {k: round(statistics.median(g[name]["cpu_ms_per_step"].get(k, 0.0) for g in rounds), 1) for k in roles}

    print(json.dumps({
        "trl_rlfleet_vs_vllm_steps_per_s": round(statistics.median(g["ratio"] for g in rounds), 3),
        "ratios": [round(g["ratio"], 3) for g in rounds],
        "vllm_steps_per_s": [round(g["vllm"]["steps_per_s"], 3) for g in rounds],
        "rlfleet_steps_per_s": [round(g["rlfleet"]["steps_per_s"], 3) for g in rounds],
        "vllm_last5_reward": [round(g["vllm"]["last5_reward"], 3) for g in rounds],
        "rlfleet_last5_reward": [round(g["rlfleet"]["last5_reward"], 3) for g in rounds],
        "cpu_ms_per_step": {"vllm": cpu("vllm"), "rlfleet": cpu("rlfleet")},
        "niceness": {name: rounds[-1][name]["niceness"] for name in ("vllm", "rlfleet")} if rounds else {},
        "warmup_ratios": [round(g["ratio"], 3) for g in warmup],
        "steps": args.steps,
        "max_tokens": args.max_tokens,
    }))


if __name__ == "__main__":
    main()
