"""Fault firing: the firings of a resolved fault plan carried out on a live fleet, step by step.

The demo, the fault runner and the chaos soak fire faults through ``FaultFiring``
only, so a firing means the same everywhere: a ``kill`` at the ``step_boundary``
is ``Fleet.kill_shard`` once the slot is up (healthy or stale; waited for up to
``up_timeout_s``, since killing a slot that is still restarting would hit
nothing); every other fault is armed with ``Fleet.arm_fault`` at the shard's hook
point for its ``where`` and goes off when the shard reaches that point.

On failure: a fleet call that fails raises to the caller (nothing is recorded as
fired); a slot that is not up in time is killed anyway, and the wait is logged.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Callable, Iterable

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from health.faultplan import Firing

# A plan's ``where`` -> the shard's fault hook point (a step-boundary fault other than a kill goes off at the next probe).
POINT_OF = {"pause": "pause", "transfer": "transfer", "resume": "resume", "generate": "generate", "step_boundary": "ping"}
UP = ("healthy", "stale")


def hook_point(where: str, what: str) -> str:
    """Where a firing goes off: ``step_boundary`` for the controller's own kill, else the shard's hook point."""
    return "step_boundary" if (where, what) == ("step_boundary", "kill") else POINT_OF[where]


def slot_states(status: dict) -> dict[int, str]:
    """Each slot's health state in a ``Fleet.status()``."""
    return {s["slot"]: s["state"] for s in status["ledger"]["slots"]}


def wait_until(predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.5) -> bool:
    """Poll ``predicate`` every ``poll_s`` until it is true (True) or ``timeout_s`` has passed (False)."""
    polling = Retrying(
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(poll_s),
        retry=retry_if_result(lambda ok: not ok),
        retry_error_callback=lambda state: False,
    )
    return bool(polling(lambda: bool(predicate())))


class FaultFiring:
    """Fires ``firings`` on ``fleet`` when the caller's loop reaches their step; keeps a record of what fired.

    ``fired``: one dict per firing done (the ``Firing``'s fields and ``t``, seconds since ``t0``): killed,
    or armed. An armed fault goes off later, if ever; ``faults.evidence.prove`` tells from the records.
    """

    def __init__(self, fleet, firings: Iterable[Firing] = (), log: Callable[[str], object] | None = None,
                 t0: float | None = None, up_timeout_s: float = 240.0) -> None:
        self.fleet = fleet
        self.firings = list(firings)
        self.log = log
        self.t0 = time.monotonic() if t0 is None else t0
        self.up_timeout_s = up_timeout_s
        self.fired: list[dict] = []

    def due(self, step: int) -> list[Firing]:
        """The firings planned for ``step``, in plan order."""
        return [f for f in self.firings if f.step == step]

    def beyond(self, step: int) -> list[Firing]:
        """The firings planned after ``step`` (a loop that ends at ``step`` never fires them)."""
        return [f for f in self.firings if f.step > step]

    def at(self, step: int) -> list[Firing]:
        """Fire every firing planned for ``step``; returns them."""
        due = self.due(step)
        for f in due:
            self.fire(f)
        return due

    def fire(self, f: Firing) -> None:
        if hook_point(f.where, f.what) == "step_boundary":
            if not wait_until(lambda: slot_states(self.fleet.status()).get(f.slot) in UP, self.up_timeout_s) and self.log:
                self.log(f"gave up waiting for slot {f.slot} up before the kill after {self.up_timeout_s:.0f} s")
            self.fleet.kill_shard(f.slot)
        else:
            self.fleet.arm_fault(f.slot, POINT_OF[f.where], f.what, f.delay_s)
        self.fired.append({**asdict(f), "t": round(time.monotonic() - self.t0, 3)})
