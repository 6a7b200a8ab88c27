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

    python scripts/bench_token_rate.py [--tokens 512] [--concurrency 1,64,256] [--rate 100000] [--repeats 3]

Both sides are measured ``--repeats`` times at each concurrency, in turn (the baseline, then the fleet, and
again), and each figure is the median: on a shared machine one measurement of either side moves by a fifth.
Both processes freeze their collector heap once started, as ``vllm serve``'s API server does.

The shard's engine sends each request's tokens a few at a time when its pace lets them fit in half the
client's interval (``fleet.shard.stream_pace``: vLLM's ``stream_interval``); the baseline is vLLM at its
default, one output per token, as ``vllm serve`` runs.

The last line is one JSON object: ``max_tokens_per_s_C``, ``fleet_cpu_us_per_token_C`` (and its parts) and
``vllm_output_cpu_us_per_token_C`` for each concurrency C, ``fleet_vs_vllm_cpu_per_token_256``,
``cpu_per_token_256_vs_1``, and ``gathered`` (the shard's requests by tokens per output, warm-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each side at each concurrency")
    parser.add_argument("--min-tokens", type=int, default=32768, help="tokens per measurement, at least")
    args = parser.parse_args()
    sizes = [int(c) for c in args.concurrency.split(",")]
    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))

    ray_door.init_local(num_cpus=4, log_to_driver=False)
    fleet = Fleet.start(fleet_config(model, args.rate, max(sizes), args.tokens))
    out: dict = {"repeats": args.repeats}
    try:
        measure(fleet, min(8, max(sizes)), 32, 1)  # warm-up: the first requests import and compile paths
        for c in sizes:
            rounds = max(1, -(-args.min_tokens // (c * args.tokens)))
            base, runs = [], []
            for _ in range(args.repeats):  # the two sides in turn: what drifts on the machine moves both alike
                base.append(output_processing_cpu_s(model, c, args.tokens))  # vLLM's alone, this process
                runs.append(measure(fleet, c, args.tokens, rounds))
            vllm_us = statistics.median([b["us_per_token"] for b in base])
            core_us = statistics.median([b["core_us_per_token"] for b in base])  # the stand-in engine core's own
            shard_us = statistics.median([1e6 * m["shard_cpu_s"] / m["tokens"] for m in runs])
            client_us = statistics.median([1e6 * m["client_cpu_s"] / m["tokens"] for m in runs])
            fleet_us = statistics.median([1e6 * (m["shard_cpu_s"] + m["client_cpu_s"]) / m["tokens"] - core_us for m in runs])
            out[f"vllm_output_cpu_us_per_token_{c}"] = round(vllm_us, 2)
            out[f"synthetic_core_us_per_token_{c}"] = round(core_us, 2)
            out[f"max_tokens_per_s_{c}"] = round(statistics.median([m["tokens"] / m["wall_s"] for m in runs]))
            out[f"fleet_cpu_us_per_token_{c}"] = round(fleet_us, 2)
            out[f"shard_cpu_us_per_token_{c}"] = round(shard_us, 2)
            out[f"client_cpu_us_per_token_{c}"] = round(client_us, 2)
            each_fleet = ", ".join(f"{1e6 * (m['shard_cpu_s'] + m['client_cpu_s']) / m['tokens'] - core_us:.1f}"
                                   for m in runs)
            each_vllm = ", ".join(f"{b['us_per_token']:.1f}" for b in base)
            print(f"{c:>4} streams: {out[f'max_tokens_per_s_{c}']:>7} tokens/s, fleet {fleet_us:.1f} us/token "
                  f"(shard {shard_us:.1f} less core {core_us:.1f}, client {client_us:.1f}); vLLM alone "
                  f"{vllm_us:.1f} (medians of {args.repeats}, each {rounds} round(s) of {c} x {args.tokens} tokens; "
                  f"fleet {each_fleet}; vLLM {each_vllm})", flush=True)
        counters = fleet.client.counters()
        out["polls"], out["submits"] = counters.get("polls"), counters.get("submits")
        # the shard's watched requests by the tokens its engine sent per output (``fleet.shard.stream_pace``)
        out["gathered"] = {str(k): n for k, n in sorted(fleet.shard_counters()[0]["gathered"].items(), key=lambda kv: int(kv[0]))}
    finally:
        fleet.shutdown()
        ray_door.shutdown()
    top, one = max(sizes), min(sizes)
    out[f"fleet_vs_vllm_cpu_per_token_{top}"] = round(out[f"fleet_cpu_us_per_token_{top}"] / out[f"vllm_output_cpu_us_per_token_{top}"], 3)
    out[f"cpu_per_token_{top}_vs_{one}"] = round(out[f"fleet_cpu_us_per_token_{top}"] / out[f"fleet_cpu_us_per_token_{one}"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
