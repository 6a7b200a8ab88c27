"""A refit held long with requests held on its engines: every admission cap survives it (issue 47).

``admission_hold_across_refit(fleet, sync)``: requests stream on every engine (``HELD_REQUESTS``, long ones,
``version_policy="any"`` so the refit keeps them in flight); each shard's admission cap is read; one serving
engine is slowed (``slow``: each of its hooked calls, its pause, transfer, stamp and resume among them, takes
``SLOW_S`` longer), so the refit holds the engines paused, with those requests on them, longer than the
fleet's ``stats_max_age_s + absent_fallback_s`` (the variant's fleet lowers both: a paused engine records
nothing, so its stats go missing within seconds). While the refit runs, the admission metrics are sampled;
after it, once the refit's grace is over, the caps are read again and the held requests collected.

``prove_admission_hold_across_refit`` turns that record into the sentences of what went wrong: the refit did
not commit; the fault did not fire (no engine holding requests had its stats missing for ``absent_fallback_s``
on end while the refit ran: the law had nothing it could have taken for an absent engine, or no such engine
had a cap above ``fallback_cap`` to lose); a cap after the refit is not the cap before it, or a fallback was
counted; a held request did not complete. The law that read a paused engine's silence as absence cut each
such shard to ``fallback_cap`` here.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

from faults.polling import wait_until
from fleet.records import Record

PROMPT = [9, 19, 29, 39, 49]
HELD = {"max_tokens": 480, "ignore_eos": True, "temperature": 1.0}
HELD_REQUESTS = 12
SLOW_S = 3.0  # every hooked call of one engine: its pause, transfer, stamp and resume each wait this long
SAMPLE_S = 0.2  # how often the admission metrics are read while the refit runs
SETTLE_S = 2.0  # after the refit: its grace (``refit_grace_s``, 1 s) is over and the polls saw the engines step


def _caps(metrics: Mapping) -> dict[int, int]:
    return {int(s): int(m["cap"]) for s, m in metrics.items()}


def _fallbacks(metrics: Mapping) -> dict[int, int]:
    return {int(s): int(m["fallbacks"]) for s, m in metrics.items()}


def _in_flight(fleet) -> int:
    return sum(int(c.get("in_flight", 0)) for c in fleet.shard_counters().values())


def admission_hold_across_refit(fleet, sync: Callable[[], dict], say: Callable[[str], Any] = print) -> dict:
    pending = [fleet.submit(PROMPT, 1, HELD, version_policy="any") for _ in range(HELD_REQUESTS)]
    wait_until(lambda: _in_flight(fleet) >= HELD_REQUESTS, 30.0)
    time.sleep(1.0)  # a few admission polls of engines that step with the requests on them
    before = fleet.admission_metrics()
    slot = fleet.status()["serving"][0]
    faults = fleet.fault_injector()
    faults.arm_fault(slot, "transfer", "slow", SLOW_S)
    box: dict = {}
    refit = threading.Thread(target=lambda: box.update(call=sync()), daemon=True)
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
    say(f"admission hold across a refit: slot {slot} slowed {SLOW_S:g} s a call; refit {call['outcome']} in "
        f"{(call['ended'] or 0) - (call['began'] or 0):.1f} s; caps {_caps(before)} -> {_caps(after)}; "
        f"{sum(h['ok'] for h in held)} of {len(held)} held requests completed")
    return {"calls": [call], "slowed": slot, "caps_before": _caps(before), "caps_after": _caps(after),
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


def prove_admission_hold_across_refit(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    call, wrong = calls[0], []
    if call["outcome"] != "committed":
        return [f"the refit did not commit: {call['outcome']}: {call['error']}"]
    bound, floor = f["absent_fallback_s"], f["fallback_cap"]
    spans = silent_spans(f["samples"])
    fired = {s: round(d, 2) for s, d in spans.items() if d >= bound and f["caps_before"].get(s, 0) > floor}
    if not fired:
        wrong.append(f"no engine holding requests with a cap above fallback_cap {floor} had its stats missing for "
                     f"absent_fallback_s {bound:g} s while the refit ran (longest silences by slot: {spans}; caps "
                     f"before {f['caps_before']}): the fault did not fire")
    changed = {s: (c, f["caps_after"].get(s)) for s, c in f["caps_before"].items() if f["caps_after"].get(s) != c}
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
