"""The admission tracker: per-slot caps on in-flight requests for the ``SingleController``.

Owns ``AdmissionController``, the small stateful shell around the pure law in
``fleet.control.admission_law``: one ``AdmissionState`` per slot (and incarnation), the
slot's in-flight, peak, trough and finished counts, the refit window, the end of the
last pause, and the metrics. The controller polls each shard's ``EngineStats`` every
``poll_interval_s`` and passes them (or ``None`` when the call failed) to
``observe``, reports every dispatch (``on_dispatch``) and every end
(``on_finish``), drops a replaced incarnation (``forget``) and routes with
``caps()``. The law decides; this module only carries its decisions and counts.
Single-threaded; no Ray, no vLLM, no I/O, no clock reads (``now`` is an argument).

Paused engines: a paused engine takes no step, so its stats record grows old, and the
law must not read that silence as an absent engine (``update``'s ``paused``). Whether
the engines are paused is not decided here: the refit lifecycle reports its begin and
end (``refit_started``/``refit_finished``), the operator's pause is the health core's
record, read through the ``operator_pause`` callable the controller passes, and the
operator's resume reports its end (``operator_resumed``) so the absence clock restarts
there.

Guarantees on failure: ``observe`` never raises on bad or missing stats (the law
classifies them and never raises a cap on them); a slot whose KV capacity is not
known yet is capped at ``floor_cap``; with ``enabled=False`` every cap is
``ceiling``; an event from an older incarnation than the slot's current one is
ignored, so a late end on a replaced engine cannot disturb its successor. A cap
only gates admission: nothing in flight is ever cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from rlfleet.fleet.config.admission import AdmissionConfig, load_admission_config
from rlfleet.fleet.control.admission_law import AdmissionState, initial_cap, initial_state, update
from rlfleet.fleet.types import EngineStats

__all__ = ["AdmissionController"]


@dataclass
class _Slot:
    incarnation: int | None
    state: AdmissionState | None = None
    in_flight: int = 0
    peak: int = 0
    trough: int = 0
    finished: int = 0
    stats: EngineStats | None = None
    refit_preemptions: int = 0  # preemptions seen during refits (cache resets), never taken as load
    counts: dict[str, int] = field(default_factory=lambda: {"cut": 0, "preempt": 0, "grow": 0, "fallback": 0})


class AdmissionController:
    """Per-slot admission state for the ``SingleController`` (single-threaded, no I/O).

    ``incarnation`` arguments are optional; when given, an event from an older
    incarnation than the slot's current one is ignored and a newer one starts the
    slot afresh (as ``forget`` does), so a late end of a request on a replaced
    engine cannot disturb its successor's counts.
    """

    def __init__(self, cfg: AdmissionConfig | dict | None = None,
                 operator_pause: Callable[[], str | None] | None = None) -> None:
        """``operator_pause``: the operator's pause mode while it holds, else None (the health core's record,
        ``Ledger.operator_pause``); absent: never paused by an operator."""
        self.cfg = load_admission_config(cfg)
        self._slots: dict[int, _Slot] = {}
        self._refits_running = 0
        self.revision = 0  # grows whenever any cap may have changed (readers cache caps by it)
        self._refit_ended_at: float | None = None
        self._operator_pause = operator_pause or (lambda: None)
        self._resumed_at: float | None = None  # when the last pause (a refit's, the operator's) ended

    def refit_started(self) -> None:
        """A refit began (the engines will pause): polls hold until ``refit_grace_s`` after it ends."""
        self._refits_running += 1

    def refit_finished(self, now: float) -> None:
        """The refit ended (committed or not): its grace runs from ``now``, and so does the absence clock."""
        self._refits_running = max(0, self._refits_running - 1)
        self._refit_ended_at = now
        self._resumed(now)

    def operator_resumed(self, now: float) -> None:
        """The operator's pause ended and its engines were resumed: the absence clock restarts from ``now``."""
        self._resumed(now)

    def _resumed(self, now: float) -> None:
        self._resumed_at = now if self._resumed_at is None else max(self._resumed_at, now)

    def paused(self) -> bool:
        """The engines are paused now (a refit runs, or the operator's pause holds): their silence is not absence."""
        return bool(self._refits_running) or self._operator_pause() is not None

    def in_refit(self, now: float) -> bool:
        """True while a refit runs and for ``refit_grace_s`` after the last one ended."""
        if self._refits_running:
            return True
        return self._refit_ended_at is not None and now - self._refit_ended_at < self.cfg.refit_grace_s

    def _slot(self, slot: int, incarnation: int | None) -> _Slot | None:
        rec = self._slots.get(slot)
        if rec is None or (incarnation is not None and rec.incarnation is not None and incarnation > rec.incarnation):
            rec = self._slots[slot] = _Slot(incarnation)
        elif incarnation is not None and rec.incarnation is not None and incarnation < rec.incarnation:
            return None
        elif rec.incarnation is None:
            rec.incarnation = incarnation
        return rec

    def observe(self, slot: int, stats: EngineStats | None, now: float, incarnation: int | None = None) -> str | None:
        """Feed one poll (``None``: the stats call failed). Returns a reason worth logging, else None.

        A reason is returned when the cap or the latch changed, or the data went
        fresh/quiet/missing; plain holds return None (polls are frequent).
        """
        rec = self._slot(slot, incarnation)
        if rec is None:
            return None
        if stats is not None:
            rec.stats = stats
            self._load_from(rec, stats)
        if not self.cfg.enabled:
            return None
        prefix = f"slot {slot}" + (f" (incarnation {rec.incarnation})" if rec.incarnation is not None else "")
        first = ""
        if rec.state is None:
            if stats is None or initial_cap(stats, self.cfg) is None:
                return None
            rec.state = initial_state(stats, self.cfg, rec.finished)
            first = f"init: cap {rec.state.cap} (kv {stats.kv_cache_tokens} tokens / max len {stats.max_model_len}); "
        old = rec.state
        new, reason = update(
            old, stats, rec.in_flight, rec.finished, now, self.cfg, rec.peak, rec.trough, refit=self.in_refit(now),
            paused=self.paused(), resumed_at=self._resumed_at,
        )
        rec.state, rec.peak, rec.trough = new, rec.in_flight, rec.in_flight
        if first or new.cap != old.cap:
            self.revision += 1
        if new.rule in rec.counts:
            rec.counts[new.rule] += 1
        if new.rule == "refit" and old.preemptions is not None and new.preemptions is not None:
            rec.refit_preemptions += max(0, new.preemptions - old.preemptions)
        if first or new.cap != old.cap or new.latched != old.latched or new.data != old.data or (
            new.rule == "refit" and new.preemptions != old.preemptions
        ):
            return f"{prefix}: {first}{reason}"
        return None

    @staticmethod
    def _load_from(rec: _Slot, stats: EngineStats) -> None:
        """Requests go straight from clients to the shard, so the shard counts its own load: in flight now,
        finished so far, and the peak and trough since the last poll (``EngineShard.stats``)."""
        load = stats.extra.get("load") if isinstance(stats.extra, dict) else None
        if not load:
            return  # stats without the shard's counts (older shard, unit test): dispatch events count
        rec.in_flight = int(stats.in_flight)
        rec.finished = int(load.get("finished", rec.finished))
        rec.peak = max(int(load.get("peak", rec.in_flight)), rec.in_flight)
        rec.trough = min(int(load.get("trough", rec.in_flight)), rec.in_flight)

    def on_dispatch(self, slot: int, incarnation: int | None = None) -> None:
        """A request was sent to the slot."""
        rec = self._slot(slot, incarnation)
        if rec is not None:
            rec.in_flight += 1
            rec.peak = max(rec.peak, rec.in_flight)

    def on_finish(self, slot: int, incarnation: int | None = None) -> None:
        """A request sent to the slot ended, for any reason (completed, aborted, failed)."""
        rec = self._slots.get(slot)
        if rec is None or rec.in_flight == 0:
            return  # an end of a request this record never saw dispatched (forgotten incarnation)
        if incarnation is not None and rec.incarnation is not None and incarnation != rec.incarnation:
            return
        rec.in_flight -= 1
        rec.trough = min(rec.trough, rec.in_flight)
        rec.finished += 1

    def cap(self, slot: int) -> int:
        """The slot's cap: ``ceiling`` when disabled, ``floor_cap`` until its KV capacity is known."""
        if not self.cfg.enabled:
            return self.cfg.ceiling
        rec = self._slots.get(slot)
        return rec.state.cap if rec is not None and rec.state is not None else self.cfg.floor_cap

    def caps(self, slots: Iterable[int] | None = None) -> dict[int, int]:
        """Caps of ``slots`` (default: every slot seen). Pass the serving slots: a slot absent from
        the map has no cap in ``fleet.data.shard_choice.pick_two``."""
        return {s: self.cap(s) for s in (self._slots if slots is None else slots)}

    def forget(self, slot: int) -> None:
        """The slot's incarnation was replaced: its next stats start a fresh state."""
        self._slots.pop(slot, None)
        self.revision += 1

    def state(self, slot: int) -> AdmissionState | None:
        """The slot's law state; None until its KV capacity is known (or after ``forget``)."""
        rec = self._slots.get(slot)
        return rec.state if rec is not None else None

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per slot: cap, KV usage, running, waiting, preemptions, in flight, and the law's counters."""
        out: dict[int, dict[str, Any]] = {}
        for slot, rec in self._slots.items():
            st, s = rec.state, rec.stats
            out[slot] = {
                "incarnation": rec.incarnation,
                "cap": self.cap(slot),
                "capacity_cap": st.capacity_cap if st else None,
                "latched": st.latched if st else False,
                "data": st.data if st else None,
                "rule": st.rule if st else None,
                "in_flight": rec.in_flight,
                "finished": rec.finished,
                "kv_cache_usage": s.kv_cache_usage if s else None,
                "running": s.running if s else None,
                "waiting": s.waiting if s else None,
                "preemptions": s.preemptions if s else None,
                "kv_cache_tokens": s.kv_cache_tokens if s else None,
                "max_model_len": s.max_model_len if s else None,
                "cuts": rec.counts["cut"],
                "preempt_cuts": rec.counts["preempt"],
                "growths": rec.counts["grow"],
                "fallbacks": rec.counts["fallback"],
                "refit_preemptions": rec.refit_preemptions,
            }
        return out
