"""What one call to a shard came to, and what that means for the health core. Ray-free.

The door (``fleet.cluster.ray_door``) turns whatever a call raised or returned into an
``Outcome`` whose ``kind`` is one word; this module turns an outcome into a health
observation. Together they are the one classification path:

    exception or value --(ray_door.outcome_of)--> Outcome.kind --(observed)--> FailureClass

- ``ok``: the call returned (``value`` holds the result);
- ``died``: the actor is confirmed dead;
- ``unavailable``: the actor could not be reached right now: suspect, not dead;
- ``timed_out``: the deadline passed: hung;
- ``bad_ack``: an acknowledgement that was not exactly ``True``: a lie;
- ``error``: the call raised inside the actor (``error`` holds the actor's own exception).

A shard that answers with ``ShardUnusableError`` (engine core crashed, shut down)
is as good as dead: ``is_unusable`` says so, and ``observed`` classes it ``dead``. A client
reports such an answer as ``unusable`` (``UNUSABLE``), a dead actor as ``died``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfleet.fleet.errors import DeadlineExceeded, EngineStalledError, ShardUnavailableError, ShardUnusableError
from rlfleet.health import CallKind, FailureClass, Observed
from rlfleet.health.classify import classify_kind
from rlfleet.health.progress import stall_verdict
from rlfleet.fleet.wire import ShardInfo

OK, DIED, UNAVAILABLE, TIMED_OUT, BAD_ACK, ERROR = "ok", "died", "unavailable", "timed_out", "bad_ack", "error"
KINDS = (OK, DIED, UNAVAILABLE, TIMED_OUT, BAD_ACK, ERROR)
# A client's report only (``SingleController.report_failure``), never an outcome: the shard answered, alive, that
# it cannot serve (``is_unusable``: its engine core crashed, it was shut down)
UNUSABLE = "unusable"


@dataclass(frozen=True)
class Outcome:
    kind: str
    value: Any = None
    error: BaseException | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind == OK

    def describe(self) -> str:
        if self.kind == OK:
            return "ok"
        if self.kind == BAD_ACK:
            return f"bad ack {self.value!r}"
        return f"{self.kind}: {type(self.error).__name__}: {self.error}" if self.error else self.kind


# The shard's own exceptions that are not answers: what each says about the shard.
_SHARD_SAYS = ((DeadlineExceeded, TIMED_OUT), (ShardUnavailableError, UNAVAILABLE))


def answer_kind(exc: BaseException) -> str:
    """The kind of a call whose shard, alive, raised ``exc`` itself: ``error`` (an answer), except its own
    ``DeadlineExceeded`` (hung: ``timed_out``) and ``ShardUnavailableError`` (could not take it: ``unavailable``)."""
    return next((kind for cls, kind in _SHARD_SAYS if isinstance(exc, cls)), ERROR)


def answer_outcome(item: Any, elapsed_s: float = 0.0) -> Outcome:
    """One item of a batched call's answer (``EngineShard.serve_many``: a value, or the exception the shard
    raised for that item) as the ``Outcome`` a call of its own would have come to."""
    if isinstance(item, BaseException):
        return Outcome(answer_kind(item), error=item, elapsed_s=elapsed_s)
    return Outcome(OK, value=item, elapsed_s=elapsed_s)


def is_unusable(outcome: Outcome) -> bool:
    """Dead, or alive but unable to serve (its engine crashed, it was shut down): fence it."""
    return outcome.kind == DIED or (outcome.kind == ERROR and isinstance(outcome.error, ShardUnusableError))


def observed(slot: int, incarnation: int, call: CallKind, outcome: Outcome) -> Observed:
    """The health observation for one settled call of ``incarnation`` of ``slot``."""
    failure = FailureClass.DEAD if is_unusable(outcome) else classify_kind(outcome.kind)
    return Observed(slot, incarnation, call, failure, outcome.describe()[:300])


def with_progress(outcome: Outcome, stall_timeout_s: float) -> Outcome:
    """A ping answered ``ok`` whose progress facts (``health.progress``) say its engine held work and made
    no progress past ``stall_timeout_s`` is a hang: ``timed_out``, naming the numbers. Others unchanged."""
    if not outcome.ok or not isinstance(outcome.value, ShardInfo):
        return outcome
    why = stall_verdict(outcome.value.progress, stall_timeout_s)
    if why is None:
        return outcome
    return Outcome(TIMED_OUT, value=outcome.value, error=EngineStalledError(why), elapsed_s=outcome.elapsed_s)
