"""Numbers read off the controller's event log: departures, recoveries, reopenings, re-admissions, refits.

The demo's report, the fault runner, the chaos soak and the benchmarks all take
their fleet numbers from here, so one number has one definition. Every function
reads a list of event records (the dicts of ``events.jsonl``, in log order, or their
typed ``fleet.records``) and returns numbers; ``percentile`` is the one percentile helper of the project.

Definitions:

- a *firing*: a record of a fault going off, with ``t`` on the event log's clock
  (the fault journal's line, or the controller's ``fault`` record of a
  step-boundary kill; ``faults.evidence`` pairs them with the plan);
- a *departure*: the first ``health`` record after a firing in which the
  incarnation it hit enters a state the fault leads to (``dead``, ``hung``, ...).
  Not any ``healthy -> stale``: every refit that lands passes through ``stale``;
- *fault to reopen*: from a firing to the next gate opening after it;
- *recovered*: after a departure of (slot, incarnation), a stamp that includes a
  newer incarnation of the slot, a newer incarnation re-admitted from a peer (a
  ``readmit`` end record, outcome readmitted), or that same incarnation healthy again;
- a *re-admission*: a restarted incarnation's first stamp (it received committed
  weights and serves again): by a peer copy between refits (a ``readmit`` end record,
  ``how`` peer, with its donor) or by a refit (``how`` refit), whichever came first;
  ``before_next_refit``: it served before the first refit that began after its restart
  ended. The demo counts these as its ``recoveries``.

Pure: no Ray, no clock. ``read_log`` is the only function that touches a file.
Records cut short (a crash mid-line) are skipped; nothing here raises on an
incomplete log, a number it cannot tell is ``None``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlfleet.fleet.records import (ControllerRestarted, Fault, Gate, Health, Kill, Phase, Readmit, Record, Request, Restart,
                           Stamp, StalenessAbort, Stopped, all_of)
from rlfleet.health.faultplan import REFIT_PHASES

Events = Iterable[Mapping | Record]  # wire dicts (``read_log``, ``Fleet.events``) or typed records

def percentile(values: Iterable[float | None], q: float, ndigits: int | None = None, default: Any = None) -> Any:
    """The ``q``-quantile (``q`` in [0, 1]) of ``values``, interpolated linearly between the closest ranks.

    The definition of numpy's default, ``statistics.quantiles(method="inclusive")``
    and ``statistics.median``. ``None`` values are skipped; ``default`` when none is
    left; rounded to ``ndigits`` when given.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile q must be within [0, 1], got {q!r}")
    xs = sorted(x for x in values if x is not None)
    if not xs:
        return default
    k = (len(xs) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    value = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return round(value, ndigits) if ndigits is not None else value


def read_log(path: str | Path) -> list[dict]:
    """The records of a JSONL event log (``[]`` if there is none), in time order; a line cut short by a
    crash is skipped. The controller and the clients on its host append to one file (whole lines), so
    records are sorted by ``t`` (stable: each writer's own records keep their order)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return sorted(out, key=lambda r: r.get("t", 0.0))


# ---------------------------------------------------------------------------------- faults and recovery
def reopen_s(events: Sequence[Mapping | Record], i: int) -> float | None:
    """Seconds from ``events[i]`` to the next gate opening after it (None if the gate never opened again)."""
    opened = Gate.first(events[i + 1:], open=True)
    return None if opened is None else opened.t - all_of(events[i:i + 1])[0].t


def fault_to_reopen(events: Events, since_t: float) -> float | None:
    """Seconds from a firing at ``since_t`` to the next gate opening after it, rounded to ms.

    None when the gate never opened again, and when the fleet stopped first (the gate stays closed after a stop).
    """
    for e in all_of(events):
        if e.t < since_t:
            continue
        if isinstance(e, Stopped):
            return None
        if isinstance(e, Gate) and e.open:
            return round(e.t - since_t, 3)
    return None


def departure(events: Events, slot: int, incarnation: int, since_t: float, states: Sequence[str]) -> Health | None:
    """The first ``health`` record at or after ``since_t`` in which (slot, incarnation) entered one of ``states``."""
    return Health.first(events, lambda h: h.t >= since_t and h.after in states and h.before != h.after,
                        slot=slot, incarnation=incarnation)


def _serves_again(x: Record, slot: int, incarnation: int) -> bool:
    """A replacement incarnation was stamped with weights or re-admitted from a peer, or the same one became
    healthy again."""
    if isinstance(x, Stamp):
        return any(s == slot and inc > incarnation for s, inc in x.members)
    if isinstance(x, Readmit):
        return x.edge == "end" and x.outcome == "readmitted" and x.slot == slot and x.incarnation > incarnation
    return isinstance(x, Health) and x.slot == slot and x.incarnation == incarnation and x.after == "healthy"


def recover_s(events: Events, left: Health) -> float | None:
    """Seconds from a departure record until its slot served again, rounded to ms (None if it never did)."""
    back = next((x.t for x in all_of(events) if x.t >= left.t and _serves_again(x, left.slot, left.incarnation)), None)
    return None if back is None else round(back - left.t, 3)


def restarted_incarnations(events: Events) -> list[tuple[int, int]]:
    """(slot, incarnation) of every replacement engine that started (restart end with outcome ok)."""
    return [(r.slot, r.incarnation) for r in Restart.among(events, edge="end", outcome="ok")]


def readmissions(events: Events) -> list[dict]:
    """Each restarted incarnation's first stamp (it received the weights and rejoined serving), in log order:
    by a peer copy (``how`` peer, ``donor``) or a refit (``how`` refit); ``before_next_refit`` as defined above."""
    events = all_of(events)
    started: dict[tuple[int, int], float] = {}
    out: list[dict] = []
    seen: set[tuple[int, int]] = set()

    def landed(slot: int, inc: int, version: int, t: float, how: str, donor: str | None) -> None:
        key = (slot, inc)
        if key in started and key not in seen:
            seen.add(key)
            out.append({"slot": slot, "incarnation": inc, "version": version, "t": t, "restart_end_t": started[key],
                        "how": how, "donor": donor})

    for e in events:
        match e:
            case Restart(edge="end", outcome="ok"):
                started[(e.slot, e.incarnation)] = e.t
            case Readmit(edge="end", outcome="readmitted"):
                landed(e.slot, e.incarnation, e.version, e.t, "peer", e.donor)
            case Stamp():
                for slot, inc in e.members:
                    landed(slot, inc, e.version, e.t, "refit", None)
    begins = sorted(s["begin"] for s in refit_spans(events))
    for r in out:
        following = next((b for b in begins if b > r["restart_end_t"]), None)
        r["before_next_refit"] = following is None or r["t"] < following
    return out


def served_by(events: Events, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Completed requests per (slot, incarnation) among ``pairs``."""
    want = {tuple(p): 0 for p in pairs}
    for r in Request.among(events, event=Request.COMPLETED):
        key = (r.slot, r.incarnation)
        if key in want:
            want[key] += 1
    return want


# ---------------------------------------------------------------------------------- refits and requests
def refit_spans(events: Events) -> list[dict]:
    """One record per refit: version, begin/end time (close begin .. reopen end) and its phases' spans."""
    spans: dict[int, dict] = {}
    open_phase: dict[tuple[int, str], float] = {}
    for e in Phase.among(events):
        if e.phase not in REFIT_PHASES:
            continue
        v = e.version
        rec = spans.setdefault(v, {"version": v, "begin": e.t, "end": None, "phases": []})
        if e.edge == "begin":
            open_phase[(v, e.phase)] = e.t
        else:
            t0 = open_phase.pop((v, e.phase), e.t - float(e.seconds or 0.0))
            rec["phases"].append((e.phase, t0, e.t))
            rec["end"] = e.t
    return [s for s in spans.values() if s["end"] is not None]


def gate_closed_s(events: Events, end: float | None = None) -> float:
    """Seconds the gate was closed among the ``gate`` records of ``events`` (from each close to the next open);
    one still closed at the last record counts until ``end`` when given."""
    closed_at, total = None, 0.0
    for g in Gate.among(events):
        if not g.open and closed_at is None:
            closed_at = g.t
        elif g.open and closed_at is not None:
            total, closed_at = total + g.t - closed_at, None
    return total + (end - closed_at if closed_at is not None and end is not None else 0.0)


def request_counts(events: Events) -> dict[str, int]:
    """Request records by event: accepted, completed, returned, requeued."""
    req = dict.fromkeys((Request.ACCEPTED, Request.COMPLETED, Request.RETURNED, Request.REQUEUED), 0)
    for r in Request.among(events):
        if r.event in req:
            req[r.event] += 1
    return req


def stop_reason(events: Events) -> str | None:
    """Why the fleet stopped, or None (the controller's own shutdown is not a stop)."""
    stop = Stopped.first(events, lambda s: not s.shutdown)
    return None if stop is None else stop.reason


def log_numbers(events: Events) -> dict[str, Any]:
    """Every fleet-side number of the demo's summary, from the event log alone."""
    events = all_of(events)
    req = request_counts(events)
    # one record per fault: a shard's fault is recorded once; the controller's crash once armed and once
    # fired (only the firing counts)
    faults = Fault.among(events, lambda f: f.target != "controller" or bool(f.fired))
    readm = readmissions(events)
    served = served_by(events, [(r["slot"], r["incarnation"]) for r in readm])
    first_fault_t = min((f.t for f in faults), default=None)
    refit_s = [s["end"] - s["begin"] for s in refit_spans(events) if s["version"] is not None]
    return {
        "requests": req,
        "prompts_lost": req["accepted"] - req["completed"] - req["returned"],
        "faults_injected": len(faults),
        "faults": [{"t": f.t, "target": f.target, "slot": f.slot, "incarnation": f.incarnation, "point": f.point,
                    "action": f.action, "armed": f.armed} for f in faults],
        "controller_restarts": len(ControllerRestarted.among(events)),
        "kills": len(Kill.among(events)),
        "deaths": len(Health.among(events, after="dead")),
        "restarts_started": len(Restart.among(events, edge="begin")),
        "restarts_ok": len(restarted_incarnations(events)),
        "recoveries": len(readm),
        "readmitted_by_peer": sum(r["how"] == "peer" for r in readm),
        "readmitted_before_next_refit": sum(bool(r["before_next_refit"]) for r in readm),
        "readmissions": [{**r, "served_after": served[(r["slot"], r["incarnation"])]} for r in readm],
        "gate_reopenings_after_fault": 0 if first_fault_t is None else len(
            Gate.among(events, lambda g: g.t > first_fault_t, open=True)),
        "stopped": stop_reason(events),
        "refits": len(refit_s),
        "refit_s_p50": percentile(refit_s, 0.5, 3),
        "refit_s_max": round(max(refit_s), 3) if refit_s else None,
        "staleness_aborts": sum(a.requests for a in StalenessAbort.among(events)),
    }
