"""Warm spares on the controller: carries out ``health.roles`` after every health decision.

A fleet with ``spare_engines: k`` runs ``num_engines + k`` engine slots. The health
core treats them alike (each starts, restarts within its budget and takes part in
every refit, so a healthy spare holds the committed weights); roles decide which of
them get traffic. After every decision that changed something, ``apply_roles``
re-reads the slots' states and lets ``health.roles.rebalance`` promote a healthy
spare in place of a serving slot that is not healthy. Each change is stored in the
intent first (a restarted controller restores the roles: ``restore_roles``), then
written to the event log (``promote``: the spare's slot and incarnation, the slot it
replaced and why; ``demote``: a slot that left the serving role with no spare in its
place), and the routing state is published at once (``RoutingPublisher.mark_dirty``;
during a refit, when it ends).

The slot a spare replaced is a spare from then on: when its restart finishes and a
refit lands on it, it is the new warm spare. A spare that dies is restarted like any
slot and stays a spare.

Guarantee on failure: nothing here calls an engine; a role change that cannot be
stored raises before the roles change (the intent store raises).
"""

from __future__ import annotations

from typing import Any

from health import SlotPhase
from health.roles import Rebalanced, Roles, rebalance


def initial_roles(ctl: Any) -> Roles:
    return Roles.initial(ctl.serving_size())


def restore_roles(ctl: Any, stored: tuple[int, ...] | None) -> None:
    """A restarted controller: the roles its predecessor stored (the initial ones if it stored none)."""
    ctl.roles = Roles.restore(stored, ctl.serving_size())


def apply_roles(ctl: Any) -> Rebalanced | None:
    """Rebalance ``ctl.roles`` against its ledger; store, log and publish what changed. None: nothing can change."""
    ledger, size, roles = ctl.ledger, ctl.serving_size(), ctl.roles
    every = len(roles.serving) == ledger.num_slots == size and max(roles.serving, default=-1) == size - 1
    if every and not ledger.phase_count(SlotPhase.RETIRED):
        return None  # no spare, no retired slot: every slot serves and no role can change
    out = rebalance(roles, {s: ledger.state(s) for s in range(ledger.num_slots)}, size)
    if out.roles is roles:
        return out
    ctl.intent.update(serving_roles=tuple(out.roles.to_list()))  # stored before routing follows it
    ctl.roles = out.roles
    for p in out.promotions:
        replaced = {} if p.replaced is None else {
            "replaced": p.replaced, "replaced_incarnation": ledger.raw(p.replaced).incarnation}
        ctl.log.emit("promote", slot=p.spare, incarnation=ledger.raw(p.spare).incarnation, **replaced,
                     reason=p.reason, serving=out.roles.to_list())
    for d in out.demotions:
        ctl.log.emit("demote", slot=d.slot, incarnation=ledger.raw(d.slot).incarnation, reason=d.reason,
                     serving=out.roles.to_list())
    ctl.publisher.mark_dirty()
    return out


def role_rows(ctl: Any, slots: list[dict]) -> list[dict]:
    """``Ledger.to_dict()``'s slot rows with each slot's ``role`` (``serving`` or ``spare``)."""
    return [{**row, "role": ctl.roles.role(row["slot"])} for row in slots]
