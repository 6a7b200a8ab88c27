"""Proof of a ``resize_under_load`` (``faults.resize_load``): the fleet grew by one and shrank by one
while clients kept submitting, a refit landed in between, and nothing was lost.

``prove_resize_under_load(f, calls, events)`` takes the driver's record ``f``, its refit call and the
event log since the variant began, and returns one sentence per condition that does not hold (none:
proven):

- the refit committed;
- both resizes happened: each call returned, and the controller's ``resize`` end records say so (one
  from ``size`` to ``size + 1`` adding the new slot, one back to ``size`` removing a slot), in that
  order, the refit between them;
- the new engine served after the refit: the refit's ``stamp`` record names it, its shard admitted
  requests after the refit ended (its own counters), and requests completed on it tagged with the
  refit's version;
- the removed engine was drained: the shrink's record shows it held requests when it was removed
  (a drain of nothing proves nothing), finished every one of them (none aborted), and admitted none
  after its removal (its shard's admitted count did not move);
- it was retired as removed: a ``health`` record takes that incarnation to ``retired`` for a removal
  by the resize, and the status afterwards shows it retired and removed;
- nothing was lost: every request the client threads submitted completed.

Pure: no Ray; nothing here raises on an incomplete record (a missing field proves nothing and is
reported).
"""

from __future__ import annotations

from typing import Mapping

from rlfleet.fleet.records import Health, Record, Resize, Stamp


def _end_record(events: list[Mapping | Record], call: Mapping) -> Resize | None:
    """The controller's ``resize`` end record of the resize ``call`` made (within its begin and end)."""
    return Resize.first(events, lambda r: call["began"] <= r.t <= call["ended"], edge="end")


def prove_resize_under_load(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    call, wrong = calls[0], []
    if call.get("outcome") != "committed":
        wrong.append(f"the refit between the resizes did not commit: {call.get('outcome')}: {call.get('error')}")
    grow, shrink = (list(f.get("resizes") or []) + [None, None])[:2]
    wrong += _resizes_happened(f, grow, shrink, call, events)
    wrong += _new_engine_served(f, call, events)
    wrong += _removed_engine_drained(f, shrink, events)
    returned = f.get("returned") or []
    if returned or f.get("completed") != f.get("submitted") or not f.get("submitted"):
        wrong.append(f"not every request completed: {f.get('completed')} of {f.get('submitted')} submitted, "
                     f"returned: {returned[:3]}")
    return wrong


def _resizes_happened(f: Mapping, grow: Mapping | None, shrink: Mapping | None, call: Mapping,
                      events: list[Mapping | Record]) -> list[str]:
    wrong, size = [], f.get("size")
    for name, rec, want in (("grow", grow, (size, None if size is None else size + 1)),
                            ("shrink", shrink, (None if size is None else size + 1, size))):
        if rec is None or rec.get("outcome") != "ok":
            wrong.append(f"the {name} did not happen: {None if rec is None else rec.get('error')}")
            continue
        end = _end_record(events, rec)
        if end is None:
            wrong.append(f"no resize end record of the {name} (to {rec['n']} engines) in the event log")
        elif (end.size_from, end.size_to) != want:
            wrong.append(f"the {name}'s resize record goes from {end.size_from} to {end.size_to} "
                         f"engines, not {want[0]} to {want[1]}")
        elif name == "grow" and (not end.added or end.added != f.get("added")):
            wrong.append(f"the grow's resize record added {end.added}, the driver saw {f.get('added')}")
        elif name == "shrink" and (not end.removed or end.removed != f.get("removed")):
            wrong.append(f"the shrink's resize record removed {end.removed}, the driver saw {f.get('removed')}")
    if grow and shrink and not grow.get("ended", 0) <= call.get("began", 0) <= call.get("ended", 0) <= shrink.get("began", 0):
        wrong.append("the refit did not run between the grow and the shrink")
    return wrong


def _new_engine_served(f: Mapping, call: Mapping, events: list[Mapping | Record]) -> list[str]:
    new, wrong = f.get("new_engine") or {}, []
    slot, inc = new.get("slot"), new.get("incarnation")
    if slot is None:
        return ["the grow added no engine"]
    stamp = Stamp.first(events, version=call.get("version"))
    if stamp is None or [slot, inc] not in [list(m) for m in stamp.members]:
        wrong.append(f"the refit of version {call.get('version')} did not land on the new engine (slot {slot}, "
                     f"incarnation {inc}): its stamp record names {None if stamp is None else stamp.members}")
    if not new.get("admitted_after_refit"):
        wrong.append(f"the new engine (slot {slot}) admitted no request after the refit (its shard's counters)")
    if not new.get("completed_on_version"):
        wrong.append(f"no request completed on the new engine (slot {slot}) with version {call.get('version')}")
    return wrong


def _removed_engine_drained(f: Mapping, shrink: Mapping | None, events: list[Mapping | Record]) -> list[str]:
    removed = f.get("removed") or []
    if len(removed) != 1:
        return [f"the shrink removed {removed}, not one engine"]
    slot = removed[0]
    end = _end_record(events, shrink) if shrink else None
    row = ((end.drained if end else None) or {}).get(str(slot))
    if row is None:
        return [f"no drain record of the removed slot {slot} in the shrink's resize record"]
    wrong, held = [], row.get("in_flight_at_removal") or 0
    if held < 1:
        wrong.append(f"slot {slot} held no request when it was removed: its drain proves nothing")
    if row.get("aborted") or row.get("finished") != held or not row.get("drained"):
        wrong.append(f"slot {slot} did not finish the {held} request(s) it held: finished {row.get('finished')}, "
                     f"aborted {row.get('aborted')}")
    if row.get("admitted_at_end") != row.get("admitted_at_removal") or row.get("admitted_at_removal") is None:
        wrong.append(f"slot {slot} admitted requests after its removal: {row.get('admitted_at_removal')} at "
                     f"removal, {row.get('admitted_at_end')} at the end")
    inc = row.get("incarnation")
    retired = Health.first(events, lambda h: "removed by a resize" in h.reason and h.t >= shrink["began"],
                           slot=slot, incarnation=inc, after="retired")
    state = (f.get("removed_state") or {}).get(str(slot)) or {}
    if retired is None or state.get("state") != "retired" or not state.get("removed"):
        wrong.append(f"slot {slot} (incarnation {inc}) was not retired as removed by the resize: health record "
                     f"{'found' if retired else 'missing'}, status afterwards {state.get('state')}, "
                     f"removed={state.get('removed')}")
    return wrong
