"""Per-route timings of a TRL-like step against ``vllm serve`` and ``rlfleet serve``, one engine each.

    python scripts/bench_rl_routes.py [--steps 40] [--rounds 2] [--max-tokens 6]

``bench_trl`` measures what a TRL user sees (steps/s of TRL's own trainer); its run-to-run spread on a
shared 2-core machine is larger than most single changes to the weight path. This one drives the same
routes as TRL's client does each step, without TRL's training in between, and times each call:
``/start_weight_update``, ``/update_weights`` (during the trainer's packed gloo broadcast of the tiny
model, nudged each step), ``/finish_weight_update``, ``/reset_prefix_cache``, and a ``/v1/completions``
of 4 prompts x 4 choices. Each server is started fresh with ``bench_trl``'s settings; rounds alternate
which goes first. The first 2 steps of each run are not counted.

The last line is one JSON object: ``rl_routes_step_ratio`` (vLLM's median step over rlfleet's, the median
over rounds: the loop's steps/s ratio), per route and server the median milliseconds over rounds
(``routes_ms``), rlfleet's refit phases as its finish reports them (``rlfleet_phases_ms``), and the CPU each
server's processes and this client used per counted step (``cpu_ms_per_step``, by role: the server's process
tree as ``/proc`` counts it, Ray's and vLLM's processes named by their titles; median over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_http import Server, free_port  # noqa: E402
from bench_procs import cpu_by_process, cpu_used_by_role  # noqa: E402
from bench_trl import alternating_rounds, command  # noqa: E402
from rlfleet.fleet.config.engine import EngineConfig  # noqa: E402

ROUTES = ("start", "update", "finish", "reset", "generate", "step")
def arm(name: str, cfg: EngineConfig, args, workdir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlfleet.rlapi.trl import GlooVLLMClient
    from rlfleet.rlapi.trl_run import prompts

    port = free_port()
    env = {**os.environ, **cfg.process_env(), "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("RAY_ADDRESS", None)
    server = Server(name, command(name, cfg, port, workdir), env, port, workdir)
    times: dict[str, list[float]] = {k: [] for k in ROUTES}
    phases: dict[str, list[float]] = {}
    try:
        server.wait_ready(args.start_timeout)
        client = GlooVLLMClient(base_url=server.url, group_port=free_port(), connection_timeout=60)
        client.init_communicator(device="cpu")
        model = AutoModelForCausalLM.from_pretrained(cfg.model)
        batch = prompts(cfg.model, 4)

        def timed(route: str, call):
            t0 = time.perf_counter()
            out = call()
            times[route].append(time.perf_counter() - t0)
            return out

        for step in range(args.steps + 2):
            t0 = time.perf_counter()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)
            timed("start", client._start_weight_update)
            client._updating_weights = True
            timed("update", lambda: client.update_model_params(model))
            client._updating_weights = False
            done = timed("finish", lambda: client._post(f"{client.base_url}/finish_weight_update", json={}))
            timed("reset", client.reset_prefix_cache)
            timed("generate", lambda: client.generate(batch, n=4, max_tokens=args.max_tokens, logprobs=0, temperature=1.0))
            times["step"].append(time.perf_counter() - t0)
            for phase, s in ((done.get("rlfleet") or {}).get("phases_s") or {}).items():
                phases.setdefault(phase, []).append(s)
            if step < 2:  # warm-up
                for v in (*times.values(), *phases.values()):
                    v.clear()
                cpu0 = cpu_by_process(server.proc.pid)
        cpu1 = cpu_by_process(server.proc.pid)
        client.close_communicator()
    finally:
        server.stop()
    cpu = {role: s * 1000 / args.steps for role, s in cpu_used_by_role(cpu0, cpu1).items()}
    cpu["all"] = sum(cpu.values())
    out = {"routes_ms": {k: statistics.median(v) * 1000 for k, v in times.items()},
           "phases_ms": {k: statistics.median(v) * 1000 for k, v in phases.items()}, "cpu_ms": cpu}
    print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in out["routes_ms"].items()) + " ms; CPU ms a step: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args()
    rounds = []
    for r, got in enumerate(alternating_rounds(args.rounds, lambda name, cfg, workdir: arm(name, cfg, args, workdir),
                                                "rlfleet-bench-rl-routes-")):
        ratio = got["vllm"]["routes_ms"]["step"] / got["rlfleet"]["routes_ms"]["step"]
        print(f"round {r}: vLLM step / rlfleet step {ratio:.3f}", flush=True)
        rounds.append((ratio, got))

    def over_rounds(name: str, key: str) -> dict:
        keys = rounds[0][1][name][key]
        return {k: round(statistics.median(g[name][key].get(k, 0.0) for _, g in rounds), 2) for k in keys}

    print(json.dumps({
        "rl_routes_step_ratio": round(statistics.median(r for r, _ in rounds), 3),
        "ratios": [round(r, 3) for r, _ in rounds],
        "routes_ms": {name: over_rounds(name, "routes_ms") for name in ("vllm", "rlfleet")},
        "rlfleet_phases_ms": over_rounds("rlfleet", "phases_ms"),
        "cpu_ms_per_step": {name: over_rounds(name, "cpu_ms") for name in ("vllm", "rlfleet")},
        "steps": args.steps, "max_tokens": args.max_tokens,
    }))


if __name__ == "__main__":
    main()
