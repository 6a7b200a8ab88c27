"""``RefitRun``: one refit's state, in one object, and the tools its steps share.

A refit's steps (``fleet.control.lifecycle.pause``, ``.transfer``, ``.resume``) are functions of a run:
what the refit paused and holds, what each phase took, whether bytes may have moved, the deadline its
fan-outs end by. The long-lived ``RefitLifecycle`` keeps none of it; a new run starts empty. The tools:
``fan_out`` (every call through the door, bounded, timed as time inside the shards), ``within`` (one
deadline for a phase's several fan-outs), and ``phase`` (a phase's records, timing and crash point).

The three ways out of a step are the exceptions here, each handled in one place (``RefitLifecycle.run``):
``RollBack`` (nothing reached an engine's live weights), ``EndRefit`` (stop with the gate closed) and
``PhaseOver`` (a fan-out asked to start after its phase's deadline).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rlfleet.fleet import records as ev
from rlfleet.fleet.control.parts import Parts
from rlfleet.fleet.control.publisher import RoutingPublisher
from rlfleet.fleet.control.transfer_port import TransferPort
from rlfleet.fleet.errors import FleetStopped
from rlfleet.fleet.outcome import Outcome


class RollBack(Exception):
    """Raised inside a step when nothing reached any engine and the refit must not go on
    (e.g. the update itself was refused); ``run`` rolls back and raises ``error`` to the caller."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class PhaseOver(Exception):
    """Raised by a fan-out asked to start after its phase's deadline (``RefitRun.within``)."""


class EndRefit(Exception):
    """Raised inside a step to end the refit without reopening; ``RefitLifecycle.run`` handles it in one place."""

    def __init__(self, error: type[FleetStopped], message: str) -> None:
        super().__init__(message)
        self.error, self.message = error, message


@dataclass(eq=False)
class RefitRun:
    """The refit of ``version``: its parts, its port to the weight transport, and everything it learns."""

    p: Parts
    publisher: RoutingPublisher
    port: TransferPort
    version: int
    crash_point: Callable[[str], None] = lambda point: None
    warn_once: Callable[[str], None] = lambda message: None
    phase_name: str | None = None  # the step running now (``stage`` or one of ``PHASES``)
    holding: bool = False  # the refit holds the gate closed (from ``close`` on); while it stages, the fleet serves
    phases: dict[str, float] = field(default_factory=dict)
    inside_s: float = 0.0  # time spent on the shards' calls (RPC round trips included)
    inside_cpu_s: float = 0.0  # this thread's CPU time during those calls (its own share of them)
    finished: bool = False  # the ledger closed the refit (``RefitFinished`` or ``RefitRolledBack``)
    moving: bool = False  # the transfer began: engines may hold bytes of the new version
    held: dict[tuple[int, int], Any] = field(default_factory=dict)  # (slot, incarnation) -> handle it paused
    busy: dict[int, int] = field(default_factory=dict)  # slot -> requests in flight when the refit fenced it
    aborted: int = 0  # requests the refit aborted as too old for their version policy
    fence_epoch: int = -1  # the routing epoch the refit closed the gate at: shards refuse work routed before it
    deadline: float | None = None  # inside ``within``: the deadline every fan-out ends by
    retry_skipped: str | None = None  # why the transfer's retry did not run (None: it ran or was not needed)

    async def fan_out(self, calls: dict, expect_ack: bool = False, timeout: float | None = None) -> dict[Any, Outcome]:
        """The door's bounded fan-out; inside ``within`` no call waits past the phase's deadline."""
        if not calls:
            return {}
        timeout = timeout or self.p.cfg.lifecycle_deadline_s
        if self.deadline is not None:
            left = self.deadline - self.p.clock.now()
            if left <= 0:
                raise PhaseOver(f"{self.phase_name} phase's deadline passed; no call started")
            timeout = min(timeout, left)
        with self.inside_shards():
            return await self.p.door.fan_out(calls, timeout=timeout, expect_ack=expect_ack)

    def handle(self, p: Any) -> Any:
        """The actor handle of participant ``p``'s slot now."""
        return self.p.slots.handles[p.slot][1]

    @contextmanager
    def within(self, deadline: float) -> Iterator[None]:
        """Every fan-out inside ends by ``deadline`` (its timeout is cut to what is left); none starts after
        it (``PhaseOver``). One deadline for a phase's several fan-outs."""
        self.deadline = deadline
        try:
            yield
        finally:
            self.deadline = None

    @contextmanager
    def inside_shards(self) -> Iterator[None]:
        """Time spent on the shards' calls, wall and this thread's CPU: what ``overhead_s`` and
        ``controller_cpu_s`` leave out."""
        t0, cpu0 = self.p.clock.now(), time.thread_time()
        try:
            yield
        finally:
            self.inside_s += self.p.clock.now() - t0
            self.inside_cpu_s += time.thread_time() - cpu0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """One phase: its begin and end records, its time (summary and metric), and its crash point."""
        t0 = self.p.clock.now()
        self.p.log.emit(ev.Phase(phase=name, edge="begin", version=self.version))
        self.phase_name = name
        self.crash_point(name)
        try:
            yield
        finally:
            self.phase_name = None
            dt = self.p.clock.now() - t0
            self.phases[name] = dt
            self.p.metrics.phase(name, dt)
            self.p.log.emit(ev.Phase(phase=name, edge="end", version=self.version, seconds=round(dt, 6)))
