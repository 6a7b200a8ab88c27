"""The routing state the controller publishes, and what every request carries (pure, no Ray).

The controller is the control plane: it decides the gate, the committed weight
version and membership, and publishes them as one small ``RoutingState`` with an
``epoch`` that grows on every change. Clients (``fleet.data.client.FleetClient``: the
Python API, an agent loop, an HTTP front) follow it and send requests straight to
the shards; each request carries a ``Ticket``: the epoch it was routed under and
its ``VersionPolicy``. The shard checks the ticket (``fleet.shard.request_gate``) and
refuses, without running anything, work it must not serve.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from rlfleet.fleet.data.staleness import too_old

LATEST, MAX_STALENESS, ANY = "latest", "max_staleness", "any"


@dataclass(frozen=True)
class VersionPolicy:
    """Which weights may produce a request's samples.

    ``latest``: only the committed version, from the first token to the last (a request
    held across a refit is aborted and re-sent); ``max_staleness=k``: started at most
    ``k`` versions behind the committed one; ``any``: whatever the serving engines hold.
    """

    kind: str = ANY
    k: int = 0

    def allows(self, version_start: int, committed: int) -> bool:
        if self.kind == ANY or version_start >= committed:
            return True
        return not too_old(version_start, committed, 0 if self.kind == LATEST else self.k)  # the one cut-off

    @property
    def bound(self) -> bool:
        """Bound to a version: whether serving it needs the committed version (``latest``, ``max_staleness=k``;
        not ``any``). Only the controller says what is committed, so a shard that cannot vouch for what it was
        told (its lease on the routing state lapsed: ``fleet.shard.lease``) refuses such a request, and the
        client sends it to another shard. However large ``k``, any number of refits may have committed unheard."""
        return self.kind != ANY

    def describe(self) -> str:
        return f"max_staleness={self.k}" if self.kind == MAX_STALENESS else self.kind

    @classmethod
    def parse(cls, value: Any, default: "VersionPolicy | None" = None) -> "VersionPolicy":
        """``None`` (the default), ``"latest"``, ``"any"``, ``"max_staleness=2"``, ``{"max_staleness": 2}``
        or a ``VersionPolicy``; anything else raises ``ValueError`` naming ``version_policy``."""
        if value is None:
            return default or cls()
        if isinstance(value, VersionPolicy):
            return value
        if isinstance(value, dict) and set(value) == {MAX_STALENESS}:
            value = f"{MAX_STALENESS}={value[MAX_STALENESS]}"
        if isinstance(value, str):
            if value in (LATEST, ANY):
                return cls(value)
            name, eq, k = value.partition("=")
            if name.strip() == MAX_STALENESS and eq and k.strip().isdigit():
                return cls(MAX_STALENESS, int(k))
        raise ValueError(
            f"version_policy must be 'latest', 'any' or 'max_staleness=K' (K >= 0), got {value!r}"
        )

    @classmethod
    def for_fleet(cls, max_staleness: int | None) -> "VersionPolicy":
        """The default policy: the fleet's ``max_staleness`` setting (None: any)."""
        return cls() if max_staleness is None else cls(MAX_STALENESS, max_staleness)


@dataclass(frozen=True)
class Ticket:
    """What a request carries to the shard: the routing epoch it was routed under, its policy, the
    shard's admission cap in that routing state (None: no cap), which the shard enforces, and whether it is
    suspect (``suspect``: an engine already died under it, or under a request with its fingerprint): 0 if
    not, else its allowance, the most suspects (itself included) it may run beside; the shard holds every
    suspect to its own and the others' (``fleet.data.suspects``). 1: the only suspect on that engine."""

    epoch: int
    policy: VersionPolicy = VersionPolicy()
    cap: int | None = None
    suspect: int = 0


@dataclass(frozen=True)
class Member:
    slot: int
    incarnation: int
    handle: Any = field(compare=False)


@dataclass(frozen=True)
class RoutingState:
    """One published view of the fleet. ``epoch`` grows by one on every change."""

    epoch: int
    gate_open: bool
    version: int
    members: tuple[Member, ...] = ()
    caps: tuple[tuple[int, int], ...] = ()  # (slot, admission cap)
    stopped: str | None = None
    reason: str = ""

    @functools.cached_property
    def cap_map(self) -> dict[int, int]:
        """``caps`` as a dict (computed once per state; do not mutate)."""
        return dict(self.caps)

    def same_view(self, other: "RoutingState") -> bool:
        """True if ``other`` says the same to a client (everything but the epoch)."""
        return (
            self.gate_open == other.gate_open
            and self.version == other.version
            and (self.members is other.members
                 or [(m.slot, m.incarnation) for m in self.members] == [(m.slot, m.incarnation) for m in other.members])
            and self.caps == other.caps
            and self.stopped == other.stopped
        )
