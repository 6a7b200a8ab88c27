"""The one door to Ray maps every failure to the outcome kind the health core expects."""

import signal
import subprocess
import sys
import time

import psutil
from ray import exceptions as rex

from rlfleet.fleet.errors import DeadlineExceeded, ShardUnavailableError
from rlfleet.fleet.cluster.ray_door import BAD_ACK, DIED, ERROR, OK, TIMED_OUT, UNAVAILABLE, outcome_of
from rlfleet.fleet.cluster.stranded import end_stranded_workers


def _task_error(cause: BaseException) -> rex.RayTaskError:
    return rex.RayTaskError("fn", "traceback", cause)


def test_confirmed_death_unavailable_and_timeouts():
    assert outcome_of(exc=rex.ActorDiedError()).kind == DIED
    assert outcome_of(exc=rex.ActorUnavailableError("x", b"0" * 16)).kind == UNAVAILABLE
    assert outcome_of(exc=rex.RayActorError()).kind == UNAVAILABLE  # not a confirmed death
    assert outcome_of(exc=rex.GetTimeoutError()).kind == TIMED_OUT
    assert outcome_of(exc=TimeoutError()).kind == TIMED_OUT


def test_an_actor_answering_with_an_error_is_not_dead():
    out = outcome_of(exc=_task_error(ValueError("bad sampling")))
    assert out.kind == ERROR and isinstance(out.error, ValueError)
    # even if the actor's own code saw someone else's death
    assert outcome_of(exc=_task_error(rex.ActorDiedError())).kind == ERROR
    # the shard's own deadline means the shard is hung
    assert outcome_of(exc=_task_error(DeadlineExceeded("pause did not finish"))).kind == TIMED_OUT
    # the shard's own "unavailable" means it could not take the call, as Ray's ActorUnavailableError does
    out = outcome_of(exc=_task_error(ShardUnavailableError("slot 2 unavailable at resume")))
    assert out.kind == UNAVAILABLE and isinstance(out.error, ShardUnavailableError)


def test_acks_must_be_exactly_true():
    assert outcome_of(True, expect_ack=True).kind == OK
    for lie in (False, None, 1, "True", [True]):
        assert outcome_of(lie, expect_ack=True).kind == BAD_ACK
    assert outcome_of({"any": "value"}).kind == OK


def test_a_fleet_the_cluster_cannot_place_is_refused_naming_the_field(monkeypatch):
    import pytest

    from rlfleet.fleet.cluster import ray_door
    from rlfleet.fleet.errors import ConfigError

    monkeypatch.setattr(ray_door.ray, "cluster_resources", lambda: {"CPU": 2.0})
    ray_door.check_capacity(2, 1.0, 0.0)  # fits
    with pytest.raises(ConfigError, match=r"engine\.num_cpus.*3 engines x 1 CPU = 3 CPU.*has 2"):
        ray_door.check_capacity(3, 1.0, 0.0)
    with pytest.raises(ConfigError, match=r"engine\.num_gpus"):
        ray_door.check_capacity(1, 0.0, 1.0)


# --- exception -> outcome kind -> failure class: one row per line of DESIGN's failure table,
# through the one path the controller uses (the door's outcome_of, then fleet.outcome.observed).
import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402

import pytest  # noqa: E402

from rlfleet.fleet.errors import EngineCrashedError, ShardShutDownError  # noqa: E402
from rlfleet.fleet.outcome import observed  # noqa: E402
from rlfleet.health import CallKind, FailureClass, Observed  # noqa: E402


def _failure(outcome) -> FailureClass:
    return observed(0, 1, CallKind.PAUSE, outcome).failure


class PreemptedDeath(rex.ActorDiedError):
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (rex.ActorDiedError(), FailureClass.DEAD),
        (PreemptedDeath(), FailureClass.DEAD),
        (rex.ActorUnavailableError("gone", None), FailureClass.SUSPECT),
        (rex.GetTimeoutError(), FailureClass.HUNG),
        (TimeoutError("pause did not settle in 30 s"), FailureClass.HUNG),
        (asyncio.TimeoutError(), FailureClass.HUNG),
        (concurrent.futures.TimeoutError(), FailureClass.HUNG),
        (rex.RayActorError(), FailureClass.SUSPECT),
        (_task_error(ValueError("shape")), FailureClass.ERROR),
        (_task_error(rex.ActorDiedError()), FailureClass.ERROR),
        (_task_error(TimeoutError("inner")), FailureClass.ERROR),
        (_task_error(DeadlineExceeded("resume did not finish")), FailureClass.HUNG),
        (_task_error(ShardUnavailableError("unavailable at resume")), FailureClass.SUSPECT),
        (ValueError("bad weights"), FailureClass.ERROR),
        (RuntimeError("cuda"), FailureClass.ERROR),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.value,
)
def test_exception_classification_table(exc, expected):
    assert _failure(outcome_of(exc=exc)) is expected


def test_a_wrapped_death_the_shard_itself_reported_is_an_answer():
    wrapped = rex.RayTaskError("reload", "tb", rex.ActorDiedError()).as_instanceof_cause()
    assert isinstance(wrapped, rex.ActorDiedError)  # Ray's dual class inherits the cause...
    assert _failure(outcome_of(exc=wrapped)) is FailureClass.ERROR  # ...but the shard itself answered


class _EqualsTrue:
    def __eq__(self, other):
        return True

    def __bool__(self):
        return True

    __hash__ = object.__hash__


@pytest.mark.parametrize("ack", [False, None, 1, 1.0, "True", "ok", [True], (True,), _EqualsTrue()])
def test_any_ack_but_true_is_a_lie(ack):
    assert _failure(outcome_of(ack, expect_ack=True)) is FailureClass.LIED
    assert _failure(outcome_of(True, expect_ack=True)) is FailureClass.OK


def test_results_without_an_ack_are_ok_unless_they_raised():
    assert _failure(outcome_of({"tokens": [1, 2]})) is FailureClass.OK
    assert _failure(outcome_of(None)) is FailureClass.OK


def test_an_unusable_shard_counts_as_dead():
    for exc in (EngineCrashedError("engine core exited"), ShardShutDownError("shut down")):
        assert _failure(outcome_of(exc=_task_error(exc))) is FailureClass.DEAD


def test_observed_carries_a_bounded_description():
    ev = observed(2, 5, CallKind.PAUSE, outcome_of(exc=rex.ActorUnavailableError("node 7 unreachable", None)))
    assert ev == Observed(2, 5, CallKind.PAUSE, FailureClass.SUSPECT, ev.detail)
    assert ev.detail.startswith("unavailable: ActorUnavailableError")
    assert len(observed(1, 1, CallKind.RESUME, outcome_of(exc=ValueError("x" * 1000))).detail) == 300


def test_the_processes_a_group_signal_missed_are_ended_one_that_ignores_sigterm_killed(tmp_path):
    """``end_stranded_workers`` ends every process carrying the Ray session's mark, each in a process group of
    its own as Ray's workers are, and their children: SIGTERM first, SIGKILL for one that ignores it."""
    ready = tmp_path / "ready"
    # a "worker" that ignores SIGTERM and has a child (an engine core); and one of another Ray session
    stubborn = ("import signal, subprocess, sys, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                f"pathlib.Path({str(ready)!r}).write_text(str(c.pid)); time.sleep(600)")
    ours = subprocess.Popen([sys.executable, "-c", stubborn, "--session-name=session_test_1"], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--session-name=session_test_2"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline, "the stand-in worker did not start"
            time.sleep(0.05)
        child = int(ready.read_text())
        t0 = time.monotonic()
        ended = end_stranded_workers("session_test_1", grace_s=0.5)
        assert sorted(ended) == sorted([ours.pid, child]), ended
        assert ours.wait(5) == -signal.SIGKILL  # it ignored SIGTERM: killed after the grace
        assert time.monotonic() - t0 < 5
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None  # another session's process is not touched
    finally:
        for proc in (ours, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
