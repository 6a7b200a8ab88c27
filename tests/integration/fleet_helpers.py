"""Helpers for integration tests that run a real fleet: load generation, waits, invariant checks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

from rlfleet.faults import invariants
from rlfleet.fleet.cluster import ray_door
from rlfleet.refit import Outcome, Participant

PROMPTS = [[1, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(8)]
SAMPLING = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0}


def cli_env() -> dict:
    """The environment for an ``rlfleet`` command run as a process: offline, Ray's token auth off."""
    return dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"), HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1")


def start_shards(handles, timeout: float = 300.0) -> None:
    """Start every shard's engine at once, then wait for all (starting them one after another took the sum)."""
    for ref in [ray_door.submit(h, "start") for h in handles]:
        ray_door.get_or_raise(ref, timeout)


def signal_and_wait(proc: subprocess.Popen, group: bool = True, timeout: float = 180.0) -> tuple[int, float]:
    """SIGTERM to ``proc``'s whole process group (or the process alone), then wait for it to exit; returns its
    exit status and the seconds that took. Still running after ``timeout``: killed with its group."""
    t0 = time.monotonic()
    try:
        (os.killpg if group else os.kill)(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, time.monotonic() - t0


def session(pid: int) -> list[str]:
    """The processes of the session ``pid`` leads (a command started with ``start_new_session``)."""
    return subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True).stdout.split()


def session_gone(pid: int, within_s: float = 60.0) -> None:
    """Wait until no process of the session ``pid`` leads is left; else fail naming each one that is (a Ray
    worker that got the signal while importing vLLM on a loaded machine can take tens of seconds to end)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not session(pid):
            return
        time.sleep(0.5)
    left = subprocess.run(["ps", "-o", "pid,stat,etime,args", "-s", str(pid)], capture_output=True, text=True).stdout
    raise AssertionError(f"processes of session {pid} still running {within_s:.0f} s after the signal:\n{left}")


def submit_load(fleet, groups: int = 6, n: int = 2, sampling: dict | None = None):
    """Start ``groups`` generation groups without waiting (they run across the refit under test)."""
    return [fleet.submit(PROMPTS[i % len(PROMPTS)], n, sampling or SAMPLING) for i in range(groups)]


def collect(fleet, pending) -> list:
    return [r for p in pending for r in fleet.collect(p)]


def wait_for(predicate, timeout_s: float = 120.0, every_s: float = 0.5, what: str = "condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def slot_states(fleet) -> dict[int, str]:
    return {s["slot"]: s["state"] for s in fleet.status()["ledger"]["slots"]}


def assert_invariants(fleet, since: int = 0) -> list[dict]:
    events = fleet.events()
    problems = invariants.check_all(events, fleet.config.lifecycle_deadline_s)
    assert not problems, "invariants broken:\n" + "\n".join(problems[:20])
    return events[since:]


def logprob_gap(source, results) -> float:
    """Largest difference between the logprobs the engines reported for ``results`` and the trainer's
    (``source``, a ``WeightSource``) scoring of the same tokens: ~1e-6 when the engines hold its weights."""
    worst = 0.0
    for r in results:
        c = r.result.completions[0]
        ref = ray_door.ask(source, "logprobs", list(r.result.prompt_token_ids), list(c.token_ids), timeout=60)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, c.logprobs)))
    return worst


class Run:
    """The module's fleet, its weight source, and the next weight version."""

    def __init__(self, fleet, source) -> None:
        self.fleet, self.source, self.version = fleet, source, 0

    def next_weights(self) -> int:
        self.version += 1
        ray_door.ask(self.source, "perturb", self.version, 0.02, timeout=60)
        return self.version

    def refit(self) -> dict:
        return self.fleet.sync_weights(self.next_weights(), self.source)

    def heal(self) -> None:
        """Wait until every slot is back (restarted engines are stale), then refit so all serve."""
        wait_for(lambda: all(s in ("healthy", "stale") for s in slot_states(self.fleet).values()), 180, what="restarts")
        if any(s == "stale" for s in slot_states(self.fleet).values()):
            self.refit()
        assert set(slot_states(self.fleet).values()) == {"healthy"}


def participants(shards) -> dict:
    """The refit plan for bare shards: slot ``i`` at its current incarnation, rank ``i + 1``."""
    return {Participant(i, ray_door.ask(h, "describe", timeout=30).incarnation, (i + 1,)): ray_door.ShardReceiverPort(h)
            for i, h in enumerate(shards)}


async def paused_refit(sync, shards, version, epoch):
    """Pause, refit, stamp the shard version on complete engines, resume: the controller's steps 4-7."""
    await asyncio.gather(*(ray_door.call_async(h, "pause", mode="keep", clear_cache=True) for h in shards))
    try:
        report = await sync.refit(participants(shards), version, epoch)
        for key, res in report.results.items():
            if res.outcome is Outcome.COMPLETE:
                await ray_door.call_async(shards[key.slot], "set_weight_version", version)
    finally:
        await asyncio.gather(*(ray_door.call_async(h, "resume") for h in shards))
    return report
