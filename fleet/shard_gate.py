"""The gate each shard enforces on the requests sent straight to it (pure, no Ray, no engine).

A shard admits a request only if the ticket it carries (``fleet.routing.Ticket``)
agrees with what the controller last told the shard:

- ``paused``: the shard is paused for a refit;
- ``not_member``: the controller took it out of the serving set (fenced, stale, evicted);
- ``epoch``: the request was routed under an epoch older than the shard's floor (the
  routing state changed for this shard since: a refit began, or it rejoined);
- ``version``: the shard's weights do not meet the request's version policy.

A refused request never runs; the client refreshes its routing state and re-routes.
A request without a ticket (an operator's or a test's direct call) is refused only
while paused. ``RecentResults`` makes request ids idempotent: a re-sent id that
completed returns the same result, and one still running joins the running call.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from fleet.routing import Ticket

PAUSED, NOT_MEMBER, EPOCH, VERSION = "paused", "not_member", "epoch", "version"


class ShardGate:
    def __init__(self) -> None:
        self.paused = False
        self.member = False
        self.floor = 0  # lowest routing epoch admitted
        self.routed_at = 0  # the epoch of the last membership word heard
        self.committed = 0  # the fleet's committed version, as last told
        self.refused: Counter[str] = Counter()
        self.admitted = 0

    def refusal(self, ticket: Ticket | None, version: int) -> str | None:
        """Why a request with ``ticket`` must not run on weights ``version`` now, or None to admit it."""
        if self.paused:
            return PAUSED
        if ticket is None:
            return None
        if not self.member:
            return NOT_MEMBER
        if ticket.epoch < self.floor:
            return EPOCH
        if not ticket.policy.allows(version, self.committed):
            return VERSION
        return None

    def admit(self, ticket: Ticket | None, version: int) -> str | None:
        """Count the verdict of ``refusal``; returns the reason when refused."""
        reason = self.refusal(ticket, version)
        if reason is None:
            self.admitted += 1
        else:
            self.refused[reason] += 1
        return reason

    def route(self, epoch: int, member: bool, committed: int) -> None:
        """The controller's word: membership and committed version as of routing ``epoch``.

        Joining (or leaving) raises the floor to ``epoch``: requests routed before it refresh. A word about
        an epoch older than the last one heard (a leave notice sent again, overtaken by a join) is ignored.
        """
        if epoch < self.routed_at:
            return
        self.routed_at = epoch
        if member != self.member:
            self.floor = max(self.floor, epoch)
        self.member, self.committed = member, max(self.committed, committed)

    def fence(self, epoch: int) -> None:
        """A refit begins at ``epoch``: refuse everything routed before it."""
        self.floor = max(self.floor, epoch)

    def counters(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "refused": dict(self.refused), "paused": self.paused,
                "member": self.member, "floor": self.floor, "committed": self.committed}


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
