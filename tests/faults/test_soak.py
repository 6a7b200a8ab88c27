"""The chaos soak, short form (CI): random recoverable faults for about a minute, every invariant held.

The long soak is ``python scripts/chaos_soak.py --duration-s 600``.
"""

from __future__ import annotations

import pytest

from faults.chaos import recovery_times, soak

pytestmark = [pytest.mark.integration, pytest.mark.soak]


@pytest.mark.timeout(600)
def test_short_chaos_soak_recovers_from_every_fault(ray_local, tiny_model):
    result = soak(tiny_model, duration_s=75.0, rate_per_min=30.0, seed=1)
    print(result)
    assert result["faults"] >= 2, result
    assert result["unrecovered"] == 0 and result["recoveries"] >= result["faults"], result
    assert result["prompts_lost"] == 0 and result["wrong_version_tags"] == 0, result
    assert result["invariants_held"], result


def test_recovery_times_read_from_the_event_log():
    events = [
        {"kind": "health", "slot": 1, "incarnation": 1, "before": "healthy", "after": "dead", "t": 10.0},
        {"kind": "gate", "open": True, "version": 2, "t": 12.0},
        {"kind": "stamp", "version": 3, "members": [[0, 1], [1, 2]], "t": 30.0},
        {"kind": "health", "slot": 0, "incarnation": 1, "before": "healthy", "after": "suspect", "t": 40.0},
        {"kind": "health", "slot": 2, "incarnation": 1, "before": "healthy", "after": "hung", "t": 50.0},
        {"kind": "health", "slot": 2, "incarnation": 1, "before": "hung", "after": "healthy", "t": 53.0},
    ]
    recover, reopen, unrecovered = recovery_times(events)
    assert recover == [20.0, 3.0] and reopen == [2.0] and unrecovered == 1
