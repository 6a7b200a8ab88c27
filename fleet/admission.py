"""Admission control: each shard's cap on in-flight requests, driven by its engine's KV-cache load.

Owns the control law (``update``, a pure function of stats, state and time) and the
small stateful ``AdmissionController`` the ``SingleController`` drives: it polls
each shard's ``EngineStats`` every ``poll_interval_s``, passes them (or ``None``
when the call failed) to ``observe``, reports every dispatch and every end, and
routes with ``caps()``. No Ray, no vLLM, no I/O here.

The law, per shard (thresholds from ``AdmissionConfig``):

- **start** at ``kv_cache_tokens // max_model_len`` (how many max-length sequences
  the KV cache holds), clamped to ``[1, ceiling]``;
- **cut** (``cap * cut_factor``, at least 1) when KV usage is above ``high_mark`` or
  the cumulative preemption counter rose since the last fresh poll. The starting
  cap is a soft floor: a cut from above it stops at it, and at or below it only
  preemptions cut (every request admitted there fits at max length, so a full cache
  is not an overload; preemptions say the capacity estimate is wrong, e.g. requests
  that sample several sequences). A cut *latches*: no further cut and no growth
  until the shard's in-flight count has drained below the new cap (at a poll or at
  any moment between two polls), so one spike gives one cut; preemptions reported
  with the drain are that spike's (its overflow still ran) and do not cut again;
- **grow** (``max(cap + 1, cap * growth_factor)``, at most ``ceiling``) when KV
  usage is below ``low_mark``, nothing is waiting, the latch is off, in flight
  reached the cap, and the pool turned over (see ``update``);
- **hold** otherwise, and always while a refit runs and for ``refit_grace_s`` after
  it (rule ``refit``): a refit pauses the engines and, unless the KV policy keeps the
  cache, its cache reset preempts every running request; those preemptions and the
  paused engine's usage say nothing about load, so the preemption baseline is moved
  past them and no cut or growth is taken.

Guarantees on failure: the cap is always within ``[1, ceiling]``; stats that are
missing (call failed), unreadable (NaN, negative counts) or stale (record older
than ``stats_max_age_s`` while work is in flight) never raise the cap; after
``absent_fallback_s`` of missing stats on every poll, the cap drops to
``fallback_cap`` (a latched cut). An old record of an idle engine (nothing in
flight: vLLM records only while it steps) is *quiet*, not missing: the cap holds.
A cap only gates admission: nothing in flight is ever cancelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fleet.types import EngineStats

__all__ = [
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionState",
    "initial_cap",
    "initial_state",
    "load_admission_config",
    "update",
]

# What the last poll told us about the engine's load.
FRESH = "fresh"  # a readable record no older than stats_max_age_s
QUIET = "quiet"  # the record is old because the engine has had nothing to do (0 in flight)
MISSING = "missing"  # call failed, unreadable, or stale while work is in flight


class AdmissionConfig(BaseModel):
    """Knobs of the admission law; defaults suit a shard polled twice a second.

    - ``ceiling``: the cap never exceeds this (``FleetConfig.admission.ceiling``).
    - ``fallback_cap``: the conservative cap of a shard whose stats have been missing
      for ``absent_fallback_s`` or whose KV capacity is not known yet (at most ``ceiling``
      is used).
    - ``low_mark`` < ``high_mark``: KV usage fractions (0 < low < high <= 1). Usage
      strictly above ``high_mark`` cuts; ``high_mark = 1`` leaves only preemptions to cut.
    - ``cut_factor`` (0 < f < 1) and ``growth_factor`` (> 1): multiplicative steps.
    - ``poll_interval_s``: how often the controller reads each shard's stats.
    - ``stats_max_age_s``: a record older than this counts as missing.
    - ``absent_fallback_s`` (>= ``stats_max_age_s``): how long stats may be missing on
      every poll before the cap drops to ``fallback_cap``.
    - ``refit_grace_s``: after a refit ends, how long its effects (the preemptions of a
      cache reset, which the engine reports with its first steps after the resume) are
      not taken as load signals.
    - ``enabled``: False pins every cap at ``ceiling`` (stats are still kept for metrics).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ceiling: int = Field(256, ge=1)
    fallback_cap: int = Field(4, ge=1)
    low_mark: float = Field(0.6, gt=0, lt=1)
    high_mark: float = Field(0.9, gt=0, le=1)
    cut_factor: float = Field(0.5, gt=0, lt=1)
    growth_factor: float = Field(1.25, gt=1, le=16)
    poll_interval_s: float = Field(0.5, gt=0, allow_inf_nan=False)
    stats_max_age_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    absent_fallback_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    refit_grace_s: float = Field(1.0, ge=0, allow_inf_nan=False)
    enabled: bool = True

    @field_validator("high_mark")
    @classmethod
    def _high_above_low(cls, v: float, info: ValidationInfo) -> float:
        low = info.data.get("low_mark")
        if low is not None and v <= low:
            raise ValueError(f"high_mark must be > low_mark ({low}) and <= 1")
        return v

    @field_validator("absent_fallback_s")
    @classmethod
    def _absence_after_staleness(cls, v: float, info: ValidationInfo) -> float:
        max_age = info.data.get("stats_max_age_s")
        if max_age is not None and v < max_age:
            raise ValueError(f"absent_fallback_s must be >= stats_max_age_s ({max_age})")
        return v

    @property
    def floor_cap(self) -> int:
        """The fallback cap actually used: ``fallback_cap``, never above ``ceiling``."""
        return min(self.fallback_cap, self.ceiling)


def load_admission_config(
    data: dict[str, Any] | AdmissionConfig | None = None, prefix: str = "admission"
) -> AdmissionConfig:
    """Validate an admission config; raises ``ConfigError`` naming the field (``admission.high_mark``)."""
    from fleet.config import validate

    if isinstance(data, AdmissionConfig):
        return data
    return validate(AdmissionConfig, dict(data or {}), prefix)


@dataclass(frozen=True)
class AdmissionState:
    """One shard's admission state (one incarnation). Build with ``initial_state``.

    - ``cap``: requests the dispatcher may have in flight on the shard.
    - ``capacity_cap``: the starting cap from the KV capacity; the soft floor of cuts.
    - ``latched``: a cut was taken and in-flight has not yet drained below ``cap``.
    - ``window_cap`` / ``window_start``: the cap set by the last cap change and the
      shard's ``finished_total`` at that moment (the turnover window, see ``update``).
    - ``saturated``: in flight reached ``cap`` at some poll since the last cap change.
    - ``preemptions``: the cumulative preemption count at the last fresh poll.
    - ``record`` / ``record_seen_at``: the last ``EngineStats.updated_at`` seen and the
      caller's time of the first poll that saw it (the record's age is measured from
      there, on the caller's clock: no clock is compared across processes or hosts).
    - ``missing_since``: time of the first poll of the current run of missing stats.
    - ``data``: fresh / quiet / missing, from the last poll; ``rule``: the rule applied.
    """

    cap: int
    capacity_cap: int
    window_cap: int
    window_start: int
    latched: bool = False
    saturated: bool = False
    preemptions: int | None = None
    record: float | None = None
    record_seen_at: float | None = None
    missing_since: float | None = None
    data: str = QUIET
    rule: str = "init"


def initial_cap(stats: EngineStats | None, cfg: AdmissionConfig) -> int | None:
    """``kv_cache_tokens // max_model_len`` clamped to ``[1, ceiling]``; None while the capacity is unknown."""
    if stats is None:
        return None
    tokens, max_len = stats.kv_cache_tokens, stats.max_model_len
    if not _is_count(tokens) or not _is_count(max_len) or tokens <= 0 or max_len <= 0:
        return None
    return max(1, min(cfg.ceiling, tokens // max_len))


def initial_state(stats: EngineStats, cfg: AdmissionConfig, finished_total: int = 0) -> AdmissionState:
    """The starting state of a shard whose stats report its KV capacity.

    Raises ``ValueError`` when they do not (``kv_cache_tokens`` or ``max_model_len``
    missing or 0): the caller keeps such a shard at ``cfg.floor_cap`` until they do.
    """
    cap = initial_cap(stats, cfg)
    if cap is None:
        raise ValueError(
            f"cannot size admission: kv_cache_tokens={stats.kv_cache_tokens!r}, "
            f"max_model_len={stats.max_model_len!r} (both must be positive integers)"
        )
    preemptions = stats.preemptions if _is_count(stats.preemptions) and stats.preemptions >= 0 else None
    return AdmissionState(
        cap=cap, capacity_cap=cap, window_cap=cap, window_start=finished_total, preemptions=preemptions
    )


def update(
    state: AdmissionState,
    stats: EngineStats | None,
    in_flight: int,
    finished_total: int,
    now: float,
    cfg: AdmissionConfig,
    peak_in_flight: int | None = None,
    trough_in_flight: int | None = None,
    refit: bool = False,
) -> tuple[AdmissionState, str]:
    """Apply one poll to one shard's state; returns the new state and the reason.

    Arguments: ``stats`` as read from the shard (``None``: the call failed);
    ``in_flight``: requests the dispatcher has outstanding on the shard now;
    ``finished_total``: requests that ended on the shard (this incarnation) so far,
    for any reason; ``peak_in_flight`` / ``trough_in_flight``: the most / fewest in
    flight since the previous poll (both default to ``in_flight``); ``refit``: a refit
    is running or ended less than ``refit_grace_s`` ago; ``now``: the caller's
    monotonic time.

    Order of the rules:

    1. *Drain*: a latched state unlatches once in flight fell below ``cap``, at this
       poll or at any moment since the previous one (``trough_in_flight``): with a
       backlog the dispatcher refills a freed place at once, so a poll may never see
       fewer than ``cap`` in flight although the pool drained long ago.
    2. *Classify the data.* Missing: ``stats`` is None or unreadable, or its record is
       older than ``stats_max_age_s`` while work is in flight. Quiet: the record is
       old (or absent) but the shard and the dispatcher both have 0 in flight, so an
       idle engine explains it. Fresh otherwise. The age of a record is ``now`` minus
       the time of the first poll that saw its ``updated_at`` (a new value is age 0).
    3. Missing: hold (never grow). Once stats have been missing on every poll for
       ``absent_fallback_s``, drop to ``floor_cap`` as a latched cut (rule ``fallback``).
       Quiet: hold, and the absence clock stops (an idle engine is not absent).
    4. Fresh during a refit (``refit``): hold (rule ``refit``); the preemption
       baseline moves to the current count, so a cache reset's preemptions never cut.
    5. Fresh: *cut* if usage > ``high_mark`` or preemptions rose since the last fresh
       poll (``preempt``), unless latched (one cut per spike), to
       ``max(capacity_cap, cap * cut_factor)`` from above ``capacity_cap``; at or
       below it, usage alone holds and preemptions cut to ``cap * cut_factor`` (at
       least 1). Preemptions that rose by the poll that sees a drain belong to the
       drained spike: the baseline moves, only usage can cut. Else *grow* if usage <
       ``low_mark``, ``waiting == 0``, not latched, saturated, below the ceiling, and
       the pool turned over. Else hold.

    Turnover: every cap change (start, cut, growth, fallback) and every drain of a
    latch opens a window at ``(window_start = finished_total, window_cap = cap)``.
    The pool has turned over once ``finished_total - window_start >= window_cap``: as
    many requests ended on the shard since the window opened as the cap it was
    opened at. Requests that end while a cut drains do not count (the window reopens
    at the drain), so growth happens at most once per turnover of a pool admitted
    under the current cap. Saturated: ``in_flight`` (or the peak between polls)
    reached ``cap`` at some poll since the window opened; a cap that was never
    reached is not grown (it is not what limits the shard).
    """
    if not 1 <= state.cap <= cfg.ceiling:  # a state from another config: bring it within bounds
        state = replace(state, cap=max(1, min(state.cap, cfg.ceiling)))
    reached = max(in_flight, peak_in_flight if peak_in_flight is not None else in_flight)
    low = min(in_flight, trough_in_flight if trough_in_flight is not None else in_flight)
    drained = ""
    if state.latched and low < state.cap:
        s = replace(state, latched=False, window_start=finished_total, window_cap=state.cap, saturated=False)
        seen = f"{in_flight} in flight" if low == in_flight else f"{low} in flight since the last poll"
        drained = f"drained ({seen} < cap {s.cap}); "
    else:
        s = replace(state, saturated=state.saturated or reached >= state.cap)
    s, data, why = _classify(s, stats, in_flight, now, cfg)
    if data == MISSING:
        s, reason = _on_missing(s, why, finished_total, now, cfg)
    elif data == QUIET:
        s, reason = replace(s, data=QUIET, missing_since=None, rule="hold"), f"hold: {why}"
    elif refit:
        rebased = max(0, stats.preemptions - s.preemptions) if s.preemptions is not None else 0
        s = replace(s, data=FRESH, missing_since=None, preemptions=stats.preemptions, rule="refit")
        reason = "refit: hold (engine paused or just resumed)" + (
            f"; {rebased} preemption(s) from its cache reset not counted" if rebased else ""
        )
    else:
        s = replace(s, data=FRESH, missing_since=None)
        s, reason = _on_fresh(s, stats, finished_total, cfg, drained=bool(drained))
    if drained and s.rule == "hold":
        s = replace(s, rule="drained")
    return s, drained + reason


def _classify(s: AdmissionState, stats: EngineStats | None, in_flight: int, now: float, cfg: AdmissionConfig):
    """Return (state with the record tracked, fresh/quiet/missing, why)."""
    if stats is None:
        return s, MISSING, "stats call failed"
    problem = _unreadable(stats)
    if problem:
        return s, MISSING, f"unreadable stats ({problem})"
    ua = stats.updated_at
    if ua is None:
        age = None
    elif s.record is None or ua != s.record:
        s, age = replace(s, record=float(ua), record_seen_at=now), 0.0
    else:
        age = max(0.0, now - (s.record_seen_at if s.record_seen_at is not None else now))
    if age is not None and age <= cfg.stats_max_age_s:
        return s, FRESH, ""
    old = "no stats record yet" if age is None else f"stats record {age:.1f} s old > {cfg.stats_max_age_s:g} s"
    if stats.in_flight == 0 and in_flight == 0:
        return s, QUIET, f"{old}, engine idle"
    return s, MISSING, f"{old} with {max(in_flight, stats.in_flight)} in flight"


def _unreadable(stats: EngineStats) -> str:
    usage = stats.kv_cache_usage
    if isinstance(usage, bool) or not isinstance(usage, (int, float)) or not math.isfinite(usage):
        return f"kv_cache_usage={usage!r}"
    if not 0.0 <= usage <= 1.0:
        return f"kv_cache_usage={usage!r} outside [0, 1]"
    for name in ("running", "waiting", "preemptions", "in_flight"):
        v = getattr(stats, name)
        if not _is_count(v) or v < 0:
            return f"{name}={v!r}"
    ua = stats.updated_at
    if ua is not None and (isinstance(ua, bool) or not isinstance(ua, (int, float)) or not math.isfinite(ua)):
        return f"updated_at={ua!r}"
    return ""


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _on_missing(s: AdmissionState, why: str, finished_total: int, now: float, cfg: AdmissionConfig):
    since = s.missing_since if s.missing_since is not None else now
    s = replace(s, data=MISSING, missing_since=since)
    absent = now - since
    if absent >= cfg.absent_fallback_s and s.cap > cfg.floor_cap:
        new = cfg.floor_cap
        s = _set_cap(s, new, finished_total, rule="fallback", latched=True)
        return s, f"fallback: {why} for {absent:.1f} s >= {cfg.absent_fallback_s:g} s; cap -> {new} (latched)"
    return replace(s, rule="hold"), f"hold: {why}; growth frozen (missing for {absent:.1f} s)"


def _on_fresh(s: AdmissionState, stats: EngineStats, finished_total: int, cfg: AdmissionConfig, drained: bool = False):
    usage = float(stats.kv_cache_usage)
    rose = 0
    if s.preemptions is not None and stats.preemptions > s.preemptions:
        rose = stats.preemptions - s.preemptions
    s = replace(s, preemptions=stats.preemptions)  # a counter that went back (new engine) rebases silently
    if drained and rose:
        # Preempted while the latched spike drained (its overflow still ran): that spike was cut for already.
        s, reason = _judge(s, usage, 0, stats.waiting, finished_total, cfg)
        return s, f"{rose} preemption(s) of the drained spike not counted; {reason}"
    return _judge(s, usage, rose, stats.waiting, finished_total, cfg)


def _judge(s: AdmissionState, usage: float, rose: int, waiting: int, finished_total: int, cfg: AdmissionConfig):
    """Cut, grow or hold on fresh data: KV ``usage`` and ``rose`` new preemptions."""
    signal = ""
    if usage > cfg.high_mark:
        signal = f"kv usage {usage:.2f} > high mark {cfg.high_mark:g}"
    if rose:
        signal = f"{signal} and " if signal else ""
        signal += f"{rose} preemption(s) since the last poll"
    if signal:
        if s.latched:
            return replace(s, rule="hold"), f"hold: {signal}, cut already taken for this spike (latched)"
        if s.cap == 1:
            return replace(s, rule="hold"), f"hold: {signal}; cap already at the floor of 1"
        if not rose and s.cap <= s.capacity_cap:
            return replace(s, rule="hold"), (
                f"hold: {signal}, but cap {s.cap} <= KV capacity cap {s.capacity_cap}: "
                "every admitted request fits at max length (only preemptions cut below it)"
            )
        lowest = s.capacity_cap if s.cap > s.capacity_cap else 1
        new = max(lowest, math.floor(s.cap * cfg.cut_factor))
        rule = "preempt" if rose and usage <= cfg.high_mark else "cut"
        old = s.cap
        s = _set_cap(s, new, finished_total, rule=rule, latched=True)
        return s, f"{rule}: {signal}; cap {old} -> {new} (latched until in flight < {new})"
    if usage < cfg.low_mark and waiting == 0:
        return _try_grow(s, usage, finished_total, cfg)
    return replace(s, rule="hold"), f"hold: kv usage {usage:.2f}, {waiting} waiting"


def _try_grow(s: AdmissionState, usage: float, finished_total: int, cfg: AdmissionConfig):
    done = finished_total - s.window_start
    blocked = ""
    if s.latched:
        blocked = "latched"
    elif s.cap >= cfg.ceiling:
        blocked = f"at ceiling {cfg.ceiling}"
    elif not s.saturated:
        blocked = f"cap {s.cap} not reached since the last change"
    elif done < s.window_cap:
        blocked = f"turnover {done}/{s.window_cap}"
    if blocked:
        return replace(s, rule="hold"), f"hold: kv usage {usage:.2f} low but {blocked}"
    new = min(cfg.ceiling, max(s.cap + 1, math.floor(s.cap * cfg.growth_factor)))
    why = f"kv usage {usage:.2f} < low mark {cfg.low_mark:g}, nothing waiting, turnover {done}/{s.window_cap}"
    old = s.cap
    return _set_cap(s, new, finished_total, rule="grow", latched=False), f"grow: {why}; cap {old} -> {new}"


def _set_cap(s: AdmissionState, cap: int, finished_total: int, rule: str, latched: bool) -> AdmissionState:
    """A cap change: opens a new turnover window and clears saturation."""
    return replace(
        s, cap=cap, window_cap=cap, window_start=finished_total, saturated=False, latched=latched, rule=rule
    )


# ---------------------------------------------------------------------- the stateful wrapper
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

    def __init__(self, cfg: AdmissionConfig | dict | None = None) -> None:
        self.cfg = load_admission_config(cfg)
        self._slots: dict[int, _Slot] = {}
        self._refits_running = 0
        self._refit_ended_at: float | None = None

    def refit_started(self) -> None:
        """A refit began (the engines will pause): polls hold until ``refit_grace_s`` after it ends."""
        self._refits_running += 1

    def refit_finished(self, now: float) -> None:
        """The refit ended (committed or not): its grace runs from ``now``."""
        self._refits_running = max(0, self._refits_running - 1)
        self._refit_ended_at = now

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
        if not self.cfg.enabled:
            return None
        prefix = f"slot {slot}" + (f" (incarnation {rec.incarnation})" if rec.incarnation is not None else "")
        first = ""
        if rec.state is None:
            if initial_cap(stats, self.cfg) is None:
                return None
            rec.state = initial_state(stats, self.cfg, rec.finished)
            first = f"init: cap {rec.state.cap} (kv {stats.kv_cache_tokens} tokens / max len {stats.max_model_len}); "
        old = rec.state
        new, reason = update(
            old, stats, rec.in_flight, rec.finished, now, self.cfg, rec.peak, rec.trough, refit=self.in_refit(now)
        )
        rec.state, rec.peak, rec.trough = new, rec.in_flight, rec.in_flight
        if new.rule in rec.counts:
            rec.counts[new.rule] += 1
        if new.rule == "refit" and old.preemptions is not None and new.preemptions is not None:
            rec.refit_preemptions += max(0, new.preemptions - old.preemptions)
        if first or new.cap != old.cap or new.latched != old.latched or new.data != old.data or (
            new.rule == "refit" and new.preemptions != old.preemptions
        ):
            return f"{prefix}: {first}{reason}"
        return None

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
        the map has no cap in ``pick_shard``."""
        return {s: self.cap(s) for s in (self._slots if slots is None else slots)}

    def forget(self, slot: int) -> None:
        """The slot's incarnation was replaced: its next stats start a fresh state."""
        self._slots.pop(slot, None)

    def state(self, slot: int) -> AdmissionState | None:
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
