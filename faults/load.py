"""A refit under full load: client threads submit without pause while the fleet changes weights.

``refit_under_load(fleet, sync)`` starts ``threads`` client threads that each submit one
request at a time (version policy ``latest``) until told to stop, runs ``sync()`` (one
refit) meanwhile, and, once the refit has fenced the shards (each shard's floor is past
the last open routing state's epoch: a request routed before that reached its shard
earlier and was legitimately in flight), plays a lagging client: it sends one request
to every shard of that old state, stamped with its epoch, straight to the shard (as a
client whose routing state has not caught up would). Those must all be refused by the
shards (``RouteRefused``: paused or an old epoch) without running. The record says what happened, for
``faults.evidence`` to judge:

- ``calls``: the refit call (``sync``'s record);
- ``submitted`` / ``overlapping``: requests the threads submitted, and how many of them
  were alive while the refit ran (held across it or accepted during it: the load really
  overlapped the refit);
- ``mixed``: completed ``latest`` requests whose samples did not come from one version;
- ``lagging``: per lagging send, its slot and whether it was refused, and why;
- ``refused_delta``: the shards' refusal counters over the run, by reason.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.errors import RouteRefused
from rlfleet.fleet.data.routing_state import LATEST, Ticket, VersionPolicy

PROMPT = [5, 6, 7, 8]
SAMPLING = {"max_tokens": 4}


def _refused(counters: dict[int, dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counters.values():
        for reason, n in c.get("refused", {}).items():
            total[reason] = total.get(reason, 0) + n
    return total


def _lagging_sends(stale, timeout_s: float) -> list[dict]:
    """One request per member of ``stale`` (an open routing state), stamped with its old epoch."""
    pending = [(m, ray_door.submit(m.handle, "generate", PROMPT, SAMPLING, request_id=f"lagging-{m.slot}-{stale.epoch}",
                                 ticket=Ticket(stale.epoch, VersionPolicy(LATEST)))) for m in stale.members]
    out = []
    for m, p in pending:
        o = ray_door.settle(p, timeout_s)
        refused = isinstance(o.error, RouteRefused)
        out.append({"slot": m.slot, "incarnation": m.incarnation, "refused": refused,
                    "reason": o.error.reason if refused else o.describe()[:200]})
    return out


def refit_under_load(fleet: Any, sync: Callable[[], dict], threads: int = 4, settle_s: float = 0.5) -> dict:
    before = _refused(fleet.shard_counters())
    stale = fleet.client.routing()
    stop = threading.Event()
    results: list = []
    lock = threading.Lock()

    def submit_forever() -> None:
        while not stop.is_set():
            group = fleet.collect(fleet.submit(PROMPT, 1, SAMPLING, version_policy="latest"))
            with lock:
                results.extend(group)

    workers = [threading.Thread(target=submit_forever, name=f"load-{i}", daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    time.sleep(settle_s)  # the load is running before the refit begins
    box: dict = {}
    refit = threading.Thread(target=lambda: box.update(call=sync()), name="refit", daemon=True)
    refit.start()
    lagging: list[dict] = []
    members = {m.slot for m in stale.members}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # once the refit fenced every shard of the old state
        if not fleet.client.routing().gate_open or not refit.is_alive():
            floors = {s: c.get("floor", 0) for s, c in fleet.shard_counters().items() if s in members}
            if floors and all(f > stale.epoch for f in floors.values()):
                during = refit.is_alive()
                lagging = [{**x, "during_refit": during} for x in _lagging_sends(stale, 60)]
                break
        time.sleep(0.005)
    refit.join(timeout=600)
    time.sleep(settle_s)  # and keeps running after it
    stop.set()
    for w in workers:
        w.join(timeout=fleet.config.request_timeout_s + 60)
    call = box.get("call", {"outcome": "did not end", "began": 0.0, "ended": 0.0, "version": None, "error": None})
    # requests whose life (acceptance to end) overlapped the refit: held across it, or accepted during it
    overlapping = sum(1 for r in results if r.accepted_at <= call["ended"] and r.accepted_at + r.latency_s >= call["began"])
    return {
        "calls": [call],
        "threads": threads,
        "submitted": len(results),
        "overlapping": overlapping,
        "completed": sum(1 for r in results if r.ok),
        "mixed": sum(1 for r in results if r.ok and r.result.version_start != r.result.weight_version),
        "lagging": lagging,
        "stale_epoch": stale.epoch,
        "refused_delta": {k: v - before.get(k, 0) for k, v in _refused(fleet.shard_counters()).items()},
    }


class ClientLoad:
    """``threads`` client threads, each submitting one request (``prompt``, ``sampling``) at a time until
    ``end``; every result is kept (``results``)."""

    def __init__(self, fleet: Any, threads: int, prompt: Any, sampling: dict, name: str = "client-load") -> None:
        self.fleet, self.stop = fleet, threading.Event()
        self.finished: list[tuple[float, Any]] = []  # (time.monotonic() when it came back, result): one clock per machine
        self._prompt, self._sampling = prompt, sampling
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for w in self._workers:
            w.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            group = self.fleet.collect(self.fleet.submit(self._prompt, 1, self._sampling))
            now = time.monotonic()
            with self._lock:
                self.finished.extend((now, r) for r in group)

    @property
    def results(self) -> list:
        """Every result so far, in the order they came back."""
        with self._lock:
            return [r for _, r in self.finished]

    def completed_on(self, slot: int, incarnation: int | None = None, version: int | None = None) -> int:
        """Requests that completed on ``slot`` (and that incarnation, tagged with that version, if given)."""
        return sum(1 for r in self.results if r.ok and r.result.slot == slot
                       and incarnation in (None, r.result.incarnation) and version in (None, r.result.weight_version))

    def end(self, timeout_s: float) -> list:
        """Stop submitting; wait (``timeout_s`` per thread) for the requests in flight; every result."""
        self.stop.set()
        for w in self._workers:
            w.join(timeout=timeout_s)
        return self.results


class PairLoad:
    """``threads`` client threads, each submitting two requests at a time (rotating through ``prompts``) and
    collecting them, until ``stop``. Every result is kept (``results``); an exception in a thread is kept
    (``errors``), not raised, and ends that thread. The benchmarks and tests that measure a fleet under steady
    load (a controller restart, a re-admission) share it."""

    def __init__(self, fleet: Any, threads: int, sampling: dict, prompts: Sequence[Any]) -> None:
        self.fleet, self.sampling, self.prompts = fleet, sampling, list(prompts)
        self.results: list = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(threads)]
        for t in self._threads:
            t.start()

    def _loop(self, k: int) -> None:
        i, n = 0, len(self.prompts)
        while not self._stop.is_set():
            try:
                pending = [self.fleet.submit(self.prompts[(3 * k + i + j) % n], 1, self.sampling) for j in range(2)]
                for p in pending:
                    got = self.fleet.collect(p)
                    with self._lock:
                        self.results.extend(got)
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            i += 1

    def count(self, ok_only: bool = False) -> int:
        with self._lock:
            return sum(1 for r in self.results if r.ok) if ok_only else len(self.results)

    def stop(self, timeout_s: float = 300.0) -> list:
        """Stop submitting, wait (``timeout_s`` per thread) for the requests in flight; every result."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
        return list(self.results)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

