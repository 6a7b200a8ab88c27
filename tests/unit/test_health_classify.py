"""Failure classification (health.classify): outcome kind -> failure class, late
events, and refit results typed by bytes moved. The exception -> kind rows are
tested where that mapping lives, the Ray door (tests/unit/test_ray_door.py)."""

from __future__ import annotations

import pytest

from rlfleet.health import FailureClass, RefitResult, classify_kind, is_late, refit_result


def test_an_event_from_a_replaced_incarnation_is_late_whatever_it_says():
    assert is_late(2, 3) and not is_late(3, 3)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("ok", FailureClass.OK), ("died", FailureClass.DEAD), ("unavailable", FailureClass.SUSPECT),
     ("timed_out", FailureClass.HUNG), ("bad_ack", FailureClass.LIED), ("error", FailureClass.ERROR)],
)
def test_outcome_kind_words_from_the_ray_wrapper(kind, expected):
    assert classify_kind(kind) is expected


def test_unknown_outcome_kind_is_refused_with_the_allowed_words():
    with pytest.raises(ValueError, match="unknown outcome kind 'exploded'.*died"):
        classify_kind("exploded")


@pytest.mark.parametrize(
    ("moved", "expected", "result"),
    [(0, 10, RefitResult.NOT_STARTED), (1, 10, RefitResult.PARTIAL),
     (9, 10, RefitResult.PARTIAL), (10, 10, RefitResult.COMPLETE)],
)
def test_refit_result_is_typed_by_bytes_that_reached_the_participant(moved, expected, result):
    assert refit_result(moved, expected) is result


@pytest.mark.parametrize(("moved", "expected", "field"),
                         [(-1, 10, "bytes_moved"), (11, 10, "bytes_moved"), (0, 0, "bytes_expected"),
                          (1.5, 10, "bytes_moved")])
def test_refit_result_rejects_impossible_byte_counts(moved, expected, field):
    with pytest.raises(ValueError, match=field):
        refit_result(moved, expected)
