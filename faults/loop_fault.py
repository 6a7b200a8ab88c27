"""A controller loop that raises, then a death only that loop can find (issue 46: no control loop dies).

``loop_error_then_kill(fleet)``: the next ticks of the controller's liveness monitor raise (injected,
``SingleController.arm_loop_fault``); once they have, one serving engine's actor is killed from outside with
no request in flight, so nothing but the monitor's pings can find it (the death's record says ``during probe``). The monitor must have gone on after the
errors: the slot is found dead within the hang-detection bound, and restarted.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from rlfleet.faults.polling import wait_until
from rlfleet.fleet.records import Health, LoopError, Record

LOOP = "liveness monitor"
RAISES = 2  # ticks that raise before the kill


def loop_error_then_kill(fleet, say: Callable[[str], Any] = print) -> dict:
    faults = fleet.fault_injector()
    t0 = time.monotonic()
    faults.arm_loop_fault(LOOP, RAISES)

    def raised() -> list:
        return [e for e in LoopError.among(fleet.events(kinds=[LoopError])) if e.loop == LOOP and e.t >= t0]

    wait_until(lambda: len(raised()) >= RAISES, 60.0)
    status = fleet.status()
    slot = status["serving"][-1]
    inc = next(s["incarnation"] for s in status["ledger"]["slots"] if s["slot"] == slot)
    killed_at = time.monotonic()
    faults.kill_shard(slot)
    bound = status["hang_detection_bound_s"]

    def death() -> Health | None:
        return next((h for h in Health.among(fleet.events(kinds=[Health]))
                     if h.slot == slot and h.t >= killed_at and h.after in ("dead", "restarting", "retired")), None)

    seen = wait_until(lambda: death() is not None, bound + 30.0)
    how = death()
    found_at = time.monotonic()
    errors = raised()
    say(f"loop error then kill: {len(errors)} tick(s) of the {LOOP} raised; slot {slot} (incarnation {inc}) killed, "
        f"found dead {seen} after {found_at - killed_at:.1f} s (bound {bound:g} s)")
    call = {"version": None, "outcome": "found" if seen else "missed", "error": None, "began": round(t0, 6),
            "ended": round(found_at, 6)}
    return {"calls": [call], "loop": LOOP, "raised": len(errors), "errors": [e.error for e in errors][:3],
            "last_error_t": max((e.t for e in errors), default=None), "slot": slot, "incarnation": inc,
            "killed_at": round(killed_at, 6), "found": seen, "found_by": None if how is None else how.reason[:200], "found_after_s": round(found_at - killed_at, 3),
            "bound_s": bound}


def prove_loop_error_then_kill(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong = []
    if f["raised"] < RAISES:
        wrong.append(f"the {f['loop']} loop logged {f['raised']} error(s), {RAISES} injected: the fault did not fire")
    elif f["last_error_t"] is None or f["last_error_t"] > f["killed_at"]:
        wrong.append("the kill came before the loop's injected errors")
    if not f["found"]:
        wrong.append(f"slot {f['slot']} (incarnation {f['incarnation']}) killed with no traffic was never found dead: "
                     f"the {f['loop']} loop died at its error")
    elif "during probe" not in (f["found_by"] or ""):
        wrong.append(f"slot {f['slot']} was found dead by something other than the monitor's probe: {f['found_by']}")
    elif f["found_after_s"] > f["bound_s"] + 5.0:
        wrong.append(f"slot {f['slot']} found dead {f['found_after_s']} s after its kill, past the hang-detection "
                     f"bound {f['bound_s']} s")
    return wrong
