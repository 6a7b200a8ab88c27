"""Failure classification: pure functions from what the controller saw to a
``FailureClass`` (DESIGN.md, "Failure classes").

Ray exception types are matched by *class name* along the exception's MRO, so this
module (and all of ``health/``) imports no Ray, and subclasses are recognised:

=================================  ==========  ===============================
seen                               class       why
=================================  ==========  ===============================
``RayTaskError`` (any cause)       ERROR       the actor answered: the method
                                               raised, the actor is alive
``ActorDiedError``                 DEAD        confirmed death
``ActorUnavailableError``          SUSPECT     may come back; probe decides
``GetTimeoutError``,               HUNG        a deadline passed
``TimeoutError`` (incl. asyncio's)
bare ``RayActorError``             SUSPECT     dead *or* unavailable: not a
                                               confirmed death, so probe
any other exception                ERROR       the call failed
an ack that ``is True``            OK
any other ack (``None``, ``1``,    LIED        never counted as success
``"ok"``, ``numpy.True_`` ...)
event's incarnation != current     LATE        ignored
=================================  ==========  ===============================

``RayTaskError`` is checked first because Ray builds ``RayTaskError(<Cause>)``
classes that also inherit from the cause: an actor whose *own* call to another actor
raised ``ActorDiedError`` is alive, and must not be condemned for it.

For a call still pending at its deadline, pass a ``TimeoutError`` naming the call
and the deadline. A Ray wrapper that has already reduced an outcome to a kind word
(``ok``, ``died``, ``unavailable``, ``timed_out``, ``bad_ack``, ``error``) can use
``classify_kind`` instead. Guarantee on failure: functions raise ``TypeError``/``ValueError``
naming the bad argument and never return a guess.
"""

from __future__ import annotations

from health.events import Observed
from health.states import CallKind, FailureClass, RefitResult

__all__ = [
    "classify_ack",
    "classify_exception",
    "classify_kind",
    "classify_observation",
    "classify_outcome",
    "describe_outcome",
    "exception_names",
    "is_late",
    "observe",
    "refit_result",
]

APPLICATION_ERROR_NAMES = frozenset({"RayTaskError"})
DEATH_NAMES = frozenset({"ActorDiedError"})
UNAVAILABLE_NAMES = frozenset({"ActorUnavailableError"})
TIMEOUT_NAMES = frozenset({"GetTimeoutError", "TimeoutError"})
ACTOR_ERROR_NAMES = frozenset({"RayActorError"})

_RULES = (
    (APPLICATION_ERROR_NAMES, FailureClass.ERROR),
    (DEATH_NAMES, FailureClass.DEAD),
    (UNAVAILABLE_NAMES, FailureClass.SUSPECT),
    (TIMEOUT_NAMES, FailureClass.HUNG),
    (ACTOR_ERROR_NAMES, FailureClass.SUSPECT),
)


def exception_names(exc: BaseException) -> frozenset[str]:
    """Names of every class in ``type(exc).__mro__``."""
    return frozenset(cls.__name__ for cls in type(exc).__mro__)


def classify_exception(exc: BaseException) -> FailureClass:
    """Classify an exception raised by a call to one shard (see the module table)."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"classify_exception needs an exception instance, got {exc!r}")
    names = exception_names(exc)
    for rule_names, failure in _RULES:
        if not names.isdisjoint(rule_names):
            return failure
    return FailureClass.ERROR


def classify_ack(value: object) -> FailureClass:
    """``OK`` iff ``value is True``; anything else is a lie (``LIED``)."""
    return FailureClass.OK if value is True else FailureClass.LIED


def classify_outcome(outcome: object, *, expect_ack: bool = True) -> FailureClass:
    """Classify a settled call: an exception instance, or the value it returned.

    With ``expect_ack`` (lifecycle calls and probes) the value must be exactly
    ``True``; without it (ordinary results) any value is ``OK``.
    """
    if isinstance(outcome, BaseException):
        return classify_exception(outcome)
    if expect_ack:
        return classify_ack(outcome)
    return FailureClass.OK


OUTCOME_KINDS: dict[str, FailureClass] = {
    "ok": FailureClass.OK,
    "died": FailureClass.DEAD,
    "unavailable": FailureClass.SUSPECT,
    "timed_out": FailureClass.HUNG,
    "bad_ack": FailureClass.LIED,
    "error": FailureClass.ERROR,
}


def classify_kind(kind: str) -> FailureClass:
    """Map an outcome kind word from the Ray wrapper to a ``FailureClass``."""
    try:
        return OUTCOME_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown outcome kind {kind!r}; expected one of {', '.join(OUTCOME_KINDS)}"
        ) from None


def is_late(incarnation: int, current_incarnation: int) -> bool:
    """True when an event about ``incarnation`` comes from a replaced incarnation."""
    return incarnation != current_incarnation


def classify_observation(
    outcome: object, *, incarnation: int, current_incarnation: int, expect_ack: bool = True
) -> FailureClass:
    """``LATE`` for a replaced incarnation, else ``classify_outcome(outcome)``."""
    if is_late(incarnation, current_incarnation):
        return FailureClass.LATE
    return classify_outcome(outcome, expect_ack=expect_ack)


def describe_outcome(outcome: object, *, limit: int = 200) -> str:
    """A short description for reasons: ``ActorDiedError: ...`` or ``ack=None``."""
    if isinstance(outcome, BaseException):
        text = f"{type(outcome).__name__}: {outcome}"
    else:
        text = f"ack={outcome!r}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def observe(
    slot: int, incarnation: int, call: CallKind, outcome: object, *, expect_ack: bool = True
) -> Observed:
    """Build the ``Observed`` event for one settled call (the usual controller path).

    ``outcome`` is the exception the call raised or the value it returned; for a call
    that missed its deadline pass a ``TimeoutError``.
    """
    if not isinstance(call, CallKind):
        raise TypeError(f"observe needs a CallKind for slot {slot}, got {call!r}")
    return Observed(
        slot, incarnation, call,
        classify_outcome(outcome, expect_ack=expect_ack),
        describe_outcome(outcome),
    )


def refit_result(bytes_moved: int, bytes_expected: int) -> RefitResult:
    """Type what a weight transfer did to one participant from the bytes that
    actually reached it: none -> NOT_STARTED, some -> PARTIAL, all -> COMPLETE.

    Preconditions: ``0 <= bytes_moved <= bytes_expected`` and ``bytes_expected > 0``.
    """
    if type(bytes_expected) is not int or bytes_expected <= 0:
        raise ValueError(f"bytes_expected must be an integer > 0, got {bytes_expected!r}")
    if type(bytes_moved) is not int or not 0 <= bytes_moved <= bytes_expected:
        raise ValueError(
            f"bytes_moved must be an integer between 0 and bytes_expected "
            f"({bytes_expected}), got {bytes_moved!r}"
        )
    if bytes_moved == 0:
        return RefitResult.NOT_STARTED
    if bytes_moved < bytes_expected:
        return RefitResult.PARTIAL
    return RefitResult.COMPLETE
