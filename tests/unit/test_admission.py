"""The admission config, law (``fleet.control.admission_law``) rule by rule, and tracker
(``fleet.control.admission``), with synthetic stats and a hand-moved clock."""

from __future__ import annotations

import itertools
import math

import pytest

from rlfleet.fleet.control.admission import AdmissionController
from rlfleet.fleet.config.admission import AdmissionConfig, load_admission_config
from rlfleet.fleet.control.admission_law import AdmissionState, initial_cap, initial_state, update
from rlfleet.fleet.errors import ConfigError
from rlfleet.fleet.types import EngineStats

# The law's mechanics are tested with a cut at 0.9 by half, numbers easy to follow by hand;
# the defaults (the seed law: cut 30 % above 0.8, grow 25 % below 0.6) are tested on their own.
LAW = dict(high_mark=0.9, cut_factor=0.5)
CFG = AdmissionConfig(ceiling=64, fallback_cap=4, stats_max_age_s=5.0, absent_fallback_s=30.0, **LAW)
_records = itertools.count(1)


def stats(usage=0.1, waiting=0, preemptions=0, in_flight=1, tokens=32 * 512, max_len=512, updated_at="new", **kw):
    """Engine stats with a new record (``updated_at`` never seen before) unless told otherwise."""
    ua = float(next(_records)) if updated_at == "new" else updated_at
    return EngineStats(
        kv_cache_usage=usage, kv_cache_tokens=tokens, max_model_len=max_len, waiting=waiting,
        preemptions=preemptions, in_flight=in_flight, updated_at=ua, **kw,
    )


def state(cap=32, capacity_cap=1, **kw) -> AdmissionState:
    """A shard's state at ``cap``; by default one that grew above its KV capacity cap (1), so cuts go down to 1."""
    window_cap, window_start = kw.pop("window_cap", cap), kw.pop("window_start", 0)
    return AdmissionState(cap=cap, capacity_cap=capacity_cap, window_cap=window_cap, window_start=window_start, **kw)


# ---------------------------------------------------------------- config
def test_defaults_are_valid():
    cfg = AdmissionConfig()
    assert (cfg.ceiling, cfg.low_mark, cfg.high_mark, cfg.cut_factor, cfg.growth_factor) == (256, 0.6, 0.8, 0.7, 1.25)
    assert (cfg.poll_interval_s, cfg.stats_max_age_s, cfg.absent_fallback_s, cfg.enabled) == (0.5, 5.0, 30.0, True)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"ceiling": 0}, "admission.ceiling"),
        ({"fallback_cap": 0}, "admission.fallback_cap"),
        ({"low_mark": 0}, "admission.low_mark"),
        ({"low_mark": 0.7, "high_mark": 0.7}, "admission.high_mark"),
        ({"low_mark": 0.8, "high_mark": 0.5}, "admission.high_mark"),
        ({"high_mark": 1.2}, "admission.high_mark"),
        ({"cut_factor": 1.0}, "admission.cut_factor"),
        ({"cut_factor": 0}, "admission.cut_factor"),
        ({"growth_factor": 1.0}, "admission.growth_factor"),
        ({"poll_interval_s": 0}, "admission.poll_interval_s"),
        ({"stats_max_age_s": math.inf}, "admission.stats_max_age_s"),
        ({"stats_max_age_s": 10, "absent_fallback_s": 5}, "admission.absent_fallback_s"),
        ({"hysteresis": 1}, "admission.hysteresis"),
    ],
)
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        load_admission_config(data)
    assert err.value.field == field
    assert field in str(err.value)


def test_config_is_frozen_and_fallback_never_above_ceiling():
    cfg = AdmissionConfig(ceiling=2, **LAW)
    assert cfg.floor_cap == 2
    with pytest.raises(Exception):
        cfg.ceiling = 3  # type: ignore[misc]


# ---------------------------------------------------------------- initial cap
@pytest.mark.parametrize(
    ("tokens", "max_len", "cap"),
    [(32 * 512, 512, 32), (32 * 512 + 511, 512, 32), (100, 512, 1), (10**9, 512, 64)],
)
def test_initial_cap_is_kv_tokens_over_max_len_within_one_and_ceiling(tokens, max_len, cap):
    assert initial_cap(stats(tokens=tokens, max_len=max_len), CFG) == cap
    s = initial_state(stats(tokens=tokens, max_len=max_len), CFG, finished_total=7)
    assert (s.cap, s.capacity_cap, s.window_cap, s.window_start, s.latched) == (cap, cap, cap, 7, False)


@pytest.mark.parametrize(("tokens", "max_len"), [(0, 512), (4096, 0), (None, 512)])
def test_unknown_capacity_cannot_size(tokens, max_len):
    st = stats(tokens=tokens, max_len=max_len)
    assert initial_cap(st, CFG) is None
    assert initial_cap(None, CFG) is None
    with pytest.raises(ValueError, match="cannot size admission"):
        initial_state(st, CFG)


# ---------------------------------------------------------------- cut and latch
def test_the_default_law_is_the_seed_law_cut_30_percent_above_0_8():
    default = AdmissionConfig(ceiling=64, fallback_cap=4, stats_max_age_s=5.0, absent_fallback_s=30.0)
    s, why = update(state(40), stats(usage=0.85), 40, 0, 1.0, default)
    assert (s.cap, s.rule) == (28, "cut") and "0.85 > high mark 0.8" in why and "40 -> 28" in why
    held, _ = update(state(40), stats(usage=0.75), 40, 0, 1.0, default)
    assert held.cap == 40  # between the marks: hold


def test_high_usage_cuts_and_latches_one_cut_per_spike():
    s, why = update(state(32), stats(usage=0.95), in_flight=32, finished_total=0, now=1.0, cfg=CFG)
    assert (s.cap, s.latched, s.rule) == (16, True, "cut")
    assert "0.95 > high mark 0.9" in why and "32 -> 16" in why
    # The spike goes on; in flight has not drained below 16: no second cut.
    for t in range(2, 10):
        s, why = update(s, stats(usage=0.97), in_flight=20, finished_total=t, now=float(t), cfg=CFG)
        assert (s.cap, s.latched) == (16, True)
        assert "latched" in why


def test_latch_releases_once_in_flight_drains_below_the_new_cap_then_a_new_spike_cuts():
    s, _ = update(state(32), stats(usage=0.95), 32, 0, 1.0, CFG)
    s, why = update(s, stats(usage=0.5), 15, 17, 2.0, CFG)
    assert (s.cap, s.latched, s.rule) == (16, False, "drained")
    assert why.startswith("drained (15 in flight < cap 16)")
    s, _ = update(s, stats(usage=0.95), 16, 17, 3.0, CFG)
    assert (s.cap, s.latched) == (8, True)


def test_drain_and_a_still_high_usage_on_the_same_poll_is_a_new_cut():
    s, _ = update(state(32), stats(usage=0.95), 32, 0, 1.0, CFG)
    s, why = update(s, stats(usage=0.95), 10, 22, 2.0, CFG)
    assert (s.cap, s.latched) == (8, True)
    assert why.startswith("drained") and "cut:" in why


def test_preemptions_rising_cut_like_high_usage():
    s, _ = update(state(32), stats(usage=0.5, preemptions=3), 32, 0, 1.0, CFG)
    assert s.cap == 32  # the first poll only sets the baseline
    s, why = update(s, stats(usage=0.5, preemptions=5), 32, 1, 2.0, CFG)
    assert (s.cap, s.latched, s.rule) == (16, True, "preempt")
    assert "2 preemption(s)" in why
    s, why = update(s, stats(usage=0.5, preemptions=9), 30, 2, 3.0, CFG)
    assert s.cap == 16 and "latched" in why  # same spike
    s, _ = update(s, stats(usage=0.5, preemptions=9), 30, 3, 4.0, CFG)
    assert s.cap == 16  # no new preemptions: no signal


def test_preemption_counter_reset_rebases_without_a_cut():
    s, _ = update(state(32), stats(preemptions=50), 32, 0, 1.0, CFG)
    s, _ = update(s, stats(preemptions=2), 32, 0, 2.0, CFG)
    assert (s.cap, s.preemptions) == (32, 2)


def test_cut_never_goes_below_one():
    s = state(1)
    for t in range(1, 5):
        s, why = update(s, stats(usage=1.0), in_flight=0, finished_total=t, now=float(t), cfg=CFG)
        assert (s.cap, s.rule) == (1, "hold") and "already at the floor of 1" in why
    s, _ = update(state(3), stats(usage=1.0), 3, 0, 1.0, CFG)
    assert s.cap == 1


def test_high_mark_one_leaves_only_preemptions_to_cut():
    cfg = AdmissionConfig(ceiling=64, high_mark=1.0)
    s, _ = update(state(32), stats(usage=1.0), 32, 0, 1.0, cfg)
    assert s.cap == 32


def test_the_latch_releases_on_a_drain_between_polls_under_a_backlog():
    """With a backlog the dispatcher refills a freed place at once: polls see in flight == cap forever."""
    s, _ = update(state(3), stats(usage=0.95), 3, 0, 1.0, CFG)
    assert (s.cap, s.latched) == (1, True)
    s, _ = update(s, stats(usage=0.3), 1, 2, 2.0, CFG)  # drained to 1 (== cap): not below it
    assert s.latched
    s, why = update(s, stats(usage=0.3), 1, 3, 3.0, CFG, trough_in_flight=0)  # 1 -> 0 -> refilled to 1
    assert (s.cap, s.latched, s.window_start) == (1, False, 3)
    assert why.startswith("drained (0 in flight since the last poll < cap 1)")


def test_controller_tracks_the_fewest_in_flight_between_polls():
    ac = AdmissionController(CFG)
    ac.observe(0, stats(tokens=2 * 512, in_flight=0), 0.0)  # capacity cap 2
    for _ in range(3):
        ac.on_dispatch(0)
    ac.observe(0, stats(usage=0.95, preemptions=2), 0.5)
    assert (ac.cap(0), ac.state(0).latched) == (1, True)
    ac.observe(0, stats(usage=0.95, preemptions=2), 1.0)
    for _ in range(2):  # two end; the last one leaves nothing in flight and the dispatcher refills at once
        ac.on_finish(0)
    ac.on_finish(0)
    ac.on_dispatch(0)
    why = ac.observe(0, stats(usage=0.3, preemptions=2), 1.5)
    assert why is not None and "drained (0 in flight since the last poll < cap 1)" in why
    assert not ac.state(0).latched and ac.metrics()[0]["in_flight"] == 1
    # the next poll's trough starts from the count at this poll
    assert ac.observe(0, stats(usage=0.3, preemptions=2), 2.0) is None


def test_preemptions_reported_with_the_drain_belong_to_the_drained_spike():
    """The overflow admitted before a cut still runs and may be preempted: no second cut for it."""
    s, _ = update(state(3, capacity_cap=2, preemptions=0), stats(usage=0.95, preemptions=0), 3, 0, 1.0, CFG)
    assert (s.cap, s.latched) == (2, True)
    s, why = update(s, stats(usage=0.5, preemptions=1), 2, 2, 2.0, CFG, trough_in_flight=1)
    assert (s.cap, s.latched, s.preemptions) == (2, False, 1)
    assert why.startswith("drained (1 in flight since the last poll < cap 2); 1 preemption(s) of the drained spike")
    s, _ = update(s, stats(usage=0.5, preemptions=2), 2, 3, 3.0, CFG)  # a later one is a new signal
    assert (s.cap, s.rule) == (1, "preempt")


# ---------------------------------------------------------------- the KV capacity cap as a soft floor
def test_high_usage_at_or_below_the_capacity_cap_holds():
    """Every request admitted under kv_tokens // max_len fits at max length: full KV is no overload."""
    for cap in (4, 2):
        s, why = update(state(cap, capacity_cap=4), stats(usage=1.0), cap, 0, 1.0, CFG)
        assert (s.cap, s.latched, s.rule) == (cap, False, "hold")
        assert f"cap {cap} <= KV capacity cap 4" in why


def test_a_cut_from_above_the_capacity_cap_stops_at_it():
    s, why = update(state(5, capacity_cap=4), stats(usage=0.95), 5, 0, 1.0, CFG)
    assert (s.cap, s.latched, s.rule) == (4, True, "cut") and "5 -> 4" in why
    s, _ = update(state(40, capacity_cap=4), stats(usage=0.5, preemptions=1), 40, 0, 1.0, CFG,)
    assert s.cap == 40  # baseline only
    s, _ = update(state(40, capacity_cap=4, preemptions=0), stats(usage=0.5, preemptions=1), 40, 0, 1.0, CFG)
    assert (s.cap, s.rule) == (20, "preempt")
    s, _ = update(state(6, capacity_cap=4, preemptions=0), stats(usage=0.5, preemptions=1), 6, 0, 1.0, CFG)
    assert s.cap == 4


def test_preemptions_at_the_capacity_cap_cut_below_it():
    """The capacity estimate was wrong (e.g. a request samples several sequences): preemptions say so."""
    s, why = update(state(4, capacity_cap=4, preemptions=0), stats(usage=1.0, preemptions=2), 4, 0, 1.0, CFG)
    assert (s.cap, s.latched) == (2, True) and "2 preemption(s)" in why


# ---------------------------------------------------------------- refits
def test_a_refit_holds_and_moves_the_preemption_baseline_past_its_cache_reset():
    s = state(8, capacity_cap=2, preemptions=5, window_start=-100, saturated=True)
    s, why = update(s, stats(usage=0.1, preemptions=9), 8, 0, 1.0, CFG, refit=True)
    assert (s.cap, s.latched, s.rule, s.preemptions) == (8, False, "refit", 9)  # no cut, no growth
    assert why == "refit: hold (engine paused or just resumed); 4 preemption(s) from its cache reset not counted"
    s, why = update(s, stats(usage=0.95, preemptions=9), 8, 0, 2.0, CFG, refit=True)
    assert (s.cap, s.rule) == (8, "refit") and why == "refit: hold (engine paused or just resumed)"
    s, _ = update(s, stats(usage=0.7, preemptions=9), 8, 0, 3.0, CFG)  # after: nothing new, no cut
    assert (s.cap, s.latched) == (8, False)
    s, _ = update(s, stats(usage=0.7, preemptions=10), 8, 0, 4.0, CFG)  # a real one later still cuts
    assert (s.cap, s.rule) == (4, "preempt")


def test_a_refit_does_not_hide_missing_stats_or_stop_a_drain():
    s, _ = update(state(8), stats(usage=0.95), 8, 0, 1.0, CFG)
    s, why = update(s, stats(usage=0.1), 3, 5, 2.0, CFG, refit=True)
    assert not s.latched and why.startswith("drained") and s.rule == "refit"
    s, why = update(s, None, 3, 5, 3.0, CFG, refit=True)
    assert s.data == "missing" and why.startswith("hold: stats call failed")


def test_controller_holds_during_a_refit_and_its_grace():
    cfg = AdmissionConfig(ceiling=64, refit_grace_s=1.0, **LAW)
    ac = AdmissionController(cfg)
    ac.observe(0, stats(tokens=8 * 512, in_flight=0), 0.0)
    for _ in range(8):
        ac.on_dispatch(0)
    ac.observe(0, stats(usage=0.5, preemptions=0), 0.5)
    assert not ac.in_refit(0.5)
    ac.refit_started()
    assert ac.in_refit(0.6)
    why = ac.observe(0, stats(usage=0.1, preemptions=0), 1.0)
    ac.refit_finished(1.2)
    assert ac.in_refit(2.1) and not ac.in_refit(2.2)
    why = ac.observe(0, stats(usage=0.9, preemptions=8), 1.7)  # the reset's preemptions, reported after resume
    assert why == (
        "slot 0: refit: hold (engine paused or just resumed); 8 preemption(s) from its cache reset not counted"
    )
    assert ac.cap(0) == 8
    ac.observe(0, stats(usage=0.5, preemptions=8), 2.5)
    assert ac.cap(0) == 8 and ac.metrics()[0]["refit_preemptions"] == 8
    ac.observe(0, stats(usage=0.5, preemptions=9), 3.0)
    assert ac.cap(0) == 4


def test_refit_grace_must_not_be_negative():
    with pytest.raises(ConfigError) as err:
        load_admission_config({"refit_grace_s": -1})
    assert err.value.field == "admission.refit_grace_s"


# ---------------------------------------------------------------- growth and turnover
def grow_run(s: AdmissionState, finished: int, polls: int, cfg=CFG, t0=1.0):
    """``polls`` low-usage polls at saturation, one request ending per poll; returns (state, caps seen)."""
    caps = []
    for i in range(polls):
        finished += 1
        s, _ = update(s, stats(usage=0.2), in_flight=s.cap, finished_total=finished, now=t0 + i, cfg=cfg)
        caps.append(s.cap)
    return s, caps


def test_growth_waits_for_a_full_turnover_of_the_pool():
    s, caps = grow_run(state(8), finished=0, polls=8)
    assert caps == [8] * 7 + [10]  # 8 ends at cap 8, then 8 -> max(9, 10)
    assert s.rule == "grow" and (s.window_cap, s.window_start) == (10, 8)
    s, caps = grow_run(s, finished=8, polls=10)
    assert caps == [10] * 9 + [12]


def test_growth_reason_names_the_turnover():
    s, _ = grow_run(state(4), finished=0, polls=3)
    s, why = update(s, stats(usage=0.2), 4, 4, 9.0, CFG)
    assert why == "grow: kv usage 0.20 < low mark 0.6, nothing waiting, turnover 4/4; cap 4 -> 5"


def test_growth_adds_at_least_one():
    s, caps = grow_run(state(1), finished=0, polls=1)
    assert caps == [2]
    s, caps = grow_run(s, finished=1, polls=2)
    assert caps == [2, 3]


def test_growth_stops_at_the_ceiling():
    s, caps = grow_run(state(60), finished=0, polls=60 + 64 + 10)
    assert max(caps) == 64 and caps[-1] == 64
    assert caps[59] == 64  # 60 * 1.25 = 75, clamped


@pytest.mark.parametrize(
    ("usage", "waiting", "blocked"),
    [(0.6, 0, "usage not below the low mark"), (0.7, 0, "between the marks"), (0.2, 1, "a request is waiting")],
)
def test_no_growth_unless_usage_low_and_nothing_waiting(usage, waiting, blocked):
    s = state(8, window_start=-100, saturated=True)  # turnover long done
    s, _ = update(s, stats(usage=usage, waiting=waiting), 8, 0, 1.0, CFG)
    assert s.cap == 8, blocked


def test_no_growth_while_latched_even_when_usage_falls():
    s, _ = update(state(32), stats(usage=0.95), 32, 0, 1.0, CFG)
    s, why = update(s, stats(usage=0.1), 16, 1000, 2.0, CFG)
    assert (s.cap, s.latched) == (16, True) and "latched" in why


def test_no_growth_when_the_cap_was_never_reached():
    s = state(8, window_start=-100)
    for t in range(1, 20):
        s, why = update(s, stats(usage=0.1), in_flight=3, finished_total=t, now=float(t), cfg=CFG)
    assert s.cap == 8 and "not reached" in why
    # A peak between polls counts as reaching it.
    s, _ = update(s, stats(usage=0.1), in_flight=3, finished_total=30, now=30.0, cfg=CFG, peak_in_flight=8)
    assert s.cap == 10


def test_a_cut_restarts_the_turnover_window():
    s = state(16, window_start=-100, saturated=True)
    s, _ = update(s, stats(usage=0.95), 16, 5, 1.0, CFG)
    assert (s.cap, s.window_cap, s.window_start, s.saturated) == (8, 8, 5, False)
    s, _ = update(s, stats(usage=0.2), 7, 6, 2.0, CFG)  # drains: the window reopens here
    assert (s.cap, s.latched, s.window_cap, s.window_start) == (8, False, 8, 6)
    s, caps = grow_run(s, finished=6, polls=8, t0=3.0)
    assert caps == [8] * 7 + [10]


def test_requests_ending_while_a_cut_drains_do_not_count_toward_turnover():
    s, _ = update(state(32), stats(usage=0.95), 32, 0, 1.0, CFG)
    s, why = update(s, stats(usage=0.1), 15, 17, 2.0, CFG)  # 17 ended while draining from 32 to 15
    assert (s.cap, s.window_start) == (16, 17) and why.startswith("drained")
    s, why = update(s, stats(usage=0.1), 16, 18, 3.0, CFG)
    assert s.cap == 16 and "turnover 1/16" in why


# ---------------------------------------------------------------- missing, stale, quiet
def test_missing_stats_freeze_growth_and_hold_the_cap():
    s = state(8, window_start=-100, saturated=True)
    s, why = update(s, None, 8, 0, 1.0, CFG)
    assert (s.cap, s.data, s.missing_since) == (8, "missing", 1.0)
    assert why.startswith("hold: stats call failed; growth frozen")
    s, _ = update(s, stats(usage=0.1), 8, 1, 2.0, CFG)
    assert s.cap == 10 and s.data == "fresh" and s.missing_since is None


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"usage": math.nan}, "kv_cache_usage=nan"),
        ({"usage": 1.5}, "outside [0, 1]"),
        ({"usage": None}, "kv_cache_usage=None"),
        ({"waiting": -1}, "waiting=-1"),
        ({"preemptions": 2.5}, "preemptions=2.5"),
        ({"updated_at": math.inf}, "updated_at=inf"),
    ],
)
def test_unreadable_stats_count_as_missing(bad, named):
    s = state(8, window_start=-100, saturated=True)
    s, why = update(s, stats(**bad), 8, 0, 1.0, CFG)
    assert s.cap == 8 and s.data == "missing" and named in why


def test_a_record_older_than_max_age_counts_as_missing_while_work_is_in_flight():
    s = state(8, window_start=-100, saturated=True)
    s, _ = update(s, stats(usage=0.7, updated_at=500.0), 8, 0, 10.0, CFG)
    assert s.data == "fresh" and s.record_seen_at == 10.0
    s, _ = update(s, stats(usage=0.7, updated_at=500.0), 8, 50, 15.0, CFG)
    assert s.data == "fresh"  # exactly 5.0 s old: still fresh
    # 5.5 s old: missing, so low usage with the turnover done does not grow the cap.
    s, why = update(s, stats(usage=0.1, updated_at=500.0), 8, 60, 15.5, CFG)
    assert (s.cap, s.data) == (8, "missing")
    assert "stats record 5.5 s old > 5 s with 8 in flight" in why


def test_record_age_is_measured_on_the_callers_clock_not_the_engines():
    # updated_at from another host's clock (far in the past or future) is only compared for equality.
    s = state(8)
    for ua in (-1e9, 1e12):
        s, _ = update(s, stats(updated_at=ua), 8, 0, 1.0, CFG)
        assert s.data == "fresh"


def test_an_idle_engine_with_an_old_record_is_quiet_not_missing():
    s = state(8)
    s, _ = update(s, stats(updated_at=7.0, in_flight=0), 0, 0, 1.0, CFG)
    s, why = update(s, stats(updated_at=7.0, in_flight=0), 0, 0, 100.0, CFG)
    assert (s.cap, s.data, s.missing_since) == (8, "quiet", None)
    assert "engine idle" in why
    # never recorded at all (fresh engine, no traffic yet): quiet too
    s, _ = update(state(8), stats(updated_at=None, in_flight=0), 0, 0, 1.0, CFG)
    assert s.data == "quiet"
    s, _ = update(state(8), stats(updated_at=None, in_flight=2), 2, 0, 1.0, CFG)
    assert s.data == "missing"


def test_long_absence_drops_to_the_fallback_floor_latched():
    s = state(40)
    for t in range(0, 30, 5):
        s, _ = update(s, None, 40, 0, 100.0 + t, CFG)
        assert s.cap == 40
    s, why = update(s, None, 40, 0, 130.0, CFG)
    assert (s.cap, s.latched, s.rule) == (4, True, "fallback")
    assert why == "fallback: stats call failed for 30.0 s >= 30 s; cap -> 4 (latched)"
    s, _ = update(s, None, 40, 0, 500.0, CFG)
    assert s.cap == 4
    # Stats come back: the fallback behaves like a cut; growth needs a turnover at the floor.
    s, _ = update(s, stats(usage=0.1), 3, 37, 501.0, CFG)
    assert (s.cap, s.latched, s.data) == (4, False, "fresh")
    s, caps = grow_run(s, finished=37, polls=4, t0=502.0)
    assert caps == [4, 4, 4, 5]


def test_absence_clock_restarts_after_any_usable_poll():
    s = state(40)
    s, _ = update(s, None, 40, 0, 0.0, CFG)
    s, _ = update(s, stats(usage=0.7), 40, 0, 29.0, CFG)
    s, _ = update(s, None, 40, 0, 31.0, CFG)
    s, _ = update(s, None, 40, 0, 60.0, CFG)
    assert s.cap == 40 and s.missing_since == 31.0
    s, _ = update(s, None, 40, 0, 61.0, CFG)
    assert s.cap == 4


def test_fallback_never_raises_a_cap_already_below_it():
    s, why = update(state(2, missing_since=0.0), None, 2, 0, 100.0, CFG)
    assert s.cap == 2 and why.startswith("hold:")


def test_a_state_from_a_larger_ceiling_is_brought_within_bounds():
    s, _ = update(state(500), stats(usage=0.7), 10, 0, 1.0, CFG)
    assert s.cap == 64


def test_update_is_pure():
    s0 = state(8)
    st = stats(usage=0.95)
    a = update(s0, st, 8, 0, 1.0, CFG)
    b = update(s0, st, 8, 0, 1.0, CFG)
    assert a == b and s0 == state(8)


# ---------------------------------------------------------------- the tracker (fleet.admission)
def test_controller_sizes_on_first_stats_and_gates_with_fallback_before():
    ac = AdmissionController(CFG)
    assert ac.cap(0) == 4 and ac.caps([0, 1]) == {0: 4, 1: 4}
    assert ac.observe(0, None, 0.0) is None and ac.cap(0) == 4
    assert ac.observe(0, stats(tokens=0), 0.5) is None and ac.cap(0) == 4
    why = ac.observe(0, stats(tokens=20 * 512, in_flight=0), 1.0, incarnation=3)
    assert why is not None and why.startswith("slot 0 (incarnation 3): init: cap 20 (kv 10240 tokens / max len 512)")
    assert ac.caps() == {0: 20}


def test_controller_reports_changes_not_plain_holds():
    ac = AdmissionController(CFG)
    ac.observe(0, stats(), 0.0)
    assert ac.observe(0, stats(usage=0.7), 0.5) is None
    for _ in range(32):
        ac.on_dispatch(0)
    why = ac.observe(0, stats(usage=0.95, preemptions=1), 1.0)
    assert why == (
        "slot 0: cut: kv usage 0.95 > high mark 0.9 and 1 preemption(s) since the last poll; "
        "cap 32 -> 16 (latched until in flight < 16)"
    )
    assert ac.observe(0, stats(usage=0.95, preemptions=1), 1.5) is None
    for _ in range(17):
        ac.on_finish(0)
    assert ac.observe(0, stats(usage=0.5), 2.0).startswith("slot 0: drained (15 in flight < cap 16)")
    assert ac.observe(0, None, 2.5) == "slot 0: hold: stats call failed; growth frozen (missing for 0.0 s)"
    assert ac.observe(0, None, 3.0) is None
    m = ac.metrics()[0]
    assert (m["cap"], m["in_flight"], m["finished"], m["cuts"]) == (16, 15, 17, 1)
    assert (m["latched"], m["data"]) == (False, "missing")
    assert (m["kv_cache_usage"], m["waiting"], m["preemptions"], m["capacity_cap"]) == (0.5, 0, 0, 32)
    assert (m["kv_cache_tokens"], m["max_model_len"], m["refit_preemptions"]) == (32 * 512, 512, 0)


def test_controller_grows_after_turnover_of_dispatched_and_finished_requests():
    ac = AdmissionController(CFG)
    ac.observe(0, stats(tokens=4 * 512, in_flight=0), 0.0)
    assert ac.cap(0) == 4
    for i in range(4):  # keep the pool full, turn it over once
        while ac.metrics()[0]["in_flight"] < ac.cap(0):
            ac.on_dispatch(0)
        ac.on_finish(0)
        ac.observe(0, stats(usage=0.2), 1.0 + i)
    assert ac.cap(0) == 5 and ac.metrics()[0]["growths"] == 1


def test_forget_and_incarnations_start_afresh_and_ignore_late_events():
    ac = AdmissionController(CFG)
    ac.observe(1, stats(), 0.0, incarnation=1)
    ac.on_dispatch(1, incarnation=1)
    ac.on_dispatch(1, incarnation=1)
    ac.observe(1, stats(usage=0.95, preemptions=1), 1.0, incarnation=1)
    assert ac.cap(1) == 16
    ac.on_dispatch(1, incarnation=2)  # the replacement: a fresh record
    assert ac.cap(1) == 4 and ac.metrics()[1]["in_flight"] == 1
    ac.on_finish(1, incarnation=1)  # a late end on the dead engine
    ac.observe(1, stats(usage=0.99), 2.0, incarnation=1)
    assert ac.metrics()[1]["in_flight"] == 1 and ac.metrics()[1]["incarnation"] == 2
    ac.observe(1, stats(), 3.0, incarnation=2)
    assert ac.cap(1) == 32
    ac.forget(1)
    assert ac.cap(1) == 4 and ac.state(1) is None
    ac.on_finish(1)  # an end this record never saw dispatched
    assert 1 not in ac.metrics()


def test_disabled_pins_caps_at_the_ceiling_but_keeps_stats():
    ac = AdmissionController({"enabled": False, "ceiling": 100})
    assert ac.observe(0, stats(usage=0.99), 0.0) is None
    assert ac.cap(0) == 100 and ac.caps() == {0: 100}
    assert ac.metrics()[0]["kv_cache_usage"] == 0.99
