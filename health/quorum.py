"""Quorum: are enough engines serving the current weights, and if not, who is gone?

``check_quorum`` is a pure function of the ledger: ``ok`` iff the number of HEALTHY
slots (live, on the committed version) is at least ``min_healthy_engines``. When it
fails, the message names every dead or retired slot with the reason it died, and
lists the other slots that are not serving and in what state, so the stop the
controller makes is loud and self-explanatory.

Cost: O(1) to count; O(dead + retired) to name them; O(slots) only to build the
message of a failed check. Guarantee on failure: raises ``ValueError`` (naming the
value) for a ``min_healthy`` outside 1..num_slots; never changes the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rlfleet.health.ledger import Ledger, SlotRecord, view_state
from rlfleet.health.states import ShardState, SlotPhase

__all__ = ["QuorumDecision", "check_quorum", "exhausted_message", "describe_dead"]


@dataclass(frozen=True, slots=True)
class QuorumDecision:
    """``ok`` iff ``serving >= needed``. ``dead_slots``: every DEAD or RETIRED slot
    (not those a resize removed), ascending. ``message``: one line; on failure it names each dead slot and why."""

    ok: bool
    serving: int
    needed: int
    message: str
    dead_slots: tuple[int, ...]


def check_quorum(ledger: Ledger, min_healthy: int | None = None) -> QuorumDecision:
    """Judge quorum on ``ledger`` (``min_healthy`` defaults to the config's
    ``min_healthy_engines``)."""
    needed = ledger.config.min_healthy_engines if min_healthy is None else min_healthy
    if type(needed) is not int or not 1 <= needed <= ledger.num_slots:
        raise ValueError(
            f"min_healthy must be between 1 and num_engines ({ledger.num_slots}), got {needed!r}"
        )
    serving = ledger.serving_count()
    dead_slots = tuple(
        sorted((ledger.slots_in(SlotPhase.DEAD) | ledger.slots_in(SlotPhase.RETIRED)) - ledger.removed_slots())
    )
    cv = ledger.current_version
    if serving >= needed:
        message = (
            f"quorum holds: {serving} of {ledger.target_size} engines serve weight version "
            f"{cv} (min_healthy_engines={needed})"
        )
        return QuorumDecision(True, serving, needed, message, dead_slots)
    records = [r for r in (ledger.raw(s) for s in range(ledger.num_slots)) if not r.removed]
    message = exhausted_message(
        serving=serving, needed=needed, num_slots=ledger.target_size,
        current_version=cv, records=records,
    )
    return QuorumDecision(False, serving, needed, message, dead_slots)


def describe_dead(record: SlotRecord) -> str:
    """``slot 3 (incarnation 2): <why it died>``."""
    return f"slot {record.slot} (incarnation {record.incarnation}): {record.reason}"


def exhausted_message(
    *,
    serving: int,
    needed: int,
    num_slots: int,
    current_version: int | None,
    records: Iterable[SlotRecord],
    permanent: bool = False,
) -> str:
    """The "fleet exhausted" error text.

    ``records`` must include every DEAD and RETIRED slot (it may include others:
    those not serving are listed by state, healthy ones are skipped). ``permanent``
    says that retirements alone make quorum unreachable.
    """
    dead: list[str] = []
    retired: list[str] = []
    others: dict[str, list[str]] = {}
    retired_count = 0
    for r in sorted(records, key=lambda r: r.slot):
        if r.phase is SlotPhase.DEAD:
            dead.append(describe_dead(r))
        elif r.phase is SlotPhase.RETIRED:
            retired.append(describe_dead(r))
            retired_count += 1
        else:
            state = view_state(r, current_version)
            if state is not ShardState.HEALTHY:
                others.setdefault(state.value, []).append(
                    f"slot {r.slot} (incarnation {r.incarnation})"
                )
    if permanent:
        head = (
            f"fleet exhausted: {retired_count} of {num_slots} slots retired, so at most "
            f"{num_slots - retired_count} can ever serve; min_healthy_engines={needed}"
        )
    else:
        head = (
            f"fleet exhausted: {serving} of {num_slots} engines serve weight version "
            f"{current_version}, min_healthy_engines={needed}"
        )
    parts = [head]
    if dead:
        parts.append("Dead: " + " | ".join(dead))
    if retired:
        parts.append("Retired: " + " | ".join(retired))
    if not dead and not retired:
        parts.append("No slot is dead or retired")
    if others:
        listed = "; ".join(f"{state} {', '.join(v)}" for state, v in others.items())
        parts.append(f"Not serving: {listed}")
    parts.append("Gate stays closed.")
    return ". ".join(parts)
