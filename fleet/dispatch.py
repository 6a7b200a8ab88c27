"""The request path: accept a prompt, wait for the gate, route, send, and account for it.

Guarantee: every accepted request ends exactly once, either ``completed`` (with a
result tagged by the weight version, slot and incarnation that produced it) or
``returned`` with an explicit reason (bad request, redispatch budget spent, fleet
stopped, timed out waiting). A request whose shard died, hung, or aborted it
(pause with abort, staleness abort, shutdown) is re-queued and sent again, up to
``max_redispatch`` times. The counters make "lost" computable at any moment:
``lost = accepted - completed - returned - in_progress`` and must stay 0.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from fleet.errors import BadRequestError
from fleet.eventlog import EventLog
from fleet.gate import DispatchGate
from fleet.outcome import Outcome
from fleet.router import pick_shard
from fleet.types import GenerationResult
from health import CallKind, Clock, MonotonicClock

COMPLETED, RETURNED = "completed", "returned"


@dataclass(frozen=True)
class FleetResult:
    """The end of one accepted request: ``completed`` with ``result``, or ``returned`` with ``reason``."""

    request_id: str
    status: str
    result: GenerationResult | None = None
    reason: str = ""
    attempts: int = 0
    accepted_version: int = 0
    latency_s: float = 0.0
    queue_s: float = 0.0  # acceptance -> the last dispatch to a shard (latency_s - queue_s: time on the shard)

    @property
    def ok(self) -> bool:
        return self.status == COMPLETED


class FleetView(Protocol):
    """What the dispatcher needs from the controller."""

    door: Any
    gate: DispatchGate
    stopped: str | None
    admission: Any

    def serving(self) -> Sequence[tuple[int, int, Any]]: ...

    def caps(self) -> dict[int, int]: ...

    def cache_salt(self, version: int) -> str | None: ...

    def observe(self, slot: int, incarnation: int, call: CallKind, outcome: Outcome) -> Any: ...


@dataclass
class _Pending:
    request_id: str
    prompt: Any
    sampling: dict
    accepted_at: float
    accepted_version: int
    attempts: int = 0
    reasons: list[str] = field(default_factory=list)
    dispatched_at: float | None = None


class Dispatcher:
    def __init__(
        self, view: FleetView, log: EventLog, request_timeout_s: float, max_redispatch: int, clock: Clock | None = None
    ) -> None:
        self._view = view
        self._clock = clock or MonotonicClock()
        self._log = log
        self._timeout = request_timeout_s
        self._max_redispatch = max_redispatch
        self._ids = itertools.count()
        self._room = asyncio.Condition()
        self.accepted = 0
        self.completed = 0
        self.returned = 0
        self.returned_reasons: Counter[str] = Counter()
        self.requeued = 0
        # slot -> {request_id: (incarnation, version at dispatch)}
        self.outstanding: dict[int, dict[str, tuple[int, int]]] = {}

    # -- accounting ----------------------------------------------------------------
    @property
    def in_progress(self) -> int:
        return self.accepted - self.completed - self.returned

    def counters(self) -> dict[str, int]:
        return {
            "accepted": self.accepted,
            "completed": self.completed,
            "returned": self.returned,
            "in_progress": self.in_progress,
            "requeued": self.requeued,
        }

    def load(self) -> dict[int, int]:
        return {slot: len(reqs) for slot, reqs in self.outstanding.items()}

    async def notify_room(self) -> None:
        """Wake requests waiting for a shard with room (call after caps or membership changed)."""
        async with self._room:
            self._room.notify_all()

    # -- the request path ----------------------------------------------------------
    async def submit(self, prompt: Any, sampling: dict | None = None, request_id: str | None = None) -> FleetResult:
        """Accept one request and see it to its end. Never raises for fleet failures."""
        p = _Pending(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt=prompt,
            sampling=dict(sampling or {}),
            accepted_at=self._clock.now(),
            accepted_version=self._view.gate.version,
        )
        self.accepted += 1
        self._log.emit("request", event="accepted", request_id=p.request_id)
        deadline = p.accepted_at + self._timeout
        while True:
            verdict = await self._attempt(p, deadline)
            if isinstance(verdict, FleetResult):
                return verdict
            p.reasons.append(verdict)
            if p.attempts > self._max_redispatch:
                return self._return(p, f"redispatch budget ({self._max_redispatch}) spent: {'; '.join(p.reasons)}")
            self.requeued += 1
            self._log.emit("request", event="requeued", request_id=p.request_id, reason=verdict)

    async def _attempt(self, p: _Pending, deadline: float) -> FleetResult | str:
        """One dispatch. Returns the final result, or a reason string to retry."""
        target = await self._acquire(p, deadline)
        if isinstance(target, FleetResult):
            return target
        slot, incarnation, handle = target
        version = self._view.gate.version
        p.attempts += 1
        p.dispatched_at = self._clock.now()
        rid = f"{p.request_id}#{p.attempts}"
        self.outstanding.setdefault(slot, {})[rid] = (incarnation, version)
        self._view.admission.on_dispatch(slot, incarnation)
        try:
            outcome = await self._view.door.call(
                handle,
                "generate",
                p.prompt,
                p.sampling,
                request_id=rid,
                cache_salt=self._view.cache_salt(version),
                timeout=max(1.0, deadline - self._clock.now()),
            )
        finally:
            self.outstanding.get(slot, {}).pop(rid, None)
            self._view.admission.on_finish(slot, incarnation)
            await self.notify_room()
        if outcome.ok:
            result: GenerationResult = outcome.value
            if result.aborted:
                return f"aborted on slot {slot} (incarnation {incarnation})"
            return self._complete(p, result)
        if isinstance(outcome.error, BadRequestError):
            return self._return(p, f"bad request: {outcome.error}")
        self._view.observe(slot, incarnation, CallKind.GENERATE, outcome)
        return f"slot {slot} (incarnation {incarnation}) failed: {outcome.describe()}"

    async def _acquire(self, p: _Pending, deadline: float):
        """Wait for an open gate and a serving shard with room; or the explicit return of ``p``."""
        while True:
            if self._view.stopped:
                return self._return(p, f"fleet stopped: {self._view.stopped}")
            left = deadline - self._clock.now()
            if left <= 0:
                return self._return(p, f"no serving shard within the request timeout ({self._timeout:.0f} s)")
            if not await self._view.gate.wait_open(min(left, 1.0)):
                continue
            serving = self._view.serving()
            slot = pick_shard([s for s, _, _ in serving], self.load(), self._view.caps())
            if slot is not None:
                return next(t for t in serving if t[0] == slot)
            async with self._room:
                try:
                    await asyncio.wait_for(self._room.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass

    def _complete(self, p: _Pending, result: GenerationResult) -> FleetResult:
        self.completed += 1
        self._log.emit(
            "request",
            event="completed",
            request_id=p.request_id,
            slot=result.slot,
            incarnation=result.incarnation,
            version=result.weight_version,
            version_start=result.version_start,
        )
        now = self._clock.now()
        return FleetResult(
            p.request_id, COMPLETED, result, attempts=p.attempts, accepted_version=p.accepted_version,
            latency_s=now - p.accepted_at, queue_s=(p.dispatched_at or now) - p.accepted_at,
        )

    def _return(self, p: _Pending, reason: str) -> FleetResult:
        self.returned += 1
        self.returned_reasons[reason.split(":")[0]] += 1
        self._log.emit("request", event="returned", request_id=p.request_id, reason=reason)
        return FleetResult(
            p.request_id, RETURNED, None, reason, p.attempts, p.accepted_version, self._clock.now() - p.accepted_at
        )

    def in_flight_on(self, slot: int) -> dict[str, tuple[int, int]]:
        return dict(self.outstanding.get(slot, {}))
