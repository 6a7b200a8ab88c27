"""HealthConfig validation, the restart policy's budget and backoff, and the clocks."""

from __future__ import annotations

import math

import pytest

from rlfleet.health import Clock, FakeClock, HealthConfig, MonotonicClock, RestartPolicy


def test_defaults_are_valid_and_expose_the_restart_policy():
    config = HealthConfig(num_engines=4)
    assert config.restart_policy == RestartPolicy(3, 1.0, 60.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_engines": 0}, "num_engines must be an integer >= 1, got 0"),
        ({"num_engines": 2.0}, "num_engines must be an integer >= 1, got 2.0"),
        ({"num_engines": True}, "num_engines must be an integer >= 1, got True"),
        ({"num_engines": 3, "min_healthy_engines": 4},
         r"min_healthy_engines must be between 1 and num_engines \(3\), got 4"),
        ({"num_engines": 3, "min_healthy_engines": 0}, "min_healthy_engines must be an integer >= 1, got 0"),
        ({"num_engines": 3, "unhealthy_threshold": 0}, "unhealthy_threshold must be an integer >= 1, got 0"),
        ({"num_engines": 3, "suspect_timeout_s": 0}, "suspect_timeout_s must be a finite number of seconds > 0, got 0"),
        ({"num_engines": 3, "suspect_timeout_s": math.inf}, "suspect_timeout_s .* got inf"),
        ({"num_engines": 3, "probe_interval_s": -1.0}, "probe_interval_s must be a finite number of seconds >= 0, got -1.0"),
        ({"num_engines": 3, "restart_budget": -1}, "restart_budget must be an integer >= 0, got -1"),
        ({"num_engines": 3, "backoff_base_s": -0.5}, "backoff_base_s must be a finite number of seconds >= 0, got -0.5"),
        ({"num_engines": 3, "backoff_base_s": 10.0, "backoff_cap_s": 5.0},
         "backoff_cap_s must be a finite number of seconds >= 10, got 5.0"),
        ({"num_engines": 3, "backoff_cap_s": math.nan}, "backoff_cap_s .* got nan"),
    ],
)
def test_invalid_config_names_the_field_the_allowed_values_and_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HealthConfig(**kwargs)


def test_backoff_doubles_from_base_up_to_cap():
    policy = RestartPolicy(restart_budget=10, backoff_base_s=1.0, backoff_cap_s=5.0)
    assert [policy.backoff_s(n) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert policy.backoff_s(10_000) == 5.0  # no overflow for huge counts
    with pytest.raises(ValueError, match="restarts_used must be >= 0, got -1"):
        policy.backoff_s(-1)


def test_zero_base_means_immediate_restart():
    assert RestartPolicy(3, 0.0, 0.0).plan(0, now=7.0).not_before == 7.0


def test_plan_within_budget_is_due_after_backoff_from_now():
    plan = RestartPolicy(restart_budget=2, backoff_base_s=1.5, backoff_cap_s=60.0).plan(1, now=100.0)
    assert plan.allowed and plan.attempt == 2 and plan.not_before == 103.0
    assert "restart 2 of 2" in plan.reason


def test_plan_with_budget_spent_is_refused():
    policy = RestartPolicy(restart_budget=2)
    plan = policy.plan(2, now=0.0)
    assert not plan.allowed and plan.not_before is None
    assert plan.reason == "restart budget spent (2 of 2 used)"
    assert not RestartPolicy(restart_budget=0).plan(0, now=0.0).allowed


def test_fake_clock_moves_only_forward_and_only_when_told():
    clock = FakeClock(5.0)
    assert isinstance(clock, Clock) and clock.now() == 5.0 == clock.now()
    assert clock.advance(2.5) == 7.5 and clock.set(9.0) == 9.0
    for bad in (lambda: clock.advance(-1), lambda: clock.set(8.0), lambda: clock.advance(math.nan)):
        with pytest.raises(ValueError):
            bad()
    assert clock.now() == 9.0  # failures leave it unchanged
    with pytest.raises(ValueError, match="finite"):
        FakeClock(math.inf)


def test_monotonic_clock_never_goes_back():
    clock = MonotonicClock()
    assert isinstance(clock, Clock)
    readings = [clock.now() for _ in range(100)]
    assert readings == sorted(readings)
