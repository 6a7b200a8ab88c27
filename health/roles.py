"""Roles: which slots serve requests and which are warm spares (``spare_engines``).

Every slot of the ledger is an engine the health core treats alike: it starts,
restarts, and takes part in every refit. Roles sit on top: at most ``size`` slots
(the fleet's ``num_engines``) have the *serving* role, every other slot is a
*spare*. A slot gets traffic only if it is HEALTHY (live, on the committed
version) and serving; a HEALTHY spare holds the committed weights and waits.

``rebalance(roles, states, size)`` is the one rule, a pure function of the slots'
public states (``ShardState`` by slot, as ``Ledger.state`` reads them):

1. slots the ledger no longer has leave the roles; a RETIRED slot (never coming
   back) leaves the serving role;
2. above ``size`` serving (the fleet shrank): the extra ones become spares, the
   unhealthy first, then the highest slot numbers;
3. each serving slot that is not HEALTHY (dead, restarting, quarantined, stale)
   swaps roles with the lowest HEALTHY spare: the spare is promoted, the slot
   becomes a spare (its restart, if any, brings back a spare);
4. below ``size`` serving (a retirement, the fleet grew): the lowest HEALTHY spares
   are promoted.

Only a HEALTHY spare is ever promoted, so a promotion never serves stale weights;
if none is HEALTHY now, the next one that becomes HEALTHY (at the latest the next
refit) is promoted by the ``rebalance`` after that decision. After ``rebalance``
the slots that get traffic are exactly ``min(healthy, size)`` of them, so the
health core's quorum (a count of HEALTHY slots against ``min_healthy_engines <=
size``) says the same about the serving set. Deterministic (lowest slots first);
a second ``rebalance`` of its result changes nothing.

Pure: no Ray, no vLLM, no clock. Works on any slot count (the ledger may grow or
shrink between calls). Guarantee on failure: ``ValueError`` naming the argument
for a size below 0 or a slot number below 0; nothing is changed in place (roles
are immutable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from rlfleet.health.states import ShardState

__all__ = ["Demotion", "Promotion", "Rebalanced", "Roles", "rebalance"]

SERVING, SPARE = "serving", "spare"
_HEALTHY = ShardState.HEALTHY
_RETIRED = ShardState.RETIRED


@dataclass(frozen=True)
class Roles:
    """The slots with the serving role; every other slot of the ledger is a spare."""

    serving: frozenset[int]

    @classmethod
    def initial(cls, size: int) -> "Roles":
        """A new fleet: slots ``0..size-1`` serve, the slots after them are spares."""
        _check_size(size)
        return cls(frozenset(range(size)))

    @classmethod
    def restore(cls, serving: Iterable[int] | None, size: int) -> "Roles":
        """Roles as a predecessor stored them (``None``: it stored none, the initial roles)."""
        if serving is None:
            return cls.initial(size)
        slots = frozenset(serving)
        bad = sorted(s for s in slots if type(s) is not int or s < 0)
        if bad:
            raise ValueError(f"stored serving roles must be slot numbers >= 0, got {bad}")
        return cls(slots)

    def role(self, slot: int) -> str:
        return SERVING if slot in self.serving else SPARE

    def spares(self, slots: Iterable[int]) -> tuple[int, ...]:
        """The spares among ``slots`` (the ledger's slot numbers), ascending."""
        return tuple(sorted(s for s in slots if s not in self.serving))

    def to_list(self) -> list[int]:
        return sorted(self.serving)


@dataclass(frozen=True)
class Promotion:
    """``spare`` takes the serving role; ``replaced`` (None: none) becomes a spare; ``reason`` says why."""

    spare: int
    replaced: int | None
    reason: str


@dataclass(frozen=True)
class Demotion:
    """``slot`` leaves the serving role without a spare taking its place (retired, or the fleet shrank)."""

    slot: int
    reason: str


@dataclass(frozen=True)
class Rebalanced:
    roles: Roles
    promotions: tuple[Promotion, ...] = ()
    demotions: tuple[Demotion, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.promotions or self.demotions)


def rebalance(roles: Roles, states: Mapping[int, ShardState], size: int) -> Rebalanced:
    """The roles after the four rules of the module docstring; ``roles`` itself is returned when nothing changes."""
    _check_size(size)
    serving = {s for s in roles.serving if s in states}
    demotions = [Demotion(s, f"slot {s} is retired") for s in sorted(serving) if states[s] is _RETIRED]
    serving -= {d.slot for d in demotions}
    if len(serving) > size:  # unhealthy first, then the highest slots
        extra = sorted(serving, key=lambda s: (states[s] is _HEALTHY, -s))[: len(serving) - size]
        demotions += [Demotion(s, f"the serving set shrank to {size}") for s in sorted(extra)]
        serving -= set(extra)
    healthy_spares = sorted(s for s, st in states.items() if st is _HEALTHY and s not in serving)
    promotions = []
    for slot in sorted(serving):
        if states[slot] is _HEALTHY or not healthy_spares:
            continue
        spare = healthy_spares.pop(0)
        serving.remove(slot)
        serving.add(spare)
        promotions.append(Promotion(spare, slot, f"slot {slot} is {states[slot].value}"))
    while len(serving) < size and healthy_spares:
        spare = healthy_spares.pop(0)
        promotions.append(Promotion(spare, None, f"{len(serving)} of {size} serving slots filled"))
        serving.add(spare)
    if not promotions and not demotions and len(serving) == len(roles.serving):
        return Rebalanced(roles)
    return Rebalanced(Roles(frozenset(serving)), tuple(promotions), tuple(demotions))


def _check_size(size: int) -> None:
    if type(size) is not int or size < 0:
        raise ValueError(f"the serving size (num_engines) must be an integer >= 0, got {size!r}")
