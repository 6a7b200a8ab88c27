"""The invariants every fault test checks, as pure functions over the event log.

DESIGN.md: dispatch is never open while a serving shard holds weights other than
the current version; every sample carries the version that produced it; every
accepted prompt ends completed or explicitly returned; no lifecycle call waits
past its deadline; the gate stays closed after an unrecovered failure.

Each check returns a list of violations (empty when the invariant held), each a
sentence naming the record that broke it.

The log may span a controller's restart (Ray restarted it; the new one appends to
the same file, its ``seq`` starting again at 0: records are read in time order,
``faults.timeline.read_log``). Nothing here reads ``seq``; a phase the dead controller
began has no ``end`` (only ended phases are timed); its closed gate stays closed until
the successor opens it (a ``gate`` record like any other); the successor's re-adoption
says, per engine it keeps (``adopt``), the version that engine holds: the one it was
stamped with, or the committed one the successor stamped on it (``stamped``).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from rlfleet.fleet.records import Adopt, ControllerRestarted, Gate, Phase, Readmit, Record, Request, Stamp, Stopped, all_of

Events = Iterable[Mapping | Record]  # wire dicts or typed records (``fleet.records``)


def requests_accounted(events: Events) -> list[str]:
    """Every accepted request ended exactly once (completed or returned)."""
    ends: dict[str, int] = {}
    accepted: set[str] = set()
    for r in Request.among(events):
        if r.event == Request.ACCEPTED:
            accepted.add(r.request_id)
        elif r.event in (Request.COMPLETED, Request.RETURNED):
            ends[r.request_id] = ends.get(r.request_id, 0) + 1
    out = [f"request {r} accepted but never completed nor returned (lost)" for r in sorted(accepted - set(ends))]
    out += [f"request {r} ended {n} times" for r, n in sorted(ends.items()) if n > 1]
    return out


def version_tags_match_stamps(events: Events) -> list[str]:
    """Each completed sample's version tag is the version last stamped on that (slot, incarnation).

    Every incarnation starts on the checkpoint (version 0) until a stamp says otherwise: a ``stamp``
    record, a re-admission (``readmit`` end record, outcome ``readmitted``: the engine was stamped with the
    committed version it copied from a donor, before it joined routing), or a restarted controller's
    ``adopt`` record of that engine (the version it reported, or the committed version of its
    ``controller_restarted`` record when it stamped the engine itself).
    """
    events = all_of(events)
    # The refit's last call to an engine stamps it and then resumes it (``end_refit``); the ``stamp`` record
    # comes once every such call settled, so a resumed engine may finish requests on the new version before
    # it: from its refit's ``resume`` phase on, an engine the record lists may carry that version.
    # An engine whose call failed as a whole (``unknown``: no answer, so no word on its stamp) holds the new
    # weights whole and may carry either tag until a later stamp says which.
    members_of = {s.version: {tuple(m) for m in s.members} | {tuple(u[:2]) for u in s.unknown}
                  for s in Stamp.among(events)}
    resuming: dict[tuple[int, int], int] = {}  # engine -> the version it may carry besides its last stamp's
    stamped: dict[tuple[int, int], int] = {}
    committed: int | None = None  # the restarted controller's committed version
    out = []
    for e in events:
        match e:
            case Phase(phase="resume", edge="begin"):
                resuming.update(dict.fromkeys(members_of.get(e.version, ()), e.version))
            case Stamp():
                for slot, inc in e.members:
                    stamped[(slot, inc)] = e.version
                    resuming.pop((slot, inc), None)
            case Readmit(edge="end", outcome="readmitted"):
                stamped[(e.slot, e.incarnation)] = e.version
                resuming.pop((e.slot, e.incarnation), None)
            case ControllerRestarted():
                committed = e.committed
            case Adopt() if e.weight_version is not None:
                stamped[(e.slot, e.incarnation)] = committed if e.stamped else e.weight_version
                resuming.pop((e.slot, e.incarnation), None)
            case Request(event=Request.COMPLETED):
                key = (e.slot, e.incarnation)
                want = stamped.get(key, 0)
                if e.version != want and e.version != resuming.get(key):
                    out.append(
                        f"request {e.request_id} from slot {e.slot} (incarnation {e.incarnation}) tagged "
                        f"version {e.version}, but that engine held version {want}"
                    )
    return out


def open_gate_serves_current_version(events: Events) -> list[str]:
    """While the gate is open on version v, every completed sample carries v."""
    open_version: int | None = None
    out = []
    for e in all_of(events):
        match e:
            case Gate():
                open_version = e.version if e.open else None
            case Request(event=Request.COMPLETED) if open_version is not None and e.version != open_version:
                out.append(
                    f"request {e.request_id} completed with version {e.version} while the gate was open on "
                    f"version {open_version}"
                )
    return out


def phases_within_deadline(events: Events, deadline_s: float, slack_s: float = 2.0) -> list[str]:
    """No lifecycle phase outlived its deadline, ``refit_timeout_s + lifecycle_grace_s``; the transfer
    phase too, its one retry included (the lifecycle gives the phase one deadline).

    ``slack_s`` covers the bookkeeping around a call that ran to its deadline (and,
    on a stop, the short bounded call that returns held requests).
    """
    bound = deadline_s + slack_s
    return [f"phase {p.phase} of version {p.version} took {p.seconds:.1f} s > {bound:.1f} s"
            for p in Phase.among(events, edge="end") if p.seconds is not None and p.seconds > bound]


def gate_closed_after_stop(events: Events) -> list[str]:
    """After the fleet stopped, the gate never opened again."""
    stopped = None
    out = []
    for e in all_of(events):
        match e:
            case Stopped():
                stopped = e.reason
            case Gate(open=True) if stopped is not None:
                out.append(f"gate reopened on version {e.version} after the fleet stopped ({stopped})")
    return out


def requests_waited_below_quorum(events: Events) -> list[str]:
    """A variant's expectation, not an invariant of every run: the gate closed between refits because
    fewer than ``min_healthy_engines`` served ("below quorum"); requests accepted while it was closed
    waited (none returned, none completed before the gate reopened), and a refit reopened it (on a newer
    version: restarted engines serve only once a refit lands on them). "Accepted while it was closed" is
    as the accepting client saw it (the ``gate_open`` of its ``accepted`` record; a record without it
    counts as closed): the close reaches a client with the next routing state, and a request it accepted
    before that may still be served meanwhile by a surviving shard on the committed version."""
    events = all_of(events)
    closes = [i for i, e in enumerate(events) if isinstance(e, Gate) and not e.open and "below quorum" in e.reason]
    if not closes:
        return ["the gate never closed below quorum between refits"]
    out = []
    for i in closes:
        closed = events[i]
        end = next((j for j in range(i + 1, len(events)) if isinstance(events[j], (Stopped, Gate))), None)
        reopened = end is not None and isinstance(events[end], Gate) and events[end].open
        if not reopened or events[end].version <= closed.version:
            out.append(f"the gate closed below quorum at t={closed.t:.3f} and no refit reopened it")
        window = Request.among(events[i + 1:end])
        waiting = {r.request_id for r in window if r.event == Request.ACCEPTED and not r.gate_open}
        ended = [r for r in window if r.event == Request.RETURNED or (
            r.event == Request.COMPLETED and r.request_id in waiting)]
        if not waiting:
            out.append(f"no request was accepted while the gate was closed below quorum (t={closed.t:.3f})")
        out += [f"request {r.request_id} {r.event} while the gate was closed below quorum" for r in ended]
    return out


def check_all(events: Events, deadline_s: float, slack_s: float = 2.0) -> list[str]:
    events = all_of(events)  # typed once for every check
    return (
        requests_accounted(events)
        + version_tags_match_stamps(events)
        + open_gate_serves_current_version(events)
        + phases_within_deadline(events, deadline_s, slack_s=slack_s)
        + gate_closed_after_stop(events)
    )
