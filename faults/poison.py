"""The ``poison_request`` and ``poison_in_batch`` faults: a prompt that crashes every engine it reaches, sent twice,
or in a batch.

Firing (``poison_request``): once the fleet is idle, every healthy slot is armed with the
shard's ``poison`` action for ``POISON_TOKENS`` (the engine core is killed under any request
whose prompt contains them). A second client of the fleet (``Fleet.connect``, as another
trainer process would) starts ``OTHER_REQUESTS`` ordinary requests, each its own prompt; while
they run, the poison is sent, then sent again; then a batch of ordinary requests. The engines
the poison kills take the other client's requests running there with them: each counts one death,
is re-sent by its own client, and must not share the poison's next engine (the shards keep such
requests apart: ``fleet.data.poison``). Recorded: both calls (reason, attempts, times), the
other client's outcome, the batch's outcome and the fleet's state after.

Proof (``prove_poison_request``): the first call came back ``poison`` after exactly two
attempts; the event log has its ``poison`` record naming two engines on distinct slots,
and no more than those two engines died from the firing on; the second call was
refused at once (no attempt); every request of the other client completed, and at least one of
them was re-sent (it shared an engine the poison took down: the two met); the batch completed;
the gate is open.

Firing (``poison_in_batch``): once every engine serves (an earlier poison's engines restart) and the fleet is
idle, every slot is armed with ``poison`` for ``BATCH_POISON_TOKENS`` (another poison than ``poison_request``'s,
whose fingerprint is refused for its window), and one batch of ``BATCH`` requests goes out at once, the poison
in its middle, every other prompt its own: about 8 on each engine. The poison's first engine takes its share of
the batch down with it; each of them is a suspect, run on the other two without spending its request timeout
(``fleet.data.suspects``: 8 suspects for two shards run one per shard), so the poison's second engine has it as
its only suspect. Recorded: the poison's outcome, the innocents' (completed, re-sent, reasons), the fleet after.

Proof (``prove_poison_in_batch``): all three engines were armed; the poison came back ``poison`` with one
``poison`` record naming two engines, and at most two engines died from the batch on; every innocent request
completed, and at least one was re-sent (it shared the poison's engine); the gate is open.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

from rlfleet.fleet.records import Health, Record, Request
from rlfleet.faults.polling import wait_until

POISON_TOKENS = [7, 77, 7, 77]  # in no other prompt the fault runs send
POISON_PROMPT = [1, *POISON_TOKENS, 2]
PROMPT, SAMPLING = [1, 21, 31, 41, 51], {"max_tokens": 4}
IDLE_WAIT_S = 120.0
# The other client's requests: enough, and long enough (about a second here), that the poison's engines run some
OTHER_REQUESTS, OTHER_SAMPLING = 24, {"max_tokens": 48}


# ``poison_in_batch``: a batch of 24 on three engines, its poison in the middle (its own tokens: ``POISON_TOKENS``
# is refused for its window once ``poison_request`` ran on the same fleet)
BATCH_POISON_TOKENS = [8, 88, 8, 88]
BATCH, BATCH_SAMPLING = 24, {"max_tokens": 48}


def poison_request(fleet, say: Callable[[str], Any] = print) -> dict:
    wait_until(lambda: not fleet.status()["requests"]["in_progress"], IDLE_WAIT_S, 0.2)
    status = fleet.status()
    armed = [s["slot"] for s in status["ledger"]["slots"] if s["state"] == "healthy"]
    faults = fleet.fault_injector()
    for slot in armed:
        faults.arm_fault(slot, "generate", "poison", 0.0, 0, POISON_TOKENS)
    other = _OtherClient(fleet)
    try:
        calls = [_send(fleet, status["version"]) for _ in range(2)]
        beside = other.results()
    finally:
        other.close()
    others = [r for g in fleet.generate([PROMPT] * 6, 1, SAMPLING) for r in g]
    after = fleet.status()
    say(f"poison request: armed slots {armed}; calls {[(c['outcome'], c['attempts']) for c in calls]}; "
        f"the other client's {beside['n']} requests: {beside['ok']} completed, {beside['resent']} re-sent; "
        f"{sum(r.ok for r in others)} of {len(others)} ordinary requests completed after it")
    return {"armed": armed, "calls": calls, "returned": sum(c["outcome"] != "completed" for c in calls),
            "other_client": beside, "others": {"n": len(others), "ok": sum(r.ok for r in others)},
            "after": {"gate_open": after["gate_open"], "version": after["version"]}}


class _OtherClient:
    """A second client of ``fleet`` in this process (its own data plane, as another trainer's), generating
    ``OTHER_REQUESTS`` ordinary requests in a thread; returns once they run."""

    def __init__(self, fleet) -> None:
        from rlfleet.fleet.api import Fleet

        self.fleet = Fleet.connect(fleet.name)
        self.out: list = []
        prompts = [[1, 21 + i, 31, 41, 51] for i in range(OTHER_REQUESTS)]  # each its own fingerprint
        self.error: str | None = None

        def generate() -> None:
            try:
                self.out.extend(r for g in self.fleet.generate(prompts, 1, OTHER_SAMPLING) for r in g)
            except Exception as exc:  # noqa: BLE001 - said in the proof, which then fails
                self.error = f"{type(exc).__name__}: {exc}"

        self.thread = threading.Thread(target=generate, daemon=True)
        self.thread.start()
        wait_until(lambda: self.fleet.status()["requests"]["in_progress"], IDLE_WAIT_S, 0.01)
        time.sleep(0.1)  # the engines have them

    def results(self) -> dict:
        self.thread.join(IDLE_WAIT_S)
        reasons = sorted({r.reason[:120] for r in self.out if not r.ok}) + ([self.error] if self.error else [])
        return {"n": OTHER_REQUESTS, "ok": sum(r.ok for r in self.out), "resent": sum(r.attempts > 1 for r in self.out),
                "reasons": reasons}

    def close(self) -> None:
        self.fleet.detach()


def _send(fleet, version: int) -> dict:
    began = time.monotonic()
    [r] = fleet.collect(fleet.submit(POISON_PROMPT, 1, SAMPLING))
    outcome = "completed" if r.ok else ("poison" if r.reason.startswith("poison: ") else "returned")
    return {"version": version, "outcome": outcome, "reason": r.reason, "attempts": r.attempts,
            "began": round(began, 6), "ended": round(time.monotonic(), 6)}


def prove_poison_request(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    first, again = calls[0], calls[1]
    wrong = []
    if first["outcome"] != "poison" or first["attempts"] != 2:
        wrong.append(f"the poison prompt came back {first['outcome']} after {first['attempts']} attempt(s), not as "
                     f"poison after 2: {first['reason'][:200]}")
    marks = Request.among(events, lambda r: r.t >= first["began"], event=Request.POISON)
    if len(marks) != 1 or len(marks[0].engines or ()) != 2 or not marks[0].fingerprint:
        wrong.append(f"expected one 'poison' record naming two engines and a fingerprint, got {marks}")
    dead = sorted({(h.slot, h.incarnation) for h in Health.among(
        events, lambda h: h.t >= first["began"] and h.after in ("dead", "retired") and h.before != h.after)})
    if len(dead) != 2 or len({s for s, _ in dead}) != 2:
        wrong.append(f"engines that died from the firing on: {dead}; expected exactly two, on two slots")
    if again["outcome"] != "poison" or again["attempts"] != 0 or "refused without sending it" not in again["reason"]:
        wrong.append(f"sent again, it was not refused at once: {again['outcome']} after {again['attempts']} "
                     f"attempt(s): {again['reason'][:200]}")
    beside = f["other_client"]
    if beside["ok"] != beside["n"]:
        wrong.append(f"only {beside['ok']} of the other client's {beside['n']} requests completed: {beside['reasons']}")
    if not beside["resent"]:
        wrong.append("none of the other client's requests was re-sent: none ran on an engine the poison took down, "
                     "so the two clients never met")
    if f["others"]["ok"] != f["others"]["n"]:
        wrong.append(f"only {f['others']['ok']} of {f['others']['n']} ordinary requests completed after it")
    if not f["after"]["gate_open"]:
        wrong.append("the gate is closed after it: the fleet stopped serving")
    return wrong


def poison_in_batch(fleet, say: Callable[[str], Any] = print) -> dict:
    """A batch of ``BATCH`` requests with one poison in it, on every engine of ``fleet``, once all serve."""
    def ready() -> bool:
        status = fleet.status()
        return (not status["requests"]["in_progress"]
                and all(s["state"] == "healthy" for s in status["ledger"]["slots"]))

    wait_until(ready, IDLE_WAIT_S * 2, 0.5)
    status = fleet.status()
    armed = [s["slot"] for s in status["ledger"]["slots"] if s["state"] == "healthy"]
    faults = fleet.fault_injector()
    for slot in armed:
        faults.arm_fault(slot, "generate", "poison", 0.0, 0, BATCH_POISON_TOKENS)
    middle = BATCH // 2
    prompts = [[1, 22 + i, 32, 42, 52] for i in range(BATCH - 1)]  # each its own fingerprint
    prompts.insert(middle, [1, *BATCH_POISON_TOKENS, 2])
    began = time.monotonic()
    results = [r for g in fleet.generate(prompts, 1, BATCH_SAMPLING) for r in g]
    ended = time.monotonic()
    poison, innocents = results[middle], results[:middle] + results[middle + 1:]
    outcome = "completed" if poison.ok else ("poison" if poison.reason.startswith("poison: ") else "returned")
    call = {"version": status["version"], "outcome": outcome, "reason": poison.reason, "attempts": poison.attempts,
            "began": round(began, 6), "ended": round(ended, 6)}
    beside = {"n": len(innocents), "ok": sum(r.ok for r in innocents), "resent": sum(r.attempts > 1 for r in innocents),
              "slowest_s": round(max(r.latency_s for r in innocents), 3),
              "reasons": sorted({r.reason[:120] for r in innocents if not r.ok})}
    after = fleet.status()
    say(f"poison in a batch of {BATCH}: armed slots {armed}; the poison {outcome} after {poison.attempts} attempt(s); "
        f"{beside['ok']} of {beside['n']} innocents completed, {beside['resent']} re-sent, the slowest in "
        f"{beside['slowest_s']} s")
    return {"armed": armed, "calls": [call], "returned": int(not poison.ok), "innocents": beside,
            "after": {"gate_open": after["gate_open"], "version": after["version"]}}


def prove_poison_in_batch(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    call, wrong = calls[0], []
    if len(f["armed"]) != 3:
        wrong.append(f"the batch ran on slots {f['armed']}, not on three engines")
    if call["outcome"] != "poison":
        wrong.append(f"the poison came back {call['outcome']} after {call['attempts']} attempt(s), not as poison: "
                     f"{call['reason'][:200]}")
    marks = Request.among(events, lambda r: r.t >= call["began"], event=Request.POISON)
    if len(marks) != 1 or len(marks[0].engines or ()) != 2:
        wrong.append(f"expected one 'poison' record naming two engines, got {marks}")
    dead = sorted({(h.slot, h.incarnation) for h in Health.among(
        events, lambda h: h.t >= call["began"] and h.after in ("dead", "retired") and h.before != h.after)})
    if len(dead) > 2 or len({s for s, _ in dead}) != len(dead):
        wrong.append(f"engines that died from the batch on: {dead}; expected at most two, on two slots")
    beside = f["innocents"]
    if beside["ok"] != beside["n"]:
        wrong.append(f"only {beside['ok']} of the batch's {beside['n']} innocent requests completed: {beside['reasons']}")
    if not beside["resent"]:
        wrong.append("no innocent request was re-sent: none shared an engine the poison took down")
    if not f["after"]["gate_open"]:
        wrong.append("the gate is closed after it: the fleet stopped serving")
    return wrong
