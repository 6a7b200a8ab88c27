"""Property tests of the admission law (``fleet.control.admission_law``): random configurations and
random sequences of polls (fresh, repeated or absent records, failed calls, unreadable
stats, usage, waiting, preemptions, in-flight and finished counts, clock steps). The
expectations are computed from what the test fed in, not read back from the law's state."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from rlfleet.fleet.config.admission import AdmissionConfig
from rlfleet.fleet.control.admission_law import AdmissionState, initial_state, update
from rlfleet.fleet.types import EngineStats


@st.composite
def configs(draw) -> AdmissionConfig:
    low = draw(st.sampled_from([0.3, 0.5, 0.6]))
    max_age = draw(st.sampled_from([1.0, 5.0]))
    return AdmissionConfig(
        ceiling=draw(st.integers(1, 300)),
        fallback_cap=draw(st.integers(1, 8)),
        low_mark=low,
        high_mark=draw(st.sampled_from([low + 0.1, 0.9, 1.0])),
        cut_factor=draw(st.sampled_from([0.1, 0.5, 0.7, 0.95])),
        growth_factor=draw(st.sampled_from([1.01, 1.25, 2.0])),
        stats_max_age_s=max_age,
        absent_fallback_s=max_age * draw(st.sampled_from([1, 3])),
    )


@dataclass(frozen=True)
class Poll:
    kind: str  # "new" record, "same" record as last poll, "none" (call failed), "bad" (unreadable), "unrecorded"
    usage: float
    waiting: int
    preempted: int  # preemptions since the previous poll
    in_flight: int
    ended: int  # requests that ended since the previous poll
    dt: float
    refit: bool = False  # a refit runs (or ended within its grace) at this poll
    paused: bool = False  # the engine is paused at this poll (a refit, the operator's pause)


polls = st.builds(
    Poll,
    kind=st.sampled_from(["new", "new", "new", "same", "same", "none", "bad", "unrecorded"]),
    usage=st.sampled_from([0.0, 0.1, 0.5, 0.65, 0.89, 0.9, 0.95, 1.0]),
    waiting=st.sampled_from([0, 0, 0, 1, 5]),
    preempted=st.sampled_from([0, 0, 0, 0, 1, 3]),
    in_flight=st.integers(0, 320),
    ended=st.integers(0, 40),
    dt=st.sampled_from([0.0, 0.5, 0.5, 2.0, 6.0, 40.0]),
    refit=st.sampled_from([False, False, False, True]),
    paused=st.sampled_from([False, False, False, True]),
)


class Feed:
    """Turns ``Poll``s into ``EngineStats`` and remembers what the test itself fed in."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.finished = 0
        self.preemptions = 0
        self.ua = 0.0
        self.seen_at: float | None = None

    def next(self, p: Poll) -> EngineStats | None:
        self.now += p.dt
        self.finished += p.ended
        self.preemptions += p.preempted
        if p.kind == "none":
            return None
        if p.kind == "new" or (p.kind == "same" and self.seen_at is None):  # a first sight is a new record
            self.ua += p.kind == "new"
            self.seen_at = self.now
        ua = None if p.kind == "unrecorded" else self.ua
        usage = math.nan if p.kind == "bad" else p.usage
        s = EngineStats(
            kv_cache_usage=usage, kv_cache_tokens=1 << 20, max_model_len=512, running=p.in_flight,
            waiting=p.waiting, preemptions=self.preemptions, in_flight=p.in_flight, updated_at=ua,
        )
        return s

    def fresh(self, p: Poll, cfg: AdmissionConfig) -> bool:
        """Readable stats whose record the test first fed at most ``stats_max_age_s`` ago."""
        if p.kind in ("none", "bad", "unrecorded") or self.seen_at is None:
            return False
        return self.now - self.seen_at <= cfg.stats_max_age_s


@settings(max_examples=300, deadline=None)
@given(cfg=configs(), cap0=st.integers(1, 300), kv_cap=st.integers(1, 300), seq=st.lists(polls, max_size=60))
def test_cap_stays_in_bounds_and_never_grows_without_fresh_low_usage(cfg, cap0, kv_cap, seq):
    """... and never cuts on fresh data during a refit, nor below the KV capacity cap without preemptions, nor
    on missing data while the engine is paused (its silence is the pause's)."""
    cap0 = min(cap0, cfg.ceiling)
    kv_cap = min(kv_cap, cap0)
    s = AdmissionState(cap=cap0, capacity_cap=kv_cap, window_cap=cap0, window_start=0)
    feed = Feed()
    window = (0, cap0)  # (finished, cap) when the turnover window last opened, as the test sees it
    preempted = None  # preemptions fed since the last fresh poll (None: no fresh poll yet, no baseline)
    for p in seq:
        stats = feed.next(p)
        fresh = feed.fresh(p, cfg)
        if preempted is not None:
            preempted += p.preempted
        old = s
        s, reason = update(s, stats, p.in_flight, feed.finished, feed.now, cfg, refit=p.refit, paused=p.paused)
        assert 1 <= s.cap <= cfg.ceiling, reason
        event(f"rule {s.rule}")
        if fresh and p.refit:
            assert s.cap == old.cap and s.rule == "refit", reason
        if s.data == "missing" and p.paused:
            assert s.cap == old.cap and s.rule == "paused" and s.missing_since is None, reason
        if s.rule in ("cut", "preempt"):
            assert s.cap < old.cap
            if old.cap > kv_cap:
                assert s.cap >= kv_cap, f"cut below the KV capacity cap {kv_cap} from above it: {reason}"
            else:
                assert preempted, f"cut at or below the KV capacity cap {kv_cap} without preemptions: {reason}"
        if old.latched and p.in_flight < old.cap:
            window = (feed.finished, old.cap)
        if s.cap > old.cap:
            assert fresh, f"grew on missing/stale stats: {reason}"
            assert p.usage < cfg.low_mark and p.waiting == 0 and not preempted and not p.refit, reason
            assert not old.latched
            assert feed.finished - window[0] >= window[1], f"grew before a turnover: {reason}"
        if not fresh:
            assert s.cap <= old.cap, reason
            assert s.data in ("missing", "quiet")
        if s.cap != old.cap:
            window = (feed.finished, s.cap)
        if fresh:
            preempted = 0


@settings(max_examples=200, deadline=None)
@given(
    cfg=configs(),
    cap0=st.integers(2, 300),
    kv_cap=st.integers(1, 300),
    n=st.integers(1, 30),
    usages=st.lists(st.sampled_from([0.91, 0.95, 1.0]), min_size=30, max_size=30),
    extra=st.lists(st.integers(0, 50), min_size=30, max_size=30),
    preempt=st.booleans(),
)
def test_one_spike_without_draining_gives_exactly_one_cut(cfg, cap0, kv_cap, n, usages, extra, preempt):
    """Consecutive over-admission polls (usage above the high mark, or new preemptions)
    while in flight never drains below the cap: one cut, then holds. A cut from above
    the KV capacity cap stops at it; at or below it only preemptions cut."""
    cap0 = min(cap0, cfg.ceiling)
    kv_cap = min(kv_cap, cap0)
    if cap0 < 2 or (not preempt and cfg.high_mark >= 1.0):
        return  # nothing to cut, or usage can never be above the mark
    s = AdmissionState(cap=cap0, capacity_cap=kv_cap, window_cap=cap0, window_start=0, preemptions=0)
    caps = []
    for i in range(n):
        usage = 0.5 if preempt else min(usages[i], 1.0)
        if not preempt and usage <= cfg.high_mark:
            usage = 1.0
        stats = EngineStats(
            kv_cache_usage=usage, kv_cache_tokens=1 << 20, max_model_len=512,
            preemptions=(i + 1) if preempt else 0, in_flight=cap0, updated_at=float(i),
        )
        s, _ = update(s, stats, cap0 + extra[i], i, float(i), cfg)  # in flight never below the first cap
        caps.append(s.cap)
    if cap0 > kv_cap:
        expected = max(kv_cap, math.floor(cap0 * cfg.cut_factor))
    elif preempt:
        expected = max(1, math.floor(cap0 * cfg.cut_factor))
    else:
        expected = cap0  # usage alone never cuts within the KV capacity
    assert caps == [expected] * n
    assert s.latched == (expected < cap0)


@settings(max_examples=200, deadline=None)
@given(cfg=configs(), tokens=st.integers(0, 1 << 22), max_len=st.integers(1, 4096))
def test_initial_cap_is_capacity_over_max_len_clamped(cfg, tokens, max_len):
    stats = EngineStats(kv_cache_tokens=tokens, max_model_len=max_len)
    if tokens == 0:
        return
    s = initial_state(stats, cfg)
    assert s.cap == max(1, min(cfg.ceiling, tokens // max_len))


@dataclass(frozen=True)
class BusyPoll:
    """A poll of a shard kept near its cap: mostly fresh and low usage, so growth is common."""

    kind: str  # "fresh", "stale" (same record, old), "none"
    usage: float
    waiting: int
    load: int  # in flight relative to the cap: cap + load (may be below the cap)
    ended: int


busy_polls = st.builds(
    BusyPoll,
    kind=st.sampled_from(["fresh"] * 6 + ["stale", "none"]),
    usage=st.sampled_from([0.0, 0.2, 0.2, 0.5, 0.7, 0.95]),
    waiting=st.sampled_from([0, 0, 0, 0, 2]),
    load=st.sampled_from([0, 0, 0, 1, -1, -5]),
    ended=st.integers(0, 12),
)


@settings(max_examples=300, deadline=None)
@given(cfg=configs(), cap0=st.integers(1, 40), seq=st.lists(busy_polls, max_size=80))
def test_growth_happens_at_most_once_per_turnover_and_only_on_fresh_data(cfg, cap0, seq):
    cap0 = min(cap0, cfg.ceiling)
    # The law has seen record 0.0 at time 0 (a first sight counts as a new record).
    s = AdmissionState(cap=cap0, capacity_cap=cap0, window_cap=cap0, window_start=0, record=0.0, record_seen_at=0.0)
    now, finished, ua = 0.0, 0, 0.0
    window = (0, cap0)
    for p in seq:
        now += 1.0
        finished += p.ended
        in_flight = max(0, s.cap + p.load)
        if p.kind == "fresh":
            ua += 1.0
        elif p.kind == "stale":
            now += cfg.stats_max_age_s  # the same record, now older than the max age
        stats = None if p.kind == "none" else EngineStats(
            kv_cache_usage=p.usage, kv_cache_tokens=1 << 20, max_model_len=512, waiting=p.waiting,
            in_flight=in_flight, updated_at=ua,
        )
        old = s
        s, reason = update(s, stats, in_flight, finished, now, cfg)
        event(f"rule {s.rule}")
        assert 1 <= s.cap <= cfg.ceiling
        if old.latched and in_flight < old.cap:
            window = (finished, old.cap)
        if s.cap > old.cap:
            assert p.kind == "fresh" and p.usage < cfg.low_mark and p.waiting == 0, reason
            assert finished - window[0] >= window[1], f"grew before a turnover: {reason}"
            assert s.cap == min(cfg.ceiling, max(old.cap + 1, math.floor(old.cap * cfg.growth_factor)))
        elif p.kind != "fresh":
            assert s.cap <= old.cap
        if s.cap != old.cap:
            window = (finished, s.cap)


@settings(max_examples=100, deadline=None)
@given(cfg=configs(), cap0=st.integers(1, 40), per_poll=st.integers(1, 10))
def test_a_full_low_usage_shard_grows_once_its_pool_turned_over(cfg, cap0, per_poll):
    """Liveness: saturated, fresh, low usage, nothing waiting -> the cap grows right at the turnover."""
    cap0 = min(cap0, cfg.ceiling)
    s = AdmissionState(cap=cap0, capacity_cap=cap0, window_cap=cap0, window_start=0)
    polls_needed = -(-cap0 // per_poll)
    for i in range(1, polls_needed + 1):
        stats = EngineStats(kv_cache_usage=0.0, kv_cache_tokens=1 << 20, max_model_len=512, updated_at=float(i))
        s, _ = update(s, stats, cap0, i * per_poll, float(i), cfg)
        if i < polls_needed:
            assert s.cap == cap0
    grown = min(cfg.ceiling, max(cap0 + 1, math.floor(cap0 * cfg.growth_factor)))
    assert s.cap == (cap0 if cap0 == cfg.ceiling else grown)
