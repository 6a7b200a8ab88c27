"""The fleet's data path at GPU token rates: CPU per token streamed, at 1, 64 and 256 concurrent requests.

One shard on the token-rate backend (``fleet.shard.token_rate``: vLLM's own output processor fed synthetic
engine outputs, as fast as the shard takes them: ``--rate`` steps a second is far above what the path
carries, so the path, not the engine, limits), and the Python client in this process streaming every
request (an ``on_tokens`` caller), 512 tokens each. For each concurrency: the tokens per second the shard and
its client carried, and the CPU each process used (the shard actor, this client; Ray's own daemons apart).
The fleet's CPU per token is the shard's plus the client's, less the synthetic core's own (an engine core's
work, which on a GPU runs in its own process: measured alone, per token and at the same concurrency, by the
baseline run).

The baseline, in the same run: vLLM's own output processing of the same tokens in one process
(``fleet.shard.token_rate_baseline.output_processing_cpu_s``: ``OutputProcessor.process_outputs`` and each
request's ``AsyncLLM.generate`` drain), what ``vllm serve``'s API server pays per token before it writes
the token out.

    python scripts/bench_token_rate.py [--tokens 512] [--concurrency 1,64,256] [--rate 100000]

The last line is one JSON object: ``max_tokens_per_s_C``, ``fleet_cpu_us_per_token_C`` (and its parts) and
``vllm_output_cpu_us_per_token_C`` for each concurrency C, ``fleet_vs_vllm_cpu_per_token_256`` and
``cpu_per_token_256_vs_1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import psutil

from rlfleet.fleet.api import Fleet
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.shard.token_rate_baseline import output_processing_cpu_s
from rlfleet.recipe.tinymodel import build_model, default_model_dir

PROMPT_LEN = 8


def fleet_config(model: str, rate: float, batch: int, tokens: int) -> dict:
    return {
        "engine": {"model": model, "backend": "token_rate", "token_rate_per_s": rate, "token_rate_batch": batch,
                   "max_model_len": PROMPT_LEN + tokens + 8, "num_cpus": 0},
        "num_engines": 1,
        "min_healthy_engines": 1,
        "metrics": False,
        "admission": {"enabled": False},  # the path's own limit, not the admission law's cap
        "request_timeout_s": 600,
    }


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def shard_pid() -> int:
    (pid,) = [p.pid for p in psutil.process_iter(["cmdline"]) if "ray::EngineShard" in " ".join(p.info["cmdline"] or ())]
    return pid


async def streams(client, concurrency: int, tokens: int, round_: int) -> tuple[int, int]:
    """``concurrency`` streamed requests at once: (tokens told to the callers, tokens in the results)."""
    told = [0]

    def on_tokens(delta) -> None:
        told[0] += len(delta.token_ids)

    sampling = {"max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
    results = await asyncio.gather(*(
        client.generate_async([1 + (round_ * 131 + i) % 97] * PROMPT_LEN, {**sampling, "seed": i}, None, None, on_tokens)
        for i in range(concurrency)))  # fmt: skip
    bad = [r.reason for r in results if not r.ok]
    assert not bad, bad[:3]
    return told[0], sum(len(r.result.completions[0].token_ids) for r in results)


def measure(fleet: Fleet, concurrency: int, tokens: int, rounds: int) -> dict:
    """``rounds`` rounds of ``concurrency`` streams, one round after the other (enough tokens to read CPU time)."""
    pid, me = shard_pid(), os.getpid()
    shard0, client0, t0 = _cpu(pid), _cpu(me), time.perf_counter()
    made = 0
    for r in range(rounds):
        told, got = fleet.client.spawn(streams(fleet.client, concurrency, tokens, r)).result(1800)
        assert told == got == concurrency * tokens, (told, got)
        made += got
    wall = time.perf_counter() - t0
    shard_s, client_s = _cpu(pid) - shard0, _cpu(me) - client0
    return {"tokens": made, "wall_s": wall, "shard_cpu_s": shard_s, "client_cpu_s": client_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--rate", type=float, default=100000.0, help="the engine's steps a second (far above the path)")
    args = parser.parse_args()
    sizes = [int(c) for c in args.concurrency.split(",")]
    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))

    base = {c: output_processing_cpu_s(model, c, args.tokens) for c in sizes}  # vLLM's alone, at each concurrency
    for c in sizes:
        print(f"baseline at {c:>3}: vLLM's output processing {base[c]['us_per_token']:.1f} us/token, the synthetic "
              f"core {base[c]['core_us_per_token']:.1f} us/token ({c} requests x {args.tokens} tokens)", flush=True)

    ray_door.init_local(num_cpus=4, log_to_driver=False)
    fleet = Fleet.start(fleet_config(model, args.rate, max(sizes), args.tokens))
    out: dict = {f"vllm_output_cpu_us_per_token_{c}": round(base[c]["us_per_token"], 2) for c in sizes}
    out.update({f"synthetic_core_us_per_token_{c}": round(base[c]["core_us_per_token"], 2) for c in sizes})
    try:
        measure(fleet, min(8, max(sizes)), 32, 1)  # warm-up: the first requests import and compile paths
        for c in sizes:
            m = measure(fleet, c, args.tokens, -(-max(sizes) // c))  # as many tokens at each concurrency
            shard_us = 1e6 * m["shard_cpu_s"] / m["tokens"]
            client_us = 1e6 * m["client_cpu_s"] / m["tokens"]
            core_us = base[c]["core_us_per_token"]  # the stand-in engine core's own, at this concurrency
            fleet_us = shard_us - core_us + client_us
            out[f"max_tokens_per_s_{c}"] = round(m["tokens"] / m["wall_s"])
            out[f"fleet_cpu_us_per_token_{c}"] = round(fleet_us, 2)
            out[f"shard_cpu_us_per_token_{c}"] = round(shard_us, 2)
            out[f"client_cpu_us_per_token_{c}"] = round(client_us, 2)
            print(f"{c:>4} streams: {out[f'max_tokens_per_s_{c}']:>7} tokens/s, fleet {fleet_us:.1f} us/token "
                  f"(shard {shard_us:.1f} less core {core_us:.1f}, client {client_us:.1f}; vLLM alone "
                  f"{base[c]['us_per_token']:.1f})",
                  flush=True)
        counters = fleet.client.counters()
        out["polls"], out["submits"] = counters.get("polls"), counters.get("submits")
    finally:
        fleet.shutdown()
        ray_door.shutdown()
    top, one = max(sizes), min(sizes)
    out[f"fleet_vs_vllm_cpu_per_token_{top}"] = round(out[f"fleet_cpu_us_per_token_{top}"] / base[top]["us_per_token"], 3)
    out[f"cpu_per_token_{top}_vs_{one}"] = round(out[f"fleet_cpu_us_per_token_{top}"] / out[f"fleet_cpu_us_per_token_{one}"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
