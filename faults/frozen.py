"""Proof for a shard frozen between refits: evicted within the detection bound, its requests re-sent.

A frozen shard answers nothing, so its requests would wait for their own deadline
(``request_timeout_s``, 600 s by default). The fleet promises better. The
controller's probes find the freeze within ``hang_detection_bound_s``
(``FleetConfig``). It then kills the shard, the kill fails the calls in flight on
it, and their clients re-send them at once. ``prove_resent`` checks that promise
from the records, for the freeze of one slot:

- the fault journal's line of the freeze going off (slot, incarnation, ``t``),
  written before the shard stopped answering;
- the controller's ``kill`` record of that incarnation with ``evicted`` in its
  reason, no later than ``bound_s`` (plus ``slack_s``) after the freeze;
- the clients' ``request`` records: at least one ``requeued`` naming that
  incarnation after the freeze (a request was in flight on it), each no later than
  ``slack_s`` after the kill (re-sent at the kill, not at its own deadline), and
  each such request then ``completed``.

The same holds for a shard whose engine core alone froze (``freeze_core``: the actor
still answers), within ``stall_detection_bound_s``: with a request in flight, its
engine makes no progress (``health.progress``); idle, its ping's core check fails. ``prove_core_reaped`` checks the rest of
that promise: the stopped engine-core processes the journal names died with the
eviction (a stopped process ignores everything but SIGKILL; one left behind would
hold its memory, on a GPU its device, for good).

Pure: records in, one sentence per broken promise out (an empty list: proven).
Records carry ``time.monotonic()`` of their process, one clock on one host.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from rlfleet.fleet.records import Kill, Record, Request

__all__ = ["FREEZES", "prove_core_reaped", "prove_resent"]

FREEZES = ("freeze", "freeze_core")


def _names(reason: str, slot: int, incarnation: int) -> bool:
    return f"slot {slot} (incarnation {incarnation})" in reason


def prove_resent(events: Iterable[Mapping | Record], journal: Iterable[Mapping], slot: int, bound_s: float,
                 slack_s: float = 1.5, measured: dict | None = None) -> list[str]:
    """Sentences naming what did not happen (module docstring); empty when the freeze of ``slot`` was
    found within ``bound_s`` and the requests it held were re-sent at its eviction and completed.
    ``measured`` (when given) receives ``evicted_after_s``, ``bound_s`` and ``resent``."""
    shot = next((r for r in journal if r.get("slot") == slot and r.get("action") in FREEZES), None)
    if shot is None:
        return [f"slot {slot} never froze: the fault journal has no freeze of it"]
    inc, t_freeze = shot["incarnation"], shot["t"]
    kill = Kill.first(events, lambda k: "evicted" in k.reason and k.t >= t_freeze, slot=slot, incarnation=inc)
    if kill is None:
        return [f"slot {slot} (incarnation {inc}) froze at t={t_freeze:.3f} but was never evicted"]
    problems = []
    found = kill.t - t_freeze
    if found > bound_s + slack_s:
        problems.append(f"slot {slot} (incarnation {inc}) was evicted {found:.2f} s after it froze, past the "
                        f"detection bound of {bound_s:.2f} s (+{slack_s:g} s slack)")
    resent = Request.among(events, lambda r: r.t >= t_freeze and _names(str(r.reason), slot, inc),
                           event=Request.REQUEUED)
    if measured is not None:
        measured.update(evicted_after_s=round(found, 3), bound_s=bound_s, resent=len(resent))
    if not resent:
        problems.append(f"no request was re-sent from slot {slot} (incarnation {inc}): none was in flight on it "
                        "when it froze, so the variant proves nothing about its requests")
    late = [r for r in resent if r.t > kill.t + slack_s]
    if late:
        problems.append(f"{len(late)} request(s) held by frozen slot {slot} were re-sent only "
                        f"{max(r.t for r in late) - kill.t:.2f} s after its eviction, not at it")
    completed = {r.request_id for r in Request.among(events, event=Request.COMPLETED)}
    lost = sorted({r.request_id for r in resent} - completed)
    if lost:
        problems.append(f"request(s) {lost[:5]} re-sent from frozen slot {slot} never completed")
    return problems


def prove_core_reaped(journal: Iterable[Mapping], slot: int, alive: Callable[[int], bool]) -> list[str]:
    """Sentences naming what did not happen; empty when every engine-core process that ``freeze_core``
    stopped on ``slot`` (the journal's ``engine_pids``) is gone: ``alive(pid)`` is False for each."""
    shot = next((r for r in journal if r.get("slot") == slot and r.get("action") == "freeze_core"), None)
    if shot is None:
        return [f"slot {slot}'s engine core never froze: the fault journal has no freeze_core of it"]
    pids = list(shot.get("engine_pids") or ())
    if not pids:
        return [f"the freeze_core of slot {slot} (incarnation {shot['incarnation']}) stopped no engine-core process"]
    left = [pid for pid in pids if alive(pid)]
    if left:
        return [f"engine-core process(es) {left} of slot {slot} (incarnation {shot['incarnation']}) outlived its "
                "eviction (stopped, holding their memory)"]
    return []
