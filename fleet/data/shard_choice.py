"""Routing choices over the serving set, under the admission caps (pure)."""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, TypeVar


class _HasSlot(Protocol):
    @property
    def slot(self) -> int: ...


T = TypeVar("T", bound=_HasSlot)


FULL_SCAN_UP_TO = 4  # members with room; above this, two random choices


def pick_two(members: Sequence[T], outstanding: Mapping[int, int], caps: Mapping[int, int], rng) -> T | None:
    """Power of two choices: of two members drawn at random, the one with fewer outstanding requests
    (with at most ``FULL_SCAN_UP_TO`` members with room: the least loaded of all, ties at random).

    Only members below their cap count; with none, None (the caller waits). Each member
    has a ``slot``; a slot missing from ``caps`` has no cap. With ``rng`` seeded the
    choice is reproducible. O(members) to filter by room, O(1) to choose.
    """
    room = with_room(members, outstanding, caps)
    if len(room) <= 1:
        return room[0] if room else None
    if len(room) <= FULL_SCAN_UP_TO:  # a small fleet: look at every member (as cheap, and never leaves one idle)
        least = min(outstanding.get(m.slot, 0) for m in room)
        return rng.choice([m for m in room if outstanding.get(m.slot, 0) == least])
    a, b = rng.sample(room, 2)
    return a if outstanding.get(a.slot, 0) <= outstanding.get(b.slot, 0) else b


def with_room(members: Sequence[T], outstanding: Mapping[int, int], caps: Mapping[int, int]) -> list[T]:
    """The members below their cap (a slot missing from ``caps`` has none)."""
    return [m for m in members if caps.get(m.slot) is None or outstanding.get(m.slot, 0) < caps[m.slot]]
