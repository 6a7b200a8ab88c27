"""How ``rlfleet demo`` and ``rlfleet faults run`` take signals (``fleet.interrupt``): the first one interrupts the run, Ray's own SIGINT that
comes with a SIGTERM does not end it a second time, and the report names the SIGTERM."""

from __future__ import annotations

import signal

import pytest

from rlfleet.fleet import interrupt as run


@pytest.fixture(autouse=True)
def fresh():
    run._SIGNALS.clear()
    yield
    run._SIGNALS.clear()


def test_the_first_signal_interrupts_and_a_different_one_at_once_is_only_noted():
    with pytest.raises(run.Interrupted) as first:
        run._raise_interrupted(signal.SIGINT, None)  # Ray's interruption of the main thread, handled first
    assert isinstance(first.value, KeyboardInterrupt) and first.value.signum == signal.SIGINT
    run._raise_interrupted(signal.SIGTERM, None)  # the signal that was sent: no second interruption, no exit
    assert run.interrupted_by() == "SIGTERM"


def test_a_lone_ctrl_c_is_reported_as_sigint_and_no_signal_as_none():
    assert run.interrupted_by() is None
    with pytest.raises(run.Interrupted):
        run._raise_interrupted(signal.SIGINT, None)
    assert run.interrupted_by() == "SIGINT"


def test_the_same_signal_again_later_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(run.os, "_exit", exits.append)
    with pytest.raises(run.Interrupted):
        run._raise_interrupted(signal.SIGINT, None)
    run._raise_interrupted(signal.SIGINT, None)  # within a second: the same press, delivered twice
    assert exits == []
    run._SIGNALS[0] = (signal.SIGINT, run._SIGNALS[0][1] - 5.0)  # the first came 5 s ago: a second Ctrl-C
    run._raise_interrupted(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]
