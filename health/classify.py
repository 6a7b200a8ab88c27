"""Failure classification: from what one call came to, to a ``FailureClass``
(DESIGN.md, "Failure classes"). Pure: imports no Ray.

The one path is ``exception or value -> outcome kind -> failure class``. The Ray
door (``fleet.cluster.ray_door``) does the first arrow, because only it may see Ray's
exception types; this module does the second:

==============  ==========  ===============================================
outcome kind    class       why
==============  ==========  ===============================================
``ok``          OK          the call returned (an ack that ``is True``)
``died``        DEAD        confirmed death (``ActorDiedError``)
``unavailable`` SUSPECT     may come back (``ActorUnavailableError``, a bare
                            ``RayActorError``); probes decide
``timed_out``   HUNG        a deadline passed
``bad_ack``     LIED        any other ack (``None``, ``1``, ``"ok"`` ...)
``error``       ERROR       the actor answered with an exception: it is alive
==============  ==========  ===============================================

An event about a replaced incarnation is LATE whatever it says (``is_late``).
Guarantee on failure: functions raise ``ValueError`` naming the bad argument and
never return a guess.
"""

from __future__ import annotations

from rlfleet.health.states import FailureClass, RefitResult

__all__ = ["OUTCOME_KINDS", "classify_kind", "is_late", "refit_result"]


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
