"""Failure classification (health.classify): one test per row of the table, by
exception class name through the MRO, with stand-ins named like Ray's classes, and
once more against Ray's real classes when Ray is installed."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from health import (
    CallKind,
    FailureClass,
    Observed,
    RefitResult,
    classify_ack,
    classify_exception,
    classify_kind,
    classify_observation,
    classify_outcome,
    describe_outcome,
    exception_names,
    is_late,
    observe,
    refit_result,
)


def _cls(name: str, *bases: type) -> type:
    return type(name, bases or (Exception,), {})


RayError = _cls("RayError")
RayActorError = _cls("RayActorError", RayError)
ActorDiedError = _cls("ActorDiedError", RayActorError)
ActorUnavailableError = _cls("ActorUnavailableError", RayActorError)
GetTimeoutError = _cls("GetTimeoutError", RayError, TimeoutError)
RayTaskError = _cls("RayTaskError", RayError)


def task_error_of(cause: type) -> BaseException:
    """What Ray builds for an exception raised inside an actor method."""
    return type(f"RayTaskError({cause.__name__})", (RayTaskError, cause), {})()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ActorDiedError(), FailureClass.DEAD),
        (_cls("PreemptedDeath", ActorDiedError)(), FailureClass.DEAD),
        (ActorUnavailableError(), FailureClass.SUSPECT),
        (GetTimeoutError(), FailureClass.HUNG),
        (TimeoutError("pause did not settle in 30 s"), FailureClass.HUNG),
        (asyncio.TimeoutError(), FailureClass.HUNG),
        (concurrent.futures.TimeoutError(), FailureClass.HUNG),
        (RayActorError(), FailureClass.SUSPECT),
        (task_error_of(ValueError), FailureClass.ERROR),
        (task_error_of(ActorDiedError), FailureClass.ERROR),
        (task_error_of(TimeoutError), FailureClass.ERROR),
        (ValueError("bad weights"), FailureClass.ERROR),
        (RuntimeError("cuda"), FailureClass.ERROR),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.value,
)
def test_exception_classification_table(exc, expected):
    assert classify_exception(exc) is expected
    assert classify_outcome(exc) is expected
    assert classify_outcome(exc, expect_ack=False) is expected


def test_names_are_matched_along_the_mro():
    assert {"ActorDiedError", "RayActorError", "RayError"} <= exception_names(ActorDiedError())
    # A class merely *named* like a parent's sibling is not confused with it.
    assert classify_exception(_cls("ActorDiedErrorLike", RayError)()) is FailureClass.ERROR


def test_classify_exception_rejects_non_exceptions():
    with pytest.raises(TypeError, match="exception instance"):
        classify_exception(ActorDiedError)  # the class, not an instance


def test_only_an_ack_that_is_exactly_true_is_ok():
    assert classify_ack(True) is FailureClass.OK


class _EqualsTrue:
    def __eq__(self, other):
        return True

    def __bool__(self):
        return True

    __hash__ = object.__hash__


@pytest.mark.parametrize("ack", [False, None, 1, 1.0, "True", "ok", [True], (True,), _EqualsTrue()])
def test_any_other_ack_is_a_lie(ack):
    assert classify_ack(ack) is FailureClass.LIED
    assert classify_outcome(ack) is FailureClass.LIED


def test_results_without_an_ack_are_ok_unless_they_raised():
    assert classify_outcome({"tokens": [1, 2]}, expect_ack=False) is FailureClass.OK
    assert classify_outcome(None, expect_ack=False) is FailureClass.OK
    assert classify_outcome(ActorDiedError(), expect_ack=False) is FailureClass.DEAD


def test_an_event_from_a_replaced_incarnation_is_late_whatever_it_says():
    assert is_late(2, 3) and not is_late(3, 3)
    for outcome in (ActorDiedError(), True, None):
        assert classify_observation(outcome, incarnation=2, current_incarnation=3) is FailureClass.LATE
    assert classify_observation(ActorDiedError(), incarnation=3, current_incarnation=3) is FailureClass.DEAD
    assert classify_observation(True, incarnation=3, current_incarnation=3) is FailureClass.OK


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


def test_observe_builds_a_classified_event_with_a_description():
    ev = observe(2, 5, CallKind.PAUSE, ActorUnavailableError("node 7 unreachable"))
    assert ev == Observed(2, 5, CallKind.PAUSE, FailureClass.SUSPECT,
                          "ActorUnavailableError: node 7 unreachable")
    assert observe(1, 1, CallKind.RESUME, None).failure is FailureClass.LIED
    assert observe(1, 1, CallKind.RESUME, None).detail == "ack=None"
    assert observe(1, 1, CallKind.GENERATE, "text", expect_ack=False).failure is FailureClass.OK
    with pytest.raises(TypeError, match="CallKind for slot 1"):
        observe(1, 1, "pause", True)


def test_descriptions_are_bounded():
    text = describe_outcome(ValueError("x" * 1000), limit=50)
    assert len(text) == 50 and text.startswith("ValueError: xx") and text.endswith("...")


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


def test_real_ray_exceptions_classify_by_name():
    from ray import exceptions as rex  # the test file may use Ray; health/ itself never imports it
    assert classify_exception(rex.ActorDiedError()) is FailureClass.DEAD
    assert classify_exception(rex.ActorUnavailableError("gone", None)) is FailureClass.SUSPECT
    assert classify_exception(rex.GetTimeoutError()) is FailureClass.HUNG
    assert classify_exception(rex.RayActorError()) is FailureClass.SUSPECT
    wrapped = rex.RayTaskError("reload", "tb", rex.ActorDiedError()).as_instanceof_cause()
    assert isinstance(wrapped, rex.ActorDiedError)  # Ray's dual class inherits the cause...
    assert classify_exception(wrapped) is FailureClass.ERROR  # ...but the shard itself answered
    app = rex.RayTaskError("reload", "tb", ValueError("shape")).as_instanceof_cause()
    assert classify_exception(app) is FailureClass.ERROR
