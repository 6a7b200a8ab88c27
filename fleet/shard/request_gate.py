"""The gate each shard enforces on the requests sent straight to it (pure, no Ray, no engine).

A shard admits a request only if the ticket it carries (``fleet.data.routing_state.Ticket``)
agrees with what the controller last told the shard:

- ``paused``: the shard is paused for a refit;
- ``not_member``: the controller took it out of the serving set (fenced, stale, evicted);
- ``epoch``: the request was routed under an epoch older than the shard's floor (the
  routing state changed for this shard since: a refit began, or it rejoined);
- ``unheard``: the request's version policy binds it to the committed version (``VersionPolicy.bound``) and
  the shard's lease on its routing state lapsed (``fleet.shard.lease``): nothing heard from the controller
  for longer than the term it granted, so the committed version it knows may be out of date;
- ``version``: the shard's weights do not meet the request's version policy;
- ``full``: the shard holds as many requests as its admission cap allows. The cap is the
  one the controller published, carried by the tickets; the newest routing epoch's cap
  wins, so however many clients route here, the shard never holds more than that;
- ``suspect``: the request is suspect (an engine already died under it or under its fingerprint:
  its ticket says so, with its allowance) and the shard runs as many such requests, from any
  client, as its allowance or theirs admits (``fleet.data.suspects.may_join``). An engine core
  that dies takes every request it ran with it, each one counted against; a death counts toward
  poison only against the one suspect on its engine (allowance 1), so the shard must never let a
  second one beside it (``fleet.data.poison``);
- ``poison``: the request's fingerprint (``fleet.data.poison``) is one a client found took down
  two engines and told this shard about (``remember_poison``), within its window. Not
  retryable: the client returns the request as poison.

A refused request never runs; the client refreshes its routing state and re-routes.
A request without a ticket (an operator's or a test's direct call) is refused only
while paused. ``RecentResults`` makes request ids idempotent: a re-sent id that
completed returns the same result, and one still running joins the running call.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Callable, Collection, Mapping

from rlfleet.fleet.data.routing_state import Ticket
from rlfleet.fleet.data.suspects import may_join
from rlfleet.fleet.shard.lease import RoutingLease

PAUSED, NOT_MEMBER, EPOCH, VERSION, FULL = "paused", "not_member", "epoch", "version", "full"
UNHEARD = "unheard"  # its lease on the routing state lapsed: a request bound to a version goes elsewhere
SUSPECT = "suspect"  # the suspects running here, or this one, allow no more beside them
POISON = "poison"  # (``fleet.data.poison.POISON``)


class ShardGate:
    def __init__(self, lease: RoutingLease | None = None) -> None:
        """``lease``: the shard's lease on what the controller told it (default: one on the monotonic clock)."""
        self.lease = lease or RoutingLease()
        self.paused = False
        self.member = False
        self.floor = 0  # lowest routing epoch admitted
        self.routed_at = 0  # the epoch of the last membership word heard
        self.committed = 0  # the fleet's committed version, as last told
        self.refused: Counter[str] = Counter()
        self.admitted = 0
        self.cap: int | None = None  # the admission cap of the newest routing state seen on a ticket
        self._cap_epoch = -1
        self.peak_in_flight = 0  # the most requests held at once since the shard started
        self._poison: dict[str, float] = {}  # fingerprint -> until (the caller's clock)

    def refusal(self, ticket: Ticket | None, version: int, in_flight: int = 0,
                suspects: Collection[int] = ()) -> str | None:
        """Why a request with ``ticket`` must not run on weights ``version`` now, with ``in_flight``
        requests held (``suspects``: the allowances of those that are suspect), or None to admit it."""
        if self.paused:
            return PAUSED
        if ticket is None:
            return None
        if not self.member:
            return NOT_MEMBER
        if ticket.epoch < self.floor:
            return EPOCH
        if ticket.policy.bound and self.lease.lapsed():
            return UNHEARD
        if not ticket.policy.allows(version, self.committed):
            return VERSION
        if self.cap is not None and in_flight >= self.cap:
            return FULL
        if ticket.suspect and not may_join(suspects, ticket.suspect):
            return SUSPECT
        return None

    def admit(self, ticket: Ticket | None, version: int, in_flight: int = 0,
              suspects: Collection[int] = ()) -> str | None:
        """Learn the cap ``ticket`` carries (if its routing state is the newest seen), then count the verdict
        of ``refusal``; returns the reason when refused. The caller holds ``in_flight`` requests and adds
        this one on admission, with no await in between (the check and the count are one step)."""
        if ticket is not None and ticket.cap is not None and ticket.epoch >= self._cap_epoch:
            self.cap, self._cap_epoch = int(ticket.cap), ticket.epoch
        reason = self.refusal(ticket, version, in_flight, suspects)
        if reason is None:
            self.admitted += 1
            self.peak_in_flight = max(self.peak_in_flight, in_flight + 1)
        else:
            self.refused[reason] += 1
        return reason

    def detail(self, reason: str, ticket: Ticket | None, version: int, in_flight: int,
               suspects: Mapping[str, int]) -> str:
        """Why a request was refused for ``reason``, in words (the shard's weights are ``version``; it holds
        ``in_flight`` requests, ``suspects`` of them suspect: request id -> allowance)."""
        if reason == PAUSED:
            return "paused for a refit"
        if reason == NOT_MEMBER:
            return "not in the serving set"
        if reason == UNHEARD:
            return (f"{self.lease.describe()}: the committed version it knows ({self.committed}) may be old, and "
                    f"policy {ticket.policy.describe() if ticket else '?'} is bound to it")
        if reason == EPOCH:
            assert ticket is not None  # (``refusal``: only a routed request's epoch is refused)
            return f"routed under epoch {ticket.epoch}, this shard admits epoch {self.floor} or later"
        if reason == FULL:
            return f"{in_flight} requests in flight, at its admission cap {self.cap}"
        if reason == POISON:
            return "a client found requests like it take down two engines (poison_window_s)"
        if reason == SUSPECT:
            assert ticket is not None  # (only a suspect ticket is refused as such)
            running = ", ".join(f"{r} (allowing {a})" for r, a in sorted(suspects.items()))
            return (f"it is suspect (an engine died under it or its prompt), allowing {ticket.suspect} on its "
                    f"engine, and it runs {running}, suspect too: no more may share it (fleet.data.suspects)")
        assert ticket is not None  # VERSION (``refusal``: only a routed request's policy is refused)
        return (f"weights version {version} do not meet policy {ticket.policy.describe()} "
                f"(committed version {self.committed})")

    def remember_poison(self, fingerprint: str, until: float) -> None:
        """A client found requests with ``fingerprint`` take down two engines: refuse them until ``until``."""
        self._poison[fingerprint] = max(until, self._poison.get(fingerprint, until))

    def poison_refusal(self, fingerprint: Callable[[], str], now: float) -> str | None:
        """``POISON`` (counted) if the request's ``fingerprint()`` is remembered at ``now``; computed only when
        some fingerprint is. Forgets the expired ones."""
        if not self._poison:
            return None
        for key, until in list(self._poison.items()):
            if now >= until:
                del self._poison[key]
        if self._poison and fingerprint() in self._poison:
            self.refused[POISON] += 1
            return POISON
        return None

    def route(self, epoch: int, member: bool, committed: int, lease_s: float | None = None) -> None:
        """The controller's word: membership and committed version as of routing ``epoch``; ``lease_s``: the
        term of the lease it grants on them (``fleet.shard.lease``), renewed by this word and every later one.

        Joining (or leaving) raises the floor to ``epoch``: requests routed before it refresh. A word about
        an epoch older than the last one heard (a leave notice sent again, overtaken by a join) is ignored,
        but it is still the controller's word: it renews the lease.
        """
        self.lease.renew(lease_s)
        if epoch < self.routed_at:
            return
        self.routed_at = epoch
        if member != self.member:
            self.floor = max(self.floor, epoch)
        self.member, self.committed = member, max(self.committed, committed)

    def fence(self, epoch: int) -> None:
        """A refit begins at ``epoch`` (or the gate closed at it): refuse everything routed before it."""
        self.lease.renew()
        self.floor = max(self.floor, epoch)

    def heard(self) -> None:
        """Another word from the controller (its heartbeat ``ping`` with its routing epoch, a refit's end)."""
        self.lease.renew()

    def counters(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "refused": dict(self.refused), "paused": self.paused,
                "member": self.member, "floor": self.floor, "committed": self.committed,
                "cap": self.cap, "peak_in_flight": self.peak_in_flight, "lease": self.lease.facts()}


class RecentResults:
    """Completed results by request id, the most recent ``size`` kept (idempotent re-sends)."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._done: OrderedDict[str, Any] = OrderedDict()

    def get(self, request_id: str) -> Any | None:
        return self._done.get(request_id)

    def put(self, request_id: str, result: Any) -> None:
        self._done[request_id] = result
        self._done.move_to_end(request_id)
        while len(self._done) > self._size:
            self._done.popitem(last=False)

    def __len__(self) -> int:
        return len(self._done)
