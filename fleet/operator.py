"""Fault injection on a running fleet: a handle for the fault matrix, the demo, the chaos soak and an
operator's drills, kept off the trainer's ``Fleet`` API.

``fleet.fault_injector()`` returns one. Its calls go to the controller the way ``Fleet``'s own do (waiting
for a restarted controller), and it fires nothing by itself: each call arms or does one thing.

- ``arm_fault(slot, point, action, ...)``: arm a fault at a shard's hook point (``fleet.shard.fault_hooks``);
- ``kill_shard(slot)``: kill the slot's current shard actor now (the controller finds it dead);
- ``arm_controller_crash(point, delay_s)``: the controller's process kills itself at a refit phase or
  the shutdown (``health.faultplan.CONTROLLER_WHERE``).

Each raises what the controller raised for a call it refuses (an unknown point or action, a slot
without an engine), naming it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class FaultInjector:
    def __init__(self, ask: Callable[..., Any]) -> None:
        self._ask = ask  # ``Fleet``'s call to its controller: ``ask(method, *args, timeout=...)``

    def arm_fault(self, slot: int, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0,
                  match: Sequence[int] | None = None) -> bool:
        """Arm a fault on ``slot`` (``fleet.shard.fault_hooks``); ``match``: the token ids of a ``poison`` prompt."""
        return self._ask("arm_fault", slot, point, action, delay_s, after_calls,
                         None if match is None else list(match), timeout=60)

    def kill_shard(self, slot: int) -> bool:
        """Kill ``slot``'s current shard actor; ``ValueError`` naming the slots with an engine if it has none."""
        return self._ask("kill_shard", slot, timeout=60)

    def arm_loop_fault(self, loop: str, times: int = 1) -> bool:
        """The next ``times`` ticks of the controller's background loop ``loop`` raise (``fleet.control.loops``)."""
        return self._ask("arm_loop_fault", loop, times, timeout=60)

    def arm_controller_crash(self, point: str, delay_s: float = 0.0) -> bool:
        """The controller's process kills itself at ``point`` (``SingleController.arm_crash``)."""
        return self._ask("arm_crash", point, delay_s, timeout=60)
