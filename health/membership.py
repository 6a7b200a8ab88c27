"""Membership planning: who takes part in the next refit, with which rank, under
which membership epoch.

Participants are the live slots (HEALTHY or STALE: stale shards must join refits to
become healthy), identified by (slot, incarnation). Rank 0 is reserved for the
trainer's sender; engines get ranks 1..k in slot order. The epoch increases by one
exactly when the set of (slot, incarnation) pairs differs from the previous plan's,
and never otherwise, so the transport group is rebuilt only when membership really
changed (a restarted engine in the same slot is a change: new incarnation).

``plan_membership`` is pure: the controller keeps the last plan and passes it back.
Guarantee on failure: a malformed ``previous`` raises ``TypeError``; the ledger is
never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.health.ledger import Ledger

__all__ = ["TRAINER_RANK", "MembershipPlan", "Participant", "plan_membership"]

TRAINER_RANK = 0


@dataclass(frozen=True, slots=True)
class Participant:
    """One engine in a refit: its slot, the incarnation pinned for this refit, and
    its rank in the transport group (>= 1)."""

    slot: int
    incarnation: int
    rank: int


@dataclass(frozen=True, slots=True)
class MembershipPlan:
    """The participants of the next refit and the membership epoch they form."""

    epoch: int
    participants: tuple[Participant, ...]

    @classmethod
    def initial(cls) -> MembershipPlan:
        """The plan before any: epoch 0, nobody."""
        return cls(0, ())

    @property
    def members(self) -> frozenset[tuple[int, int]]:
        """The (slot, incarnation) pairs; the epoch changes iff this set changes."""
        return frozenset((p.slot, p.incarnation) for p in self.participants)

    @property
    def world_size(self) -> int:
        """Transport group size: the trainer (rank 0) plus every participant."""
        return len(self.participants) + 1

    def rank_of(self, slot: int) -> int | None:
        """The rank of ``slot`` in this plan, or ``None`` if it does not take part."""
        for p in self.participants:
            if p.slot == slot:
                return p.rank
        return None


def plan_membership(ledger: Ledger, previous: MembershipPlan | None = None) -> MembershipPlan:
    """Plan the next refit's membership from ``ledger``.

    ``previous`` is the last plan made (``None``: ``MembershipPlan.initial()``). The
    returned epoch is ``previous.epoch`` if the (slot, incarnation) set is unchanged,
    else ``previous.epoch + 1``. When unchanged, ``previous`` itself is returned.
    """
    if previous is None:
        previous = MembershipPlan.initial()
    elif not isinstance(previous, MembershipPlan):
        raise TypeError(f"previous must be a MembershipPlan or None, got {type(previous).__name__}")
    live = ledger.live_slots()
    records = ledger._records
    if _same_members(previous.participants, live, records):
        return previous
    participants = tuple(
        Participant(slot, records[slot].incarnation, rank)
        for rank, slot in enumerate(live, start=TRAINER_RANK + 1)
    )
    members = frozenset((p.slot, p.incarnation) for p in participants)
    if members == previous.members:
        return previous
    return MembershipPlan(previous.epoch + 1, participants)


def _same_members(participants: tuple[Participant, ...], live: tuple[int, ...], records) -> bool:
    """True when ``participants`` are exactly the ``live`` slots (ascending) at their current
    incarnations: the (slot, incarnation) set is unchanged, without building a new plan. A plan
    listed in another order is left to the full comparison."""
    if len(participants) != len(live):
        return False
    for p, slot in zip(participants, live):
        if p.slot != slot or p.incarnation != records[slot].incarnation:
            return False
    return True
