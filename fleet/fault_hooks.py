"""Fault hooks inside an engine shard: where a fault plan acts on a real actor.

A shard calls ``hooks.at(point)`` at each hook point (start of ``pause``, ``resume``,
``set_weight_version``, ``generate``, ``ping``, and the weight receive inside
``worker_rpc``, point ``transfer``). With nothing armed the shard skips the call
entirely (``if self._hooks.armed``), so code without an active plan pays nothing.

Actions (each armed fault fires once, after ``after_calls`` matching calls; ``slow``
applies to every hooked call from the moment it is armed):

- ``kill``: the actor process exits at once (``os._exit``); its engine processes die with it.
  With ``delay_s`` the exit happens that long after the call began (mid-transfer).
- ``freeze``: the engine-core processes are stopped (SIGSTOP) and the actor's event
  loop blocks: the shard stops answering anything, as a wedged host would.
- ``hang``: this one call sleeps past any deadline; other calls still answer.
- ``false_ack``: this one call answers ``False`` instead of ``True``.
- ``slow``: every hooked call is delayed by ``delay_s``.
- ``crash_engine``: the engine-core process is killed (SIGKILL); the actor lives on and
  reports ``EngineCrashedError`` from then on.
- ``freeze_core``: the engine-core processes are stopped (SIGSTOP) and nothing else: the actor
  lives on and answers, its engine answers nothing (a wedged kernel, a stuck collective). The
  call that fired it goes on into the stopped engine. Its record names the ``engine_pids``.
- ``unavailable``: this one call raises ``ShardUnavailableError`` (the door reads it as
  ``unavailable``, like Ray's ``ActorUnavailableError``); other calls still answer.

The fault journal: when the shard's config names one (``EngineConfig.fault_journal``),
every fault that goes off is first appended to it as one JSON line (``t`` from
``time.monotonic()``, the event log's clock on the same host; ``wall``; slot,
incarnation, point, action, delay, pid) and fsynced, and only then acts, so the
record outlives a kill or a crash. ``slow`` is recorded once, at its first delayed
call. Arming with a journal that cannot be opened raises ``OSError`` naming the path,
before anything is armed; a journal write that fails at a hook raises from that call.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from fleet.errors import ShardUnavailableError

POINTS = ("pause", "resume", "set_weight_version", "generate", "ping", "transfer")
ACTIONS = ("kill", "freeze", "hang", "false_ack", "slow", "crash_engine", "unavailable", "freeze_core")


@dataclass
class ArmedFault:
    point: str
    action: str
    delay_s: float = 0.0
    after_calls: int = 0

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"fault point must be one of {POINTS}, got {self.point!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {self.action!r}")
        if self.delay_s < 0 or self.after_calls < 0:
            raise ValueError("fault delay_s and after_calls must be >= 0")


class FaultHooks:
    def __init__(self, engine_pids: Callable[[], list[int]], slot: int = -1, incarnation: int = 0,
                 journal: str | None = None) -> None:
        self._engine_pids = engine_pids
        self._who = {"slot": slot, "incarnation": incarnation}
        self._journal = journal
        self._armed: list[ArmedFault] = []
        self._slow: ArmedFault | None = None
        self._slow_recorded = False
        self.fired: list[dict] = []

    @property
    def armed(self) -> bool:
        return bool(self._armed) or self._slow is not None

    def arm(self, fault: ArmedFault) -> None:
        if self._journal:
            os.close(os.open(self._journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))  # refuse early
        if fault.action == "slow":  # every hooked call, from now on
            self._slow, self._slow_recorded = fault, False
            return
        self._armed.append(fault)

    async def at(self, point: str) -> bool:
        """Run the hook for ``point``. Returns True when the call must answer ``False`` (a lie); raises
        ``ShardUnavailableError`` for ``unavailable``."""
        if self._slow is not None:
            if not self._slow_recorded:
                self._slow_recorded = True
                self._record(point, self._slow)
            await asyncio.sleep(self._slow.delay_s)
        for fault in list(self._armed):
            if fault.point != point:
                continue
            if fault.after_calls > 0:
                fault.after_calls -= 1
                continue
            self._armed.remove(fault)
            self._record(point, fault)
            return await self._fire(fault)
        return False

    def _record(self, point: str, fault: ArmedFault) -> None:
        """Keep the firing, and make it durable in the journal before the fault acts."""
        rec = {"t": round(time.monotonic(), 6), "wall": round(time.time(), 6), **self._who, "point": point,
               "action": fault.action, "delay_s": fault.delay_s, "pid": os.getpid()}
        if fault.action == "freeze_core":
            rec["engine_pids"] = list(self._engine_pids())
        self.fired.append(rec)
        if self._journal:
            fd = os.open(self._journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(rec) + "\n").encode())  # one O_APPEND write: lines never interleave
                os.fsync(fd)
            finally:
                os.close(fd)

    async def _fire(self, fault: ArmedFault) -> bool:
        action = fault.action
        if action == "false_ack":
            return True
        elif action == "unavailable":
            raise ShardUnavailableError(
                f"fault injected: slot {self._who['slot']} (incarnation {self._who['incarnation']}) "
                f"unavailable at {fault.point}"
            )
        elif action == "hang":
            await asyncio.sleep(10**6)
        elif action == "kill":
            if fault.delay_s:
                threading.Timer(fault.delay_s, os._exit, args=(137,)).start()
            else:
                os._exit(137)
        elif action == "crash_engine":
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            self._signal_engines(signal.SIGKILL)
        elif action == "freeze_core":
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            self._signal_engines(signal.SIGSTOP)
        elif action == "freeze":
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            self._signal_engines(signal.SIGSTOP)
            time.sleep(10**6)  # blocks the actor's event loop: nothing answers any more
        return False

    def _signal_engines(self, sig: int) -> None:
        for pid in self._engine_pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
