"""When the chaos soak takes another step: its duration, then overtime only for owed controller kills."""

from rlfleet.faults.chaos import CONTROLLER_KILLS, due


def test_within_the_duration_the_soak_steps_whatever_fired():
    assert due(0.0, 0, 35.0, 240.0)
    assert due(34.9, len(CONTROLLER_KILLS), 35.0, 240.0)


def test_past_the_duration_it_steps_only_while_a_controller_kill_is_owed():
    assert not due(35.0, len(CONTROLLER_KILLS), 35.0, 240.0)
    assert due(35.0, len(CONTROLLER_KILLS) - 1, 35.0, 240.0)
    assert due(274.9, 0, 35.0, 240.0)


def test_overtime_is_bounded():
    assert not due(275.0, 0, 35.0, 240.0)
