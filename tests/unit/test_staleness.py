"""Staleness accounting at the trainer boundary: the age rule, the filter, the counters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.fleet.errors import ConfigError
from rlfleet.recipe.grpo import Sample
from rlfleet.fleet.data.staleness import StalenessFilter, staleness_of, too_old
from rlfleet.fleet.types import Completion, GenerationResult


def result(version_start: int, weight_version: int | None = None, slot: int = 0, rid: str = "r") -> GenerationResult:
    return GenerationResult(
        request_id=rid, prompt_token_ids=(1, 2), completions=(Completion((3,), (-0.1,), "length"),),
        version_start=version_start, weight_version=version_start if weight_version is None else weight_version,
        slot=slot, incarnation=0,
    )


def test_staleness_is_current_version_minus_the_version_the_sample_started_under():
    assert staleness_of(5, 5) == 0
    assert staleness_of(3, 7) == 4


def test_a_sample_from_a_newer_version_than_current_is_a_caller_error_and_is_not_counted():
    f = StalenessFilter(2)
    with pytest.raises(ValueError, match="started under version 8, newer than the current version 7"):
        f.admit(8, 7)
    assert (f.kept, f.dropped, f.histogram) == (0, 0, {})
    with pytest.raises(ValueError, match="version_start must be an integer"):
        staleness_of(1.5, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_max_staleness_is_a_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError) as err:
        StalenessFilter(bad)
    assert err.value.field == "max_staleness"


def test_limit_keeps_samples_at_most_max_staleness_old():
    f = StalenessFilter(max_staleness=1)
    assert [f.admit(v, 10) for v in (10, 9, 8, 3)] == [True, True, False, False]
    assert (f.kept, f.dropped) == (2, 2)
    assert f.histogram == {0: 1, 1: 1, 2: 1, 7: 1}


def test_zero_keeps_only_the_current_version_and_none_keeps_everything_but_counts():
    zero = StalenessFilter(0)
    assert [zero.admit(v, 4) for v in (4, 3)] == [True, False]
    anything = StalenessFilter(None)
    assert all(anything.admit(v, 100) for v in (0, 50, 100))
    assert (anything.kept, anything.dropped, anything.histogram) == (3, 0, {0: 1, 50: 1, 100: 1})


def test_a_sample_spanning_a_refit_is_as_old_as_its_oldest_token():
    f = StalenessFilter(1)
    spanned = result(version_start=3, weight_version=5)  # started under 3, finished under 5
    assert f.filter([spanned], current_version=5) == []
    assert f.totals()["dropped"] == 1 and f.totals()["spanned_refit"] == 1
    assert f.histogram == {2: 1}


def test_filter_over_results_counts_per_slot_and_keeps_order():
    f = StalenessFilter(1)
    rs = [result(v, slot=slot, rid=rid) for v, slot, rid in [(5, 0, "a"), (2, 1, "b"), (4, 1, "c"), (1, 0, "d")]]
    kept, dropped = f.split(rs, current_version=5)
    assert [r.request_id for r in kept] == ["a", "c"]
    assert [r.request_id for r in dropped] == ["b", "d"]
    m = f.metrics()
    assert m[0] == {"kept": 1, "dropped": 1, "spanned_refit": 0, "staleness_histogram": {0: 1, 4: 1}}
    assert m[1] == {"kept": 1, "dropped": 1, "spanned_refit": 0, "staleness_histogram": {1: 1, 3: 1}}
    assert f.totals() == {"kept": 2, "dropped": 2, "spanned_refit": 0, "staleness_histogram": {0: 1, 1: 1, 3: 1, 4: 1}}


def test_filter_accepts_fleet_results_and_grpo_samples_and_passes_returned_requests_through():
    f = StalenessFilter(0)
    done_new = FleetResult("a", "completed", result(3, slot=2))
    done_old = FleetResult("b", "completed", result(2, slot=2))
    returned = FleetResult("c", "returned", None, reason="fleet stopped")
    sample = Sample(completion_ids=(1,), logprobs=(-0.5,), reward=1.0, version_start=1, weight_version=3)
    kept, dropped = f.split([done_new, done_old, returned, sample], current_version=3)
    assert kept == [done_new, returned] and dropped == [done_old, sample]
    assert f.metrics()[2]["dropped"] == 1 and f.metrics()[None] == {
        "kept": 0, "dropped": 1, "spanned_refit": 1, "staleness_histogram": {2: 1},
    }
    assert (f.kept, f.dropped) == (1, 2)  # the returned request is not a sample


def test_too_old_is_staleness_above_the_limit_and_none_is_no_limit():
    assert [too_old(v, 9, 2) for v in (9, 7, 6, 0)] == [False, False, True, True]
    assert [too_old(v, 4, 0) for v in (4, 3)] == [False, True]
    assert not too_old(0, 10**6, None)
    with pytest.raises(ValueError, match="started under version 8, newer than the current version 7"):
        too_old(8, 7, None)


def test_the_filter_keeps_exactly_what_too_old_lets_through():
    # fleet.lifecycle aborts requests in flight and the recipe's trainer drops samples by too_old;
    # a result the lifecycle let through is never dropped here for the same age.
    limit, version = 2, 9
    f = StalenessFilter(limit)
    for v in range(0, version + 1):
        assert f.admit(v, version) == (not too_old(v, version, limit)) == (not (version - v > limit))


@settings(max_examples=200, deadline=None)
@given(
    limit=st.one_of(st.none(), st.integers(0, 6)),
    current=st.integers(0, 30),
    starts=st.lists(st.integers(0, 30), max_size=40),
)
def test_counts_add_up_and_every_kept_sample_is_within_the_limit(limit, current, starts):
    starts = [min(s, current) for s in starts]
    f = StalenessFilter(limit)
    kept, dropped = f.split([result(s, rid=str(i)) for i, s in enumerate(starts)], current)
    assert len(kept) + len(dropped) == len(starts) == f.kept + f.dropped
    assert sum(f.histogram.values()) == len(starts)
    assert all(limit is None or current - r.version_start <= limit for r in kept)
    assert all(current - r.version_start > limit for r in dropped)
