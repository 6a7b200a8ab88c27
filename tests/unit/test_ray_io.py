"""The one door to Ray maps every failure to the outcome kind the health core expects."""

from ray import exceptions as rex

from fleet.errors import DeadlineExceeded
from fleet.ray_io import BAD_ACK, DIED, ERROR, OK, TIMED_OUT, UNAVAILABLE, outcome_of


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


def test_acks_must_be_exactly_true():
    assert outcome_of(True, expect_ack=True).kind == OK
    for lie in (False, None, 1, "True", [True]):
        assert outcome_of(lie, expect_ack=True).kind == BAD_ACK
    assert outcome_of({"any": "value"}).kind == OK


def test_a_fleet_the_cluster_cannot_place_is_refused_naming_the_field(monkeypatch):
    import pytest

    from fleet import ray_io
    from fleet.errors import ConfigError

    monkeypatch.setattr(ray_io.ray, "cluster_resources", lambda: {"CPU": 2.0})
    ray_io.check_capacity(2, 1.0, 0.0)  # fits
    with pytest.raises(ConfigError, match=r"engine\.num_cpus.*3 engines x 1 CPU = 3 CPU.*has 2"):
        ray_io.check_capacity(3, 1.0, 0.0)
    with pytest.raises(ConfigError, match=r"engine\.num_gpus"):
        ray_io.check_capacity(1, 0.0, 1.0)
