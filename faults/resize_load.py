"""Resize under full load: client threads submit without pause while the fleet grows by one engine, a
refit lands, and the fleet shrinks by one engine.

``resize_under_load(fleet, sync)`` starts ``threads`` client threads that each submit one request at a
time until told to stop, then:

1. grows the fleet by one (``Fleet.resize(size + 1)``): the new engine starts, stale;
2. runs ``sync()`` (one refit): it lands on the new engine too, which then serves;
3. waits (bounded) until the new engine has admitted requests since the refit and a request
   completed on it with the refit's version, and until the engine the shrink will remove (the
   highest slot: with every engine serving, ``health.resize.plan_resize`` removes it) holds
   ``HELD`` requests in flight, so that its drain has something to drain;
4. shrinks the fleet by one (``Fleet.resize(size)``), keeps the load on a little longer, stops.

The record says what happened, for ``faults.resize_evidence`` to judge:

- ``calls``: the refit call (``sync``'s record); ``resizes``: the two resize calls, each with its
  ``outcome`` (``ok`` or the error), ``began``/``ended`` and the summary ``Fleet.resize`` returned;
- ``added`` / ``removed``: the slots the grow added and the shrink removed;
- ``new_engine``: the added slot's incarnation, the requests its shard admitted between the end of
  the refit and the shrink (``admitted_after_refit``, from the shards' own counters), and the
  requests that completed on it tagged with the refit's version (``completed_on_version``);
- ``removed_state``: the removed slot's row in ``Fleet.status()`` afterwards;
- ``submitted`` / ``completed`` / ``returned``: the threads' requests and how they ended.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rlfleet.faults.polling import wait_until
from rlfleet.faults.load import ClientLoad

PROMPT = [1, 21, 31, 41, 51]
SAMPLING = {"max_tokens": 128, "ignore_eos": True, "temperature": 1.0}  # long enough to be in flight at a resize
HELD = 2  # requests the engine to remove should hold when the shrink begins (waited for, bounded)


def _resize(fleet: Any, n: int) -> dict:
    began = time.monotonic()
    try:
        summary, outcome, error = fleet.resize(n), "ok", None
    except Exception as exc:  # noqa: BLE001 - recorded for the proof, which fails the variant
        summary, outcome, error = {}, "failed", f"{type(exc).__name__}: {exc}"
    return {"n": n, "outcome": outcome, "error": error, "summary": summary, "began": round(began, 6),
            "ended": round(time.monotonic(), 6)}


def _in_flight(fleet: Any, slot: int) -> int:
    return int(fleet.shard_counters().get(slot, {}).get("in_flight", 0))


def resize_under_load(fleet: Any, sync: Callable[[], dict], threads: int = 6, settle_s: float = 0.5,
                      wait_s: float = 60.0) -> dict:
    size = fleet.status()["target_size"]
    load = ClientLoad(fleet, threads, PROMPT, SAMPLING, name="resize-load")
    time.sleep(settle_s)  # the load is running before the fleet grows
    grow = _resize(fleet, size + 1)
    added = grow["summary"].get("added", [])
    call = sync()
    new: dict[str, Any] = {"slot": added[0] if added else None}
    if added:
        slot = added[0]
        new["incarnation"] = next(s["incarnation"] for s in fleet.status()["ledger"]["slots"] if s["slot"] == slot)
        admitted = lambda: fleet.shard_counters().get(slot, {}).get("admitted", 0)  # noqa: E731
        at_refit = admitted()
        # both: a request the engine admitted as the refit resumed it, before ``at_refit`` was read, may be the one
        # that completed, and then the counter has not moved yet
        served = wait_until(lambda: load.completed_on(slot, new["incarnation"], call["version"]) > 0
                            and admitted() > at_refit, wait_s, 0.1)
        new["admitted_after_refit"] = admitted() - at_refit
        new["completed_on_version"] = load.completed_on(slot, new["incarnation"], call["version"])
        new["waited_for_it"] = bool(served)
    victim = max(s["slot"] for s in fleet.status()["ledger"]["slots"] if not s.get("removed"))
    busy = wait_until(lambda: _in_flight(fleet, victim) >= HELD, wait_s, 0.02)  # the drain has something to drain
    shrink = _resize(fleet, size)
    time.sleep(settle_s)  # and the load keeps running after it
    results = load.end(fleet.config.request_timeout_s + 60)
    removed = shrink["summary"].get("removed", [])
    rows = {s["slot"]: s for s in fleet.status()["ledger"]["slots"]}
    return {
        "calls": [call],
        "resizes": [grow, shrink],
        "size": size,
        "added": added,
        "removed": removed,
        "victim_busy": bool(busy),
        "new_engine": new,
        "removed_state": {str(s): rows.get(s) for s in removed},
        "threads": threads,
        "submitted": len(results),
        "completed": sum(1 for r in results if r.ok),
        "returned": [r.reason for r in results if not r.ok],
    }
