"""A refit held long with requests held on its engines: every admission cap survives it (issue 47).

``admission_hold_across_refit(fleet, new_version, sync)``: requests stream on every engine (``HELD_REQUESTS``, long ones,
``version_policy="any"`` so the refit keeps them in flight); each shard's admission cap is read; one serving
engine is slowed (``slow``: each of its hooked calls, its pause, transfer, stamp and resume among them, takes
``SLOW_S`` longer), so the refit holds the other engines paused, with those requests on them, longer than the
fleet's ``stats_max_age_s + absent_fallback_s`` (the variant's fleet lowers both: a paused engine records
nothing, so its stats go missing within seconds). While the refit runs, the admission metrics are sampled;
after it, once the refit's grace is over, the caps are read again and the held requests collected.

``prove_admission_hold_across_refit`` turns that record into the sentences of what went wrong: the refit did
not commit; it held no request across its pause (its ``refit_held`` record); the fault did not fire (no engine holding requests had its stats missing for ``absent_fallback_s``
on end while the refit ran: the law had nothing it could have taken for an absent engine, or no such engine
had a cap above ``fallback_cap`` to lose); a cap after the refit is not the cap before it (one below its KV
capacity cap before may have grown back toward it meanwhile), or a fallback was counted; a held request did not
complete. The law that read a paused engine's silence as absence cut each
such shard to ``fallback_cap`` here.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

from rlfleet.faults.polling import wait_until
from rlfleet.fleet.records import Admission, RefitHeld, Record

PROMPT = [9, 19, 29, 39, 49]
HELD = {"max_tokens": 500, "ignore_eos": True, "temperature": 1.0}  # a tiny model on a CPU makes 500 in seconds
HELD_REQUESTS = 12
SLOW_S = 4.0  # every hooked call of one engine: its pause, transfer, stamp and resume each wait this long
SAMPLE_S = 0.2  # how often the admission metrics are read while the refit runs
SETTLE_S = 2.0  # after the refit: its grace (``refit_grace_s``, 1 s) is over and the polls saw the engines step


def _caps(metrics: Mapping) -> dict[int, int]:
    return {int(s): int(m["cap"]) for s, m in metrics.items()}


def _capacity(metrics: Mapping) -> dict[int, int | None]:
    return {int(s): m["capacity_cap"] for s, m in metrics.items()}


def _fallbacks(metrics: Mapping) -> dict[int, int]:
    return {int(s): int(m["fallbacks"]) for s, m in metrics.items()}


def _in_flight(fleet) -> int:
    return sum(int(c.get("in_flight", 0)) for c in fleet.shard_counters().values())


def admission_hold_across_refit(fleet, new_version: Callable[[], int], sync: Callable[[int], dict],
                                say: Callable[[str], Any] = print) -> dict:
    """The refit starts as soon as the requests run (a tiny model finishes them in seconds: the update is made
    before they are sent, ``new_version``, and ``sync(version)`` only sends it); the engine slowed
    is the one with the lowest cap (a real engine's first steps may have taken it to the fallback already), so
    the other engines, paused at once and kept paused by the slowed one's pause and transfer, hold requests with
    a cap they can lose."""
    version = new_version()
    t0 = time.monotonic()
    pending = [fleet.submit(PROMPT, 1, HELD, version_policy="any") for _ in range(HELD_REQUESTS)]
    wait_until(lambda: _in_flight(fleet) >= HELD_REQUESTS, 30.0, poll_s=0.05)
    before = fleet.admission_metrics()
    serving = fleet.status()["serving"]
    slot = min(serving, key=lambda s: (_caps(before).get(s, 0), s))
    faults = fleet.fault_injector()
    faults.arm_fault(slot, "transfer", "slow", SLOW_S)
    box: dict = {}
    refit = threading.Thread(target=lambda: box.update(call=sync(version)), daemon=True)
    samples: list[dict] = []
    refit.start()
    while refit.is_alive():
        t = round(time.monotonic(), 3)
        samples += [{"t": t, "slot": int(s), "data": m["data"], "rule": m["rule"], "cap": m["cap"],
                     "in_flight": m["in_flight"]} for s, m in fleet.admission_metrics().items()]
        refit.join(SAMPLE_S)
    faults.arm_fault(slot, "ping", "slow", 0.0)  # a slow shard stays slow until told otherwise
    time.sleep(SETTLE_S)
    after = fleet.admission_metrics()
    held = []
    for p in pending:
        held += [{"ok": r.ok, "reason": None if r.ok else r.reason} for r in fleet.collect(p)]
    cfg = fleet.config.admission
    call = box.get("call") or {"version": None, "outcome": "no answer", "error": "the refit never returned",
                               "began": None, "ended": None}
    events = fleet.events(kinds=[Admission, RefitHeld])
    law = [f"{a.t - t0:.1f} s {a.reason}" for a in Admission.among(events) if a.t >= t0]
    kept = RefitHeld.first(events, version=version)
    say(f"admission hold across a refit: slot {slot} slowed {SLOW_S:g} s a call; refit {call['outcome']} in "
        f"{(call['ended'] or 0) - (call['began'] or 0):.1f} s, {(call['began'] or t0) - t0:.2f} s after the requests were "
        f"sent, holding {kept.by_slot if kept else None} across its pause; silent (s, by slot) "
        f"{silent_spans(samples)}; caps "
        f"{_caps(before)} -> {_caps(after)}; {sum(h['ok'] for h in held)} of {len(held)} held requests completed; "
        f"the law said: {law[:16]}")
    return {"calls": [call], "slowed": slot, "caps_before": _caps(before), "caps_after": _caps(after),
            "capacity_before": _capacity(before),
            "fallbacks_before": _fallbacks(before), "fallbacks_after": _fallbacks(after), "samples": samples,
            "held": held, "absent_fallback_s": cfg.absent_fallback_s, "fallback_cap": cfg.fallback_cap}


def silent_spans(samples: list[Mapping]) -> dict[int, float]:
    """Per slot: the longest run of consecutive samples whose stats were missing with requests in flight
    (seconds from its first sample to its last): how long the law saw that engine as silent."""
    longest: dict[int, float] = {}
    began: dict[int, float | None] = {}
    for s in sorted(samples, key=lambda x: x["t"]):
        slot = s["slot"]
        if s["data"] == "missing" and s["in_flight"]:
            start = began.get(slot)
            if start is None:
                start = began[slot] = s["t"]
            longest[slot] = max(longest.get(slot, 0.0), s["t"] - start)
        else:
            began[slot] = None
    return longest


def _grew_back(before: int, after: int | None, capacity: int | None) -> bool:
    """A cap below its KV capacity cap before the refit (an earlier cut or fallback: a real engine's first steps
    may take longer than this fleet's short absence bound) may have grown back meanwhile, by the law's growth."""
    return after is not None and capacity is not None and before < after <= capacity


def prove_admission_hold_across_refit(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    call, wrong = calls[0], []
    if call["outcome"] != "committed":
        return [f"the refit did not commit: {call['outcome']}: {call['error']}"]
    held = RefitHeld.first(events, version=call["version"])
    if held is None or not held.requests:
        wrong.append(f"the refit of version {call['version']} held no request across its pause "
                     f"({held.by_slot if held else 'no refit_held record'}): the fault proved nothing")
    bound, floor = f["absent_fallback_s"], f["fallback_cap"]
    spans = silent_spans(f["samples"])
    fired = {s: round(d, 2) for s, d in spans.items() if d >= bound and f["caps_before"].get(s, 0) > floor}
    if not fired:
        wrong.append(f"no engine holding requests with a cap above fallback_cap {floor} had its stats missing for "
                     f"absent_fallback_s {bound:g} s while the refit ran (longest silences by slot: {spans}; caps "
                     f"before {f['caps_before']}): the fault did not fire")
    changed = {s: (c, f["caps_after"].get(s)) for s, c in f["caps_before"].items()
               if f["caps_after"].get(s) != c and not _grew_back(c, f["caps_after"].get(s), f["capacity_before"].get(s))}
    if changed:
        wrong.append(f"admission caps changed across the refit (slot: before, after): {changed}; silent for "
                     f"{spans} s by slot")
    fell = {s: n - f["fallbacks_before"].get(s, 0) for s, n in f["fallbacks_after"].items()
            if n != f["fallbacks_before"].get(s, 0)}
    if fell:
        wrong.append(f"the admission law fell back to fallback_cap {floor} across the refit (slot: times): {fell}")
    lost = [h for h in f["held"] if not h["ok"]]
    if lost:
        wrong.append(f"{len(lost)} of {len(f['held'])} held request(s) did not complete: "
                     f"{[h['reason'] for h in lost][:3]}")
    return wrong
