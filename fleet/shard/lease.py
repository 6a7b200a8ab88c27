"""A shard's lease on its routing state: how long what the controller last told it may be trusted.

A shard knows its membership, its routing floor and the fleet's committed version only from the
controller's words (``set_route``, ``fence``, ``begin_refit``, ``end_refit`` and the monitor's ``ping``
with its routing epoch, every ``monitor_interval_s``). Cut off from the controller while a lagging client
still reaches it, those never change again: a refit commits elsewhere, the controller evicts the shard
(its kill cannot reach it either) and publishes a state without it, and the lagging client, routing by an
older state, gets ``latest`` samples from the old weights, served as current.

The lease bounds that. Every word from the controller renews it; the controller grants its term
(``FleetConfig.routing_lease_s``: the longest it may legitimately stay silent, a refit or its own restart,
plus one monitor round) when it tells the shard it serves. Once the term passes with no word, the shard
refuses, without running it, work whose version policy binds it to the committed version
(``VersionPolicy.bound``: ``latest`` and ``max_staleness=k``; the shard can no longer say what the committed
version is) with the retryable reason ``unheard`` (``fleet.shard.request_gate``); the client routes it to
another shard. Work under ``any`` runs: any weights meet it. The next word renews the lease.

Pure: no Ray, no engine, no clock of its own (``clock`` is injected: the shard's, a virtual loop's).
Guarantee on failure: a lease no controller granted never lapses (a shard driven by hand, a test), and a
term that is not a finite number of seconds > 0 is refused with ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

__all__ = ["RoutingLease"]


class RoutingLease:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._now = clock
        self.term_s: float | None = None  # granted by the controller; None: never granted, never lapses
        self.heard_at: float | None = None  # when the controller's last word came (the clock's time)
        self.lapses = 0  # how many times it lapsed (counted when found lapsed after a word)
        self._counted = False

    def renew(self, term_s: float | None = None) -> None:
        """A word from the controller, now; ``term_s``: the term it grants (None: the one it granted before)."""
        if term_s is not None:
            if isinstance(term_s, bool) or not isinstance(term_s, (int, float)) or not (0 < term_s < math.inf):
                raise ValueError(f"lease term_s must be a finite number of seconds > 0, got {term_s!r}")
            self.term_s = float(term_s)
        self.heard_at = self._now()
        self._counted = False

    def silent_s(self) -> float | None:
        """Seconds since the controller's last word (None: never heard)."""
        return None if self.heard_at is None else self._now() - self.heard_at

    def lapsed(self) -> bool:
        """The term passed with no word from the controller: what it told this shard may be out of date."""
        if self.term_s is None or self.heard_at is None or self._now() - self.heard_at <= self.term_s:
            return False
        if not self._counted:
            self.lapses += 1
            self._counted = True
        return True

    def describe(self) -> str:
        silent = self.silent_s()
        heard = "nothing heard from the controller yet" if silent is None else \
            f"nothing heard from the controller for {silent:.1f} s"
        return f"{heard}, past its lease on the routing state ({self.term_s:g} s)"

    def facts(self) -> dict[str, Any]:
        """What ``describe`` and the invariant checker read: the term, the silence, whether it lapsed."""
        silent = self.silent_s()
        return {"term_s": self.term_s, "silent_s": None if silent is None else round(silent, 3),
                "lapsed": self.lapsed(), "lapses": self.lapses}
