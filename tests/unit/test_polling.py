"""``fleet.polling``: the synchronous waits' one helper (on tenacity), what it returns and when it stops."""

from __future__ import annotations

import itertools
import time

import pytest

from rlfleet.fleet.polling import poll, wait_until


def test_poll_returns_the_first_result_that_is_done_without_calling_again():
    calls = itertools.count(1)
    seen = []

    def fn():
        seen.append(next(calls))
        return seen[-1]

    assert poll(fn, lambda n: n >= 3, 10.0, 0.001) == 3 and seen == [1, 2, 3]


def test_poll_that_runs_out_of_time_returns_the_last_result_and_waits_at_most_about_its_bound():
    t0 = time.monotonic()
    out = poll(lambda: {"in_progress": 2}, lambda c: not c["in_progress"], 0.2, 0.05)
    waited = time.monotonic() - t0
    assert out == {"in_progress": 2} and 0.2 <= waited < 2.0
    assert wait_until(lambda: False, 0.1, 0.02) is False and wait_until(lambda: 1, 0.1, 0.02) is True


def test_the_polled_functions_own_error_passes_through_at_once():
    calls = []

    def fn():
        calls.append(1)
        raise RuntimeError("the HTTP server exited while starting")

    with pytest.raises(RuntimeError, match="exited while starting"):
        poll(fn, bool, 10.0, 0.001)
    assert len(calls) == 1


def test_a_callers_clock_and_sleep_bound_the_wait():
    """A caller polls on its own clock (``fleet.api`` passes its module's, which its tests replace): the bound
    is read on that clock and the waits are its sleeps."""
    now = [0.0]
    slept = []

    def sleep(dt):
        slept.append(dt)
        now[0] += dt

    out = poll(lambda: now[0], lambda t: False, 1.0, 0.25, clock=lambda: now[0], sleep=sleep)
    assert out == 1.0 and slept == [0.25] * 4
