"""Fault injection on the controller, for the fault matrix and drills (``fleet.operator.FaultInjector`` calls
these through the controller's handle): faults armed in a shard, a background loop's ticks that raise, a
shard's process killed now, and the controller's own crash at a refit phase. A mixin of ``SingleController``:
none of it is part of running a fleet.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfleet.fleet import records as ev
from rlfleet.fleet.outcome import ERROR, TIMED_OUT

# Arming a fault is an operator's call, not a health probe: a shard busy starting or serving may take longer
# than ``probe_timeout_s`` (a hang variant's is 3 s) to answer it, and that says nothing about its health.
ARM_FAULT_TIMEOUT_S = 30.0


class ControllerFaults:
    """The controller's fault-injection methods (``self`` is the ``SingleController``)."""

    slots: Any
    door: Any
    log: Any
    cfg: Any
    lifecycle: Any
    _loop_faults: Any
    _crash_at: tuple[str, float] | None

    async def adopt_if_restarted(self) -> None: ...

    async def arm_fault(self, slot: int, point: str, action: str, delay_s: float = 0.0, after_calls: int = 0,
                        match: list[int] | None = None) -> bool:
        """Arm a fault in the current incarnation of ``slot`` (see ``fleet.shard.fault_hooks``)."""
        await self.adopt_if_restarted()
        inc, handle = self.slots.handles[slot]
        bound = max(self.cfg.probe_timeout_s, ARM_FAULT_TIMEOUT_S)
        out = await self.door.call(handle, "arm_fault", point, action, delay_s, after_calls, match, timeout=bound)
        self.log.emit(ev.Fault(slot=slot, incarnation=inc, point=point, action=action, armed=out.ok))
        if out.kind == ERROR and out.error is not None:
            raise out.error  # the shard refused it (an unknown point or action), naming it
        if not out.ok:
            what = (f"arm_fault({point!r}, {action!r}) on slot {slot} (incarnation {inc}) failed: "
                    f"{out.describe()[:300]}; nothing was armed (bound {bound:g} s)")
            raise TimeoutError(what) if out.kind == TIMED_OUT else RuntimeError(what)
        return True

    def arm_loop_fault(self, loop: str, times: int = 1) -> bool:
        """Fault injection: the next ``times`` ticks of background loop ``loop`` raise (``fleet.control.loops``)."""
        return self._loop_faults.arm(loop, times)

    async def kill_shard(self, slot: int) -> bool:
        """Kill the current incarnation's actor process now (a fault at a step boundary)."""
        handles = self.slots.handles
        if isinstance(slot, bool) or slot not in handles:
            raise ValueError(f"kill_shard: no engine runs in slot {slot!r}; slots with one: {sorted(handles)}")
        inc, handle = handles[slot]
        self.log.emit(ev.Fault(slot=slot, incarnation=inc, point="step_boundary", action="kill", armed=True))
        self.door.kill(handle)
        return True

    def arm_crash(self, point: str, delay_s: float = 0.0) -> bool:
        """Fault injection: kill this controller's process (SIGKILL) ``delay_s`` after it reaches ``point``:
        the beginning of a refit phase (``stage`` under ``stage_ahead``, ``close``, ``staleness``, ``reconcile``,
        ``pause``, ``transfer``, ``stamp``, ``resume``, ``reopen``) or the middle of ``shutdown``. With a delay
        the process dies while that phase's calls are in flight. Not stored: the restarted controller is not armed."""
        from rlfleet.fleet.control.lifecycle import PHASES

        points = ("stage",) + PHASES + ("shutdown",)
        if point not in points:
            raise ValueError(f"arm_crash: point must be one of {points}, got {point!r}")
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not 0 <= delay_s < 600:
            raise ValueError(f"arm_crash: delay_s must be a number of seconds in [0, 600), got {delay_s!r}")
        self._crash_at = (point, float(delay_s))
        self.log.emit(ev.Fault(target="controller", point=point, action="crash", delay_s=delay_s, armed=True))
        return True

    def crash_point(self, point: str) -> None:
        if self._crash_at is None or self._crash_at[0] != point:
            return
        delay = self._crash_at[1]
        self._crash_at = None
        if delay:
            asyncio.get_running_loop().call_later(delay, self._crash, point)
        else:
            self._crash(point)

    def _crash(self, point: str) -> None:
        import os
        import signal

        if point != "shutdown" and self.lifecycle.phase != point:  # a delayed crash only fires inside its phase
            self.log.emit(ev.Fault(target="controller", point=point, action="crash", fired=False,
                          reason=f"the {point} phase had ended when the delay ran out"))
            return
        self.log.emit(ev.Fault(target="controller", point=point, action="crash", fired=True, pid=os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
