"""Numbers read off the controller's event log: departures, recoveries, reopenings, re-admissions, refits.

The demo's report, the fault runner, the chaos soak and the benchmarks all take
their fleet numbers from here, so one number has one definition. Every function
reads a list of event records (the dicts of ``events.jsonl``, in log order) and
returns numbers; ``percentile`` is the one percentile helper of the project.

Definitions:

- a *firing*: a record of a fault going off, with ``t`` on the event log's clock
  (the fault journal's line, or the controller's ``fault`` record of a
  step-boundary kill; ``faults.evidence`` pairs them with the plan);
- a *departure*: the first ``health`` record after a firing in which the
  incarnation it hit enters a state the fault leads to (``dead``, ``hung``, ...).
  Not any ``healthy -> stale``: every refit that lands passes through ``stale``;
- *fault to reopen*: from a firing to the next gate opening after it;
- *recovered*: after a departure of (slot, incarnation), a stamp that includes a
  newer incarnation of the slot, or that same incarnation healthy again;
- a *re-admission*: a restarted incarnation's first stamp (it received committed
  weights and serves again); the demo counts these as its ``recoveries``.

Pure: no Ray, no clock. ``read_log`` is the only function that touches a file.
Records cut short (a crash mid-line) are skipped; nothing here raises on an
incomplete log, a number it cannot tell is ``None``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from health.faultplan import REFIT_PHASES

# The controller's own ``stopped`` record when it is shut down on purpose (not a failure).
SHUTDOWN_REASON = "controller shut down"


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
def reopen_s(events: Sequence[dict], i: int) -> float | None:
    """Seconds from ``events[i]`` to the next gate opening after it (None if the gate never opened again)."""
    t_open = next((x["t"] for x in events[i + 1:] if x["kind"] == "gate" and x["open"]), None)
    return None if t_open is None else t_open - events[i]["t"]


def fault_to_reopen(events: Sequence[dict], fired: dict) -> float | None:
    """Seconds from a firing (a record with ``t``) to the next gate opening after it, rounded to ms.

    None when the gate never opened again, and when the fleet stopped first (the gate stays closed after a stop).
    """
    for e in events:
        if e["t"] < fired["t"]:
            continue
        if e["kind"] == "stopped":
            return None
        if e["kind"] == "gate" and e["open"]:
            return round(e["t"] - fired["t"], 3)
    return None


def departure(events: Iterable[dict], slot: int, incarnation: int, since_t: float, states: Sequence[str]) -> dict | None:
    """The first ``health`` record at or after ``since_t`` in which (slot, incarnation) entered one of ``states``."""
    return next(
        (e for e in events if e["kind"] == "health" and e["t"] >= since_t and e["slot"] == slot
         and e["incarnation"] == incarnation and e["after"] in states and e["before"] != e["after"]),
        None,
    )


def _serves_again(x: dict, slot: int, incarnation: int) -> bool:
    """A replacement incarnation was stamped with weights, or the same one became healthy again."""
    if x["kind"] == "stamp":
        return any(s == slot and inc > incarnation for s, inc in x["members"])
    return x["kind"] == "health" and x["slot"] == slot and x["incarnation"] == incarnation and x["after"] == "healthy"


def recover_s(events: Iterable[dict], left: dict) -> float | None:
    """Seconds from a departure record until its slot served again, rounded to ms (None if it never did)."""
    back = next((x["t"] for x in events if x["t"] >= left["t"] and _serves_again(x, left["slot"], left["incarnation"])),
                None)
    return None if back is None else round(back - left["t"], 3)


def restarted_incarnations(events: Iterable[dict]) -> list[tuple[int, int]]:
    """(slot, incarnation) of every replacement engine that started (restart end with outcome ok)."""
    return [
        (e["slot"], e["incarnation"])
        for e in events
        if e["kind"] == "restart" and e.get("edge") == "end" and e.get("outcome") == "ok"
    ]


def readmissions(events: Sequence[dict]) -> list[dict]:
    """Each restarted incarnation's first stamp (it received the weights and rejoined serving), in log order."""
    started: dict[tuple[int, int], float] = {}
    out: list[dict] = []
    seen: set[tuple[int, int]] = set()
    for e in events:
        if e["kind"] == "restart" and e.get("edge") == "end" and e.get("outcome") == "ok":
            started[(e["slot"], e["incarnation"])] = e["t"]
        elif e["kind"] == "stamp":
            for slot, inc in e["members"]:
                key = (slot, inc)
                if key in started and key not in seen:
                    seen.add(key)
                    out.append({"slot": slot, "incarnation": inc, "version": e["version"], "t": e["t"],
                                "restart_end_t": started[key]})
    return out


def served_by(events: Iterable[dict], pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Completed requests per (slot, incarnation) among ``pairs``."""
    want = {tuple(p): 0 for p in pairs}
    for e in events:
        if e["kind"] == "request" and e["event"] == "completed":
            key = (e["slot"], e["incarnation"])
            if key in want:
                want[key] += 1
    return want


# ---------------------------------------------------------------------------------- refits and requests
def refit_spans(events: Iterable[dict]) -> list[dict]:
    """One record per refit: version, begin/end time (close begin .. reopen end) and its phases' spans."""
    spans: dict[int, dict] = {}
    open_phase: dict[tuple[int, str], float] = {}
    for e in events:
        if e["kind"] != "phase" or e.get("phase") not in REFIT_PHASES:
            continue
        v = e.get("version")
        rec = spans.setdefault(v, {"version": v, "begin": e["t"], "end": None, "phases": []})
        if e["edge"] == "begin":
            open_phase[(v, e["phase"])] = e["t"]
        else:
            t0 = open_phase.pop((v, e["phase"]), e["t"] - float(e.get("seconds", 0.0)))
            rec["phases"].append((e["phase"], t0, e["t"]))
            rec["end"] = e["t"]
    return [s for s in spans.values() if s["end"] is not None]


def request_counts(events: Iterable[dict]) -> dict[str, int]:
    """Request records by event: accepted, completed, returned, requeued."""
    req = {"accepted": 0, "completed": 0, "returned": 0, "requeued": 0}
    for e in events:
        if e["kind"] == "request" and e["event"] in req:
            req[e["event"]] += 1
    return req


def stop_reason(events: Iterable[dict]) -> str | None:
    """Why the fleet stopped, or None (the controller's own shutdown is not a stop)."""
    return next((e["reason"] for e in events if e["kind"] == "stopped" and e["reason"] != SHUTDOWN_REASON), None)


def log_numbers(events: Sequence[dict]) -> dict[str, Any]:
    """Every fleet-side number of the demo's summary, from the event log alone."""
    req = request_counts(events)
    # one record per fault: a shard's fault is recorded once; the controller's crash once armed and once
    # fired (only the firing counts)
    faults = [e for e in events if e["kind"] == "fault" and (e.get("target") != "controller" or e.get("fired"))]
    readm = readmissions(events)
    served = served_by(events, [(r["slot"], r["incarnation"]) for r in readm])
    first_fault_t = min((e["t"] for e in faults), default=None)
    refit_s = [s["end"] - s["begin"] for s in refit_spans(events) if s["version"] is not None]
    return {
        "requests": req,
        "prompts_lost": req["accepted"] - req["completed"] - req["returned"],
        "faults_injected": len(faults),
        "faults": [{k: e.get(k) for k in ("t", "target", "slot", "incarnation", "point", "action", "armed")}
                   for e in faults],
        "controller_restarts": sum(1 for e in events if e["kind"] == "controller_restarted"),
        "kills": sum(1 for e in events if e["kind"] == "kill"),
        "deaths": sum(1 for e in events if e["kind"] == "health" and e["after"] == "dead"),
        "restarts_started": sum(1 for e in events if e["kind"] == "restart" and e.get("edge") == "begin"),
        "restarts_ok": len(restarted_incarnations(events)),
        "recoveries": len(readm),
        "readmissions": [{**r, "served_after": served[(r["slot"], r["incarnation"])]} for r in readm],
        "gate_reopenings_after_fault": sum(
            1 for e in events if e["kind"] == "gate" and e["open"] and first_fault_t is not None and e["t"] > first_fault_t
        ),
        "stopped": stop_reason(events),
        "refits": len(refit_s),
        "refit_s_p50": percentile(refit_s, 0.5, 3),
        "refit_s_max": round(max(refit_s), 3) if refit_s else None,
        "staleness_aborts": sum(e.get("requests", 0) for e in events if e["kind"] == "staleness_abort"),
    }
