"""The operator's pause where it meets a refit and a controller's death, on real engines (issue 46).

``operator_resume_mid_refit(fleet, sync)``: requests stream on every engine; the operator pauses with
``keep`` (they are held on their engines); a refit starts with one engine's transfer held back (``slow``),
and while the transfer runs the operator resumes, as a rollout manager that pauses and resumes around its own
work, or a client that gave up on a slow ``/finish_weight_update``, would. The refit owns the engines it
paused: each must refuse that resume, sample nothing until it is stamped, and resume at the refit's end; the
held requests then finish on the new weights, each token tagged with the version that made it.

``controller_kill_under_keep_pause(fleet)``: requests held by a ``keep`` pause; the controller's process is
SIGKILLed; Ray restarts it and it re-adopts the fleet. The engines must stay paused (sampling nothing) until
the operator's resume, which then lets every held request finish.

Each returns a record for ``faults.evidence``; ``prove_*`` turns it into the sentences of what went wrong.
The shards count, from vLLM's own per-step records, every token an engine made while paused
(``EngineShard.sampled_while_paused``): the evidence that nothing unpaused them behind the pause's back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Mapping

from rlfleet.faults.polling import wait_until
from rlfleet.fleet.records import Phase, Record, Stamp

PROMPT = [7, 17, 27, 37, 47]
HELD = {"max_tokens": 160, "ignore_eos": True, "temperature": 1.0}
HELD_REQUESTS = 6
SLOW_TRANSFER_S = 2.0  # one engine's transfer held back this long: the resume lands while the bytes move
QUIET_S = 2.0  # after the restarted controller answers: time an unpaused engine would have used to sample


def _in_flight(fleet) -> int:
    return sum(int(c.get("in_flight", 0)) for c in fleet.shard_counters().values())


def _sampled(counters: dict) -> dict[int, int]:
    return {int(s): int(c.get("sampled_while_paused", 0)) for s, c in counters.items()}


def _held_requests(fleet) -> list:
    pending = [fleet.submit(PROMPT, 1, HELD, version_policy="any") for _ in range(HELD_REQUESTS)]
    wait_until(lambda: _in_flight(fleet) >= HELD_REQUESTS, 30.0)
    time.sleep(0.2)  # their first tokens stream out before the pause
    return pending


def _results(fleet, pending: list) -> list[dict]:
    out = []
    for p in pending:
        for r in fleet.collect(p):
            res = r.result if r.ok else None
            out.append({"ok": r.ok, "reason": None if r.ok else r.reason,
                        "spans": [list(s) for s in res.version_spans] if res is not None else [],
                        "weight_version": None if res is None else res.weight_version})
    return out


def operator_resume_mid_refit(fleet, sync: Callable[[], dict], say: Callable[[str], Any] = print) -> dict:
    before = _sampled(fleet.shard_counters())
    pending = _held_requests(fleet)
    paused = fleet.pause("keep", 30.0)
    slot = fleet.status()["serving"][0]
    faults = fleet.fault_injector()
    faults.arm_fault(slot, "transfer", "slow", SLOW_TRANSFER_S)
    t0 = time.monotonic()
    box: dict = {}
    refit = threading.Thread(target=lambda: box.update(call=sync()), daemon=True)
    refit.start()

    def transferring() -> bool:
        return any(p.phase == "transfer" and p.edge == "begin" and p.t >= t0
                   for p in Phase.among(fleet.events(kinds=[Phase])))

    began = wait_until(transferring, 60.0)
    sent_at = time.monotonic()
    resumed = fleet.resume()
    refit.join(120.0)
    faults.arm_fault(slot, "ping", "slow", 0.0)  # a slow shard stays slow until told otherwise
    held = _results(fleet, pending)
    after = fleet.status()
    sampled = _sampled(fleet.shard_counters())
    say(f"operator resume mid-refit: transfer began {began}; resume answered {resumed}; refit "
        f"{box.get('call', {}).get('outcome')}; {sum(h['ok'] for h in held)} of {len(held)} held requests completed")
    return {"calls": [box.get("call") or {"version": None, "outcome": "no answer", "error": "the refit never returned",
                                          "began": round(t0, 6), "ended": None}],
            "paused": paused, "resumed": resumed, "resume_sent": round(sent_at, 6), "transfer_seen": began,
            "slowed": slot, "held": held, "after": {"gate_open": after["gate_open"], "version": after["version"]},
            "sampled_while_paused": {s: n - before.get(s, 0) for s, n in sampled.items()}}


def controller_kill_under_keep_pause(fleet, say: Callable[[str], Any] = print) -> dict:
    before = _sampled(fleet.shard_counters())
    pending = _held_requests(fleet)
    paused = fleet.pause("keep", 30.0)
    info = fleet.controller_info()
    began = time.monotonic()
    os.kill(info["pid"], signal.SIGKILL)
    back = fleet.controller_info()  # waits for the restarted controller (it re-adopts first)
    time.sleep(QUIET_S)
    still = {"paused": fleet.is_paused(), "shards": {int(s): {k: c.get(k) for k in ("paused", "operator_hold", "in_flight")}
                                                     for s, c in fleet.shard_counters().items()}}
    sampled = _sampled(fleet.shard_counters())
    resumed = fleet.resume()
    held = _results(fleet, pending)
    after = fleet.status()
    say(f"controller killed under a keep pause: generation {info['generation']} -> {back['generation']}; after "
        f"re-adoption paused={still['paused']}, shards {still['shards']}; {sum(h['ok'] for h in held)} of "
        f"{len(held)} held requests completed after resume")
    call = {"version": None, "outcome": "restarted", "error": None, "began": round(began, 6),
            "ended": round(time.monotonic(), 6)}
    return {"calls": [call], "paused": paused, "generation": [info["generation"], back["generation"]],
            "after_restart": still, "resumed": resumed, "held": held,
            "sampled_while_paused": {s: n - before.get(s, 0) for s, n in sampled.items()},
            "after": {"gate_open": after["gate_open"], "version": after["version"]}}


# ---------------------------------------------------------------------------------- the proofs
def _held_finished(f: Mapping, wrong: list[str], version: int | None = None) -> None:
    held = f["held"]
    lost = [h for h in held if not h["ok"]]
    if lost:
        wrong.append(f"{len(lost)} of {len(held)} held request(s) did not complete: {[h['reason'] for h in lost][:3]}")
    for h in held:
        versions = [v for v, _, _ in h["spans"]]
        if h["ok"] and (versions != sorted(versions) or (versions and h["weight_version"] != versions[-1])):
            wrong.append(f"a held request's tags are out of order or its headline is not its last token's: {h}")
    if version is not None and not any(len({v for v, _, _ in h["spans"]}) > 1 for h in held if h["ok"]):
        wrong.append(f"no held request carries tokens of two versions: none was held across the refit of {version}")
    if version is not None and any(h["ok"] and h["spans"] and h["spans"][-1][0] != version for h in held):
        wrong.append(f"a held request finished after the refit on a version other than {version}")


def _sampled_nothing(f: Mapping, wrong: list[str], when: str) -> None:
    sampled = {s: n for s, n in f["sampled_while_paused"].items() if n}
    if sampled:
        wrong.append(f"engines sampled tokens while paused {when}: slot -> tokens {sampled}")


def prove_operator_resume_mid_refit(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    call, wrong = calls[0], []
    if call["outcome"] != "committed":
        return [f"the refit did not commit: {call['outcome']}: {call['error']}"]
    version = call["version"]
    owned = f["resumed"].get("at_refit_end") or []
    if not f["transfer_seen"] or not owned:
        wrong.append(f"the resume did not reach engines a refit owned (transfer seen: {f['transfer_seen']}, "
                     f"answer: {f['resumed']}): the fault did not fire")
    transfer = Phase.first(events, phase="transfer", edge="begin", version=version)
    stamp = Stamp.first(events, version=version)
    if transfer is None or stamp is None or not transfer.t <= f["resume_sent"] <= stamp.t:
        wrong.append(f"the resume was not sent between the transfer's begin and the stamp of version {version} "
                     f"(transfer {getattr(transfer, 't', None)}, resume {f['resume_sent']}, stamp {getattr(stamp, 't', None)})")
    if f["resumed"].get("resumed_on"):
        wrong.append(f"engines resumed mid-refit: {f['resumed']['resumed_on']}")
    _sampled_nothing(f, wrong, "for the refit")
    _held_finished(f, wrong, version)
    if not f["after"]["gate_open"]:
        wrong.append("the gate stayed closed after the refit the operator's resume waited for")
    return wrong


def prove_controller_kill_under_keep_pause(f: Mapping, calls: list[dict], events: list[Mapping | Record]) -> list[str]:
    wrong = []
    g0, g1 = f["generation"]
    if g1 != g0 + 1:
        wrong.append(f"the controller answered at generation {g1} after its kill at generation {g0}: not restarted once")
    still = f["after_restart"]
    if not still["paused"]:
        wrong.append("the restarted controller does not hold the operator's pause")
    running = {s: v for s, v in still["shards"].items() if not (v["paused"] and v["operator_hold"])}
    if running:
        wrong.append(f"engines not held paused for the operator after re-adoption: {running}")
    if not any(v["in_flight"] for v in still["shards"].values()):
        wrong.append("no engine held a request across the restart: the fault proved nothing")
    _sampled_nothing(f, wrong, "across the controller's restart")
    _held_finished(f, wrong)
    if not f["after"]["gate_open"]:
        wrong.append("the gate stayed closed after the operator's resume")
    return wrong
