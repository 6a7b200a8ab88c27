"""Proof that a warm spare replaced a killed serving engine, and the time to full serving capacity.

``prove_promotion(events, slot)`` reads the event log (records in log order) of a run in which serving slot
``slot`` was killed between refits on a fleet with a warm spare (``spare_engines``),
and says in one sentence each what did not happen:

1. the kill fired: the controller's ``fault`` record of the step-boundary kill of
   ``slot`` (written just before it killed that incarnation), then the ``health``
   record of that incarnation going ``dead``;
2. a spare was promoted in its place: a ``promote`` record after the kill naming
   ``slot`` as the slot it replaced;
3. routing changed to it: a ``routing`` record after the promotion whose members hold
   the spare's incarnation and not the killed one;
4. before the dead slot's restart finished: that routing record precedes the
   ``restart`` end (outcome ok) of the slot's next incarnation, which must exist;
5. the gate stayed open from the kill to that routing record (no ``gate`` closing:
   capacity never fell below quorum);
6. the killed slot became the spare: its restarted incarnation was stamped by a later
   refit (it holds the committed weights), no later ``promote`` put it back in the
   serving role, and no routing record after that stamp lists it.

``capacity_restored_s(events, slot, size)`` is the time from the kill of ``slot`` to
the first published routing state with ``size`` members again (the killed incarnation
not among them) and the gate open: full serving capacity.

Pure: reads records, no Ray, no file. Nothing raises on an incomplete log: a
missing record proves nothing and is reported.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from rlfleet.fleet.records import Fault, Gate, Health, Promote, Record, Restart, Routing, Stamp, all_of

Events = Iterable[Mapping | Record]  # wire dicts or typed records (``fleet.records``)


def _kill(events: Sequence[Record], slot: int) -> int | None:
    """The position of the step-boundary kill of ``slot`` in ``events`` (None: there is none)."""
    return next((i for i, e in enumerate(events) if isinstance(e, Fault) and e.slot == slot
                 and e.point == "step_boundary" and e.action == "kill" and e.armed), None)


def routing_members(events: Events) -> list[tuple[int, Routing, set[tuple[int, int]]]]:
    """(position, record, members) of each ``routing`` record (one without ``members`` kept the last ones)."""
    out, current = [], set()
    for i, e in enumerate(all_of(events)):
        if not isinstance(e, Routing):
            continue
        if e.members is not None:
            current = {tuple(m) for m in e.members}
        out.append((i, e, current))
    return out


def _after(events: Sequence[Record], start: int, cls: type, pred: Callable[[Record], bool]) -> tuple:
    """The first record of ``cls`` at a position >= ``start`` that ``pred`` accepts, with its position
    ((None, None): there is none)."""
    return next(((i, e) for i, e in enumerate(events) if i >= start and isinstance(e, cls) and pred(e)), (None, None))


def prove_promotion(events: Events, slot: int) -> list[str]:
    """What the log (records in log order) does not show of a spare replacing killed serving slot ``slot``
    (module docstring); [] if it shows everything."""
    events = all_of(events)
    k = _kill(events, slot)
    if k is None:
        return [f"no kill of slot {slot} fired: the event log has no step-boundary 'fault' record of it"]
    inc, t0 = events[k].incarnation, events[k].t
    wrong = []
    if _after(events, k, Health, lambda e: e.slot == slot and e.incarnation == inc and e.after == "dead")[0] is None:
        wrong.append(f"slot {slot} incarnation {inc} was killed at t={t0:.3f} but never recorded dead")
    p, promo = _after(events, k, Promote, lambda e: e.replaced == slot)
    if promo is None:
        return wrong + [f"no spare was promoted in place of slot {slot} after its kill at t={t0:.3f}"]
    spare = (promo.slot, promo.incarnation)
    r, routed = next(((i, e) for i, e, members in routing_members(events) if i > p and spare in members
                      and (slot, inc) not in members), (None, None))
    e_, restarted = _after(events, k, Restart, lambda e: e.edge == "end" and e.slot == slot and e.incarnation > inc
                           and e.outcome == "ok")
    if routed is None:
        wrong.append(f"slot {spare[0]} incarnation {spare[1]} was promoted at t={promo.t:.3f} but no routing "
                     f"state after it sends traffic to it without the killed slot {slot}")
    if restarted is None:
        return wrong + [f"slot {slot} never finished a restart after its kill: it cannot have become the spare"]
    if routed is not None and r > e_:
        wrong.append(f"routing changed to the spare at t={routed.t:.3f}, not before slot {slot}'s restart "
                     f"finished at t={restarted.t:.3f}: the spare did not save the restart's wait")
    until = r if routed is not None else e_
    closed = Gate.among(events[k:until + 1], open=False)
    if closed:
        wrong.append(f"the gate closed at t={closed[0].t:.3f} between the kill and the promotion's routing "
                     f"({(closed[0].reason or '')[:120]})")
    wrong += _became_spare(events, slot, e_, restarted.incarnation)
    return wrong


def _became_spare(events: Sequence[Record], slot: int, start: int, incarnation: int) -> list[str]:
    new = [slot, incarnation]
    s, stamp = _after(events, start, Stamp, lambda e: new in [list(m) for m in e.members])
    if stamp is None:
        return [f"slot {slot} incarnation {incarnation} restarted but no refit landed on it: not a warm spare"]
    wrong = []
    _, back = _after(events, start, Promote, lambda e: e.slot == slot)
    if back is not None:
        wrong.append(f"slot {slot} was promoted again at t={back.t:.3f}: it did not stay the spare")
    served = [e for i, e, members in routing_members(events) if i > s and tuple(new) in members]
    if served:
        wrong.append(f"slot {slot} incarnation {incarnation} is in the routing state at t={served[0].t:.3f}: "
                     "a spare must serve nothing")
    return wrong


def capacity_restored_s(events: Events, slot: int, size: int) -> float | None:
    """Seconds from the kill of ``slot`` to the first routing state after it with ``size`` members, the killed
    incarnation not among them, and the gate open (None: never, or no kill in the log). Rounded to ms."""
    events = all_of(events)
    k = _kill(events, slot)
    if k is None:
        return None
    killed = (slot, events[k].incarnation)
    for i, e, members in routing_members(events):
        if i > k and e.gate_open and len(members) >= size and killed not in members:
            return round(e.t - events[k].t, 3)
    return None
