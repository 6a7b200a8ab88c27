"""Builders for tests of the health core and of code that drives it.

``ready_fleet`` returns a ledger in the state a controller reaches after launching
every slot and running its first refit: all slots HEALTHY on ``version``, gate open.
``feed`` applies several events in order. Both go through ``step`` only, so they
exercise the same rules as production and cannot build an unreachable state.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlfleet.health.config import HealthConfig
from rlfleet.health.core import step
from rlfleet.health.decision import Decision
from rlfleet.health.events import (
    EngineReady,
    Event,
    RefitFinished,
    RefitReport,
    RefitStarted,
    VersionCommitted,
)
from rlfleet.health.ledger import Ledger
from rlfleet.health.states import RefitResult

__all__ = ["feed", "ready_fleet", "refit"]


def feed(ledger: Ledger, events: Iterable[Event], now: float) -> list[Decision]:
    """Apply ``events`` in order at time ``now``; return their decisions."""
    return [step(ledger, event, now) for event in events]


def refit(
    ledger: Ledger,
    version: int,
    now: float,
    results: dict[int, RefitResult] | None = None,
    *,
    commit: bool = True,
) -> list[Decision]:
    """Run one refit of ``version`` over every live slot: COMPLETE for each unless
    ``results`` says otherwise, then commit (if ``commit``) and finish."""
    results = results or {}
    events: list[Event] = [RefitStarted(version)]
    for status in ledger.records():
        if status.state.value in ("healthy", "stale"):
            result = results.get(status.slot, RefitResult.COMPLETE)
            events.append(RefitReport(status.slot, status.incarnation, version, result))
    if commit:
        events.append(VersionCommitted(version))
    events.append(RefitFinished(version))
    return feed(ledger, events, now)


def ready_fleet(config: HealthConfig, *, version: int = 0, now: float = 0.0) -> Ledger:
    """A ledger with every slot ready and HEALTHY on ``version``, gate open."""
    ledger = Ledger(config, now=now)
    feed(ledger, (EngineReady(s, ledger.raw(s).incarnation) for s in range(ledger.num_slots)), now)
    refit(ledger, version, now)
    return ledger
