"""The admission law: one shard's cap on in-flight requests, driven by its engine's KV-cache load.

Owns ``AdmissionState`` and the pure functions that move it: ``initial_cap``,
``initial_state`` and ``update`` (one poll: state, stats, in-flight and finished
counts, the caller's time and the config in; the new state and a human-readable
reason out). No I/O, no clock reads (time is an argument), no Ray, no vLLM: the
tracker ``fleet.control.admission.AdmissionController`` keeps one state per slot and feeds it.

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
  reached the cap, and the pool turned over (below);
- **hold** otherwise, and always while a refit runs and for ``refit_grace_s`` after
  it (rule ``refit``): a refit pauses the engines and, unless the KV policy keeps the
  cache, its cache reset preempts every running request; those preemptions and the
  paused engine's usage say nothing about load, so the preemption baseline is moved
  past them and no cut or growth is taken;
- **hold** on missing stats while the engine is paused (rule ``paused``: a refit runs,
  or the operator's pause holds): a paused engine takes no step, so vLLM records
  nothing and its record only grows old; that silence is the pause's, not an absent
  engine's, so the absence clock does not run, and it restarts at the resume (the
  caller's ``resumed_at``): only silence after the resume counts toward the fallback.

Turnover: every cap change (start, cut, growth, fallback) and every drain of a
latch opens a window at ``(window_start = finished_total, window_cap = cap)``. The
pool has turned over once ``finished_total - window_start >= window_cap``: as many
requests ended on the shard since the window opened as the cap it was opened at.
Requests that end while a cut drains do not count (the window reopens at the
drain), so growth happens at most once per turnover of a pool admitted under the
current cap. Saturated: ``in_flight`` (or the peak between polls) reached ``cap``
at some poll since the window opened; a cap that was never reached is not grown
(it is not what limits the shard).

Guarantees on failure: the cap is always within ``[1, ceiling]``; stats that are
missing (call failed), unreadable (NaN, negative counts) or stale (record older
than ``stats_max_age_s`` while work is in flight) never raise the cap; after
``absent_fallback_s`` of missing stats on every poll (not counting a pause), the cap
drops to ``fallback_cap`` (a latched cut). An old record of an idle engine (nothing in
flight: vLLM records only while it steps) is *quiet*, not missing: the cap holds; so
is an old record of a paused engine.
``update`` never raises on bad stats (they are classified, not trusted); only
``initial_state`` refuses, naming the fields, stats that do not give a capacity.
A cap only gates admission: nothing in flight is ever cancelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace as _replace
from typing import Any

from rlfleet.fleet.config.admission import AdmissionConfig
from rlfleet.fleet.types import EngineStats


def replace(state: "AdmissionState", **changes: Any) -> "AdmissionState":
    """``dataclasses.replace``, but the same object when nothing changes: most polls of a steady shard
    change nothing, and building a new frozen state costs several microseconds per shard per poll."""
    for name, value in changes.items():
        if getattr(state, name) != value:
            return _replace(state, **changes)
    return state

__all__ = ["FRESH", "MISSING", "QUIET", "AdmissionState", "initial_cap", "initial_state", "update"]

# What the last poll told us about the engine's load.
FRESH = "fresh"  # a readable record no older than stats_max_age_s
QUIET = "quiet"  # the record is old because the engine has had nothing to do (0 in flight)
MISSING = "missing"  # call failed, unreadable, or stale while work is in flight


@dataclass(frozen=True)
class AdmissionState:
    """One shard's admission state (one incarnation). Build with ``initial_state``.

    - ``cap``: requests the dispatcher may have in flight on the shard.
    - ``capacity_cap``: the starting cap from the KV capacity; the soft floor of cuts.
    - ``latched``: a cut was taken and in-flight has not yet drained below ``cap``.
    - ``window_cap`` / ``window_start``: the cap set by the last cap change and the
      shard's ``finished_total`` at that moment (the turnover window).
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
    paused: bool = False,
    resumed_at: float | None = None,
) -> tuple[AdmissionState, str]:
    """Apply one poll to one shard's state; returns the new state and the reason.

    Arguments: ``stats`` as read from the shard (``None``: the call failed);
    ``in_flight``: requests the dispatcher has outstanding on the shard now;
    ``finished_total``: requests that ended on the shard (this incarnation) so far,
    for any reason; ``peak_in_flight`` / ``trough_in_flight``: the most / fewest in
    flight since the previous poll (both default to ``in_flight``); ``refit``: a refit
    is running or ended less than ``refit_grace_s`` ago; ``paused``: the engine is
    paused now (a refit runs, or the operator's pause holds); ``resumed_at``: when the
    last pause ended (None: never paused); ``now``: the caller's monotonic time.

    Order of the rules (turnover and saturation: see the module docstring):

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
       Missing while ``paused``: hold (rule ``paused``), and the absence clock stops (a
       paused engine is not absent); a run of missing polls that began before
       ``resumed_at`` is counted from ``resumed_at`` (a pause between two polls).
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
    """
    s, drained = _drain(state, in_flight, finished_total, cfg, peak_in_flight, trough_in_flight)
    s, data, why = _classify(s, stats, in_flight, now, cfg)
    if data == MISSING and paused:
        s, reason = replace(s, data=MISSING, missing_since=None, rule="paused"), (
            f"hold: {why}, engine paused (a refit or the operator's pause): its silence is not absence"
        )
    elif data == MISSING:
        s, reason = _on_missing(s, why, finished_total, now, cfg, resumed_at)
    elif data == QUIET:
        s, reason = replace(s, data=QUIET, missing_since=None, rule="hold"), f"hold: {why}"
    else:
        assert stats is not None  # _classify calls absent stats MISSING
        if refit:
            s, reason = _on_refit(s, stats)
        else:
            s = replace(s, data=FRESH, missing_since=None)
            s, reason = _on_fresh(s, stats, finished_total, cfg, drained=bool(drained))
    if drained and s.rule == "hold":
        s = replace(s, rule="drained")
    return s, drained + reason


def _drain(
    state: AdmissionState, in_flight: int, finished_total: int, cfg: AdmissionConfig,
    peak: int | None, trough: int | None,
) -> tuple[AdmissionState, str]:
    """Rule 1: bring the cap within bounds, then unlatch on a drain or note saturation.

    Returns the state and the drain's reason prefix ("" when nothing drained).
    """
    if not 1 <= state.cap <= cfg.ceiling:  # a state from another config: bring it within bounds
        state = replace(state, cap=max(1, min(state.cap, cfg.ceiling)))
    reached = max(in_flight, peak if peak is not None else in_flight)
    low = min(in_flight, trough if trough is not None else in_flight)
    if not (state.latched and low < state.cap):
        return replace(state, saturated=state.saturated or reached >= state.cap), ""
    s = replace(state, latched=False, window_start=finished_total, window_cap=state.cap, saturated=False)
    seen = f"{in_flight} in flight" if low == in_flight else f"{low} in flight since the last poll"
    return s, f"drained ({seen} < cap {s.cap}); "


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


def _on_missing(s: AdmissionState, why: str, finished_total: int, now: float, cfg: AdmissionConfig,
                resumed_at: float | None = None):
    since = s.missing_since if s.missing_since is not None else now
    if resumed_at is not None and since < resumed_at <= now:  # the run spans a pause: only what followed it counts
        since = resumed_at
    s = replace(s, data=MISSING, missing_since=since)
    absent = now - since
    if absent >= cfg.absent_fallback_s and s.cap > cfg.floor_cap:
        new = cfg.floor_cap
        s = _set_cap(s, new, finished_total, rule="fallback", latched=True)
        return s, f"fallback: {why} for {absent:.1f} s >= {cfg.absent_fallback_s:g} s; cap -> {new} (latched)"
    return replace(s, rule="hold"), f"hold: {why}; growth frozen (missing for {absent:.1f} s)"


def _on_refit(s: AdmissionState, stats: EngineStats):
    """Rule 4: hold, and move the preemption baseline past the refit's cache reset."""
    rebased = max(0, stats.preemptions - s.preemptions) if s.preemptions is not None else 0
    s = replace(s, data=FRESH, missing_since=None, preemptions=stats.preemptions, rule="refit")
    reason = "refit: hold (engine paused or just resumed)" + (
        f"; {rebased} preemption(s) from its cache reset not counted" if rebased else ""
    )
    return s, reason


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
