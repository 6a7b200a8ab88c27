"""Fault hooks inside an engine shard: where a fault plan acts on a real actor.

A shard calls ``hooks.at(point)`` at each hook point (start of ``pause``, ``resume``,
``set_weight_version``, ``generate``, ``ping``, and the weight receive inside
``worker_rpc``, point ``transfer``, a peer copy's receive included; a donor's side of a peer copy, point
``donate``, as its ``donate_weights`` begins). With nothing armed the shard skips the call
entirely (``if self._hooks.armed``), so code without an active plan pays nothing.
Point ``stream`` is mid-generation: a client's poll of its watched requests (``take_output``) reaches it
once for each request's chunk of output in the answer, before the answer leaves (not for results); with
``after_calls`` (chunks let through) or ``delay_s`` a fault there acts
while clients hold part of their output. It is called only for a fault armed at it (``armed_at``):
a ``slow`` shard is not slowed chunk by chunk.

Actions (each armed fault fires once, after ``after_calls`` matching calls; ``slow``
applies to every hooked call from the moment it is armed):

- ``kill``: the actor process exits at once (``os._exit``); its engine processes die with it.
  With ``delay_s`` the exit happens that long after the call began (mid-transfer).
- ``freeze``: the engine-core processes are stopped (SIGSTOP) and the actor's event
  loop blocks: the shard stops answering anything, as a wedged host would.
- ``hang``: this one call sleeps past any deadline; other calls still answer.
- ``false_ack``: this one call answers ``False`` instead of ``True``.
- ``slow``: every hooked call is delayed by ``delay_s``.
- ``delay``: this one call waits ``delay_s``, then goes on as usual; other calls are untouched (at
  ``donate``: a peer copy whose send is held back while its receiver waits in its receive, so a test can
  act in the middle of a copy; a ``slow`` shard would delay its probes too).
- ``crash_engine``: the engine-core process is killed (SIGKILL); the actor lives on and
  reports ``EngineCrashedError`` from then on.
- ``freeze_core``: the engine-core processes are stopped (SIGSTOP) and nothing else: the actor
  lives on and answers, its engine answers nothing (a wedged kernel, a stuck collective). The
  call that fired it goes on into the stopped engine. Its record names the ``engine_pids``.
- ``unavailable``: this one call raises ``ShardUnavailableError`` (the door reads it as
  ``unavailable``, like Ray's ``ActorUnavailableError``); other calls still answer.
- ``error``: this one call raises ``InjectedError`` (a ``RuntimeError``: the engine's own error, as a
  failing ``set_weight_version`` RPC would raise); the actor and its engine live on.
- ``poison`` (point ``generate``, with ``match``: token ids): a poison prompt. Every request
  whose prompt contains ``match`` crashes the engine while it runs there: once admitted, the
  engine-core processes are killed (SIGKILL) and the request fails with
  ``EngineCrashedError`` naming it (``request_id``), as a prompt that breaks the model's
  kernels would. It stays armed (every such request, not once); other prompts are untouched.

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
from typing import Callable, Sequence

from rlfleet.fleet.errors import EngineCrashedError, ShardUnavailableError

POINTS = ("pause", "resume", "set_weight_version", "generate", "ping", "transfer", "stream", "donate")
ACTIONS = ("kill", "freeze", "hang", "false_ack", "slow", "crash_engine", "unavailable", "error", "poison",
           "freeze_core", "delay")
ENGINE_DEATH_WAIT_S = 10.0  # a poisoned engine: how long to wait for the backend to see its core gone


class InjectedError(RuntimeError):
    """The ``error`` action: the call raised, as the engine's own failure would."""


@dataclass
class ArmedFault:
    point: str
    action: str
    delay_s: float = 0.0
    after_calls: int = 0
    match: tuple[int, ...] = ()  # ``poison``: the token ids whose presence in a prompt crashes the engine

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"fault point must be one of {POINTS}, got {self.point!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {self.action!r}")
        if self.delay_s < 0 or self.after_calls < 0:
            raise ValueError("fault delay_s and after_calls must be >= 0")
        if self.action == "delay" and self.delay_s <= 0:
            raise ValueError(f"fault action 'delay' holds its one call for delay_s seconds: give delay_s > 0 "
                             f"(got {self.delay_s!r})")
        if (self.action == "poison") != bool(self.match) or (self.match and self.point != "generate"):
            raise ValueError(f"fault match (token ids) goes with action 'poison' at point 'generate' and only "
                             f"there; got action {self.action!r} at {self.point!r} with match {list(self.match)}")


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

    def armed_at(self, point: str) -> bool:
        """A fault (other than ``slow``) waits at ``point``."""
        return any(f.point == point for f in self._armed)

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
            if fault.point != point or fault.action == "poison":  # a poison acts in ``poisoned``, once admitted
                continue
            if fault.after_calls > 0:
                fault.after_calls -= 1
                continue
            self._armed.remove(fault)
            self._record(point, fault)
            return await self._fire(fault)
        return False

    async def poisoned(self, tokens: Sequence[int], request_id: str, check_alive: Callable[[], None]) -> None:
        """If an armed ``poison`` matches ``tokens``: kill the engine cores under ``request_id``, wait (bounded)
        until ``check_alive`` raises, and raise ``EngineCrashedError`` naming the request. Else nothing."""
        fault = next((f for f in self._armed if f.action == "poison" and _contains(tokens, f.match)), None)
        if fault is None:
            return
        self._record("generate", fault)
        self._signal_engines(signal.SIGKILL)
        deadline = time.monotonic() + ENGINE_DEATH_WAIT_S
        while time.monotonic() < deadline:
            try:
                check_alive()
            except EngineCrashedError:
                break
            await asyncio.sleep(0.05)
        raise EngineCrashedError(f"engine core died during request {request_id}: poison fault (its prompt "
                                 f"contains {list(fault.match)})", request_id=request_id)

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
        elif action == "error":
            raise InjectedError(f"fault injected: slot {self._who['slot']} (incarnation {self._who['incarnation']}) "
                                f"raised at {fault.point}")
        elif action == "hang":
            await asyncio.sleep(10**6)
        elif action == "delay":
            await asyncio.sleep(fault.delay_s)
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

    def _signal_engines(self, sig: int) -> None:  # (also for ``poisoned``)
        for pid in self._engine_pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _contains(tokens: Sequence[int], match: Sequence[int]) -> bool:
    """``match`` occurs in ``tokens`` as a contiguous run."""
    n, m = len(tokens), len(match)
    return any(list(tokens[i:i + m]) == list(match) for i in range(n - m + 1)) if m else False
