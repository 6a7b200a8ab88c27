"""Fault injection is a handle of its own (``fleet.operator.FaultInjector``), not part of the trainer's ``Fleet``."""

from __future__ import annotations

import inspect

from rlfleet.fleet.api import Fleet
from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.operator import FaultInjector


def test_the_fleet_api_carries_no_fault_injection_only_the_handle():
    assert not [m for m in ("arm_fault", "kill_shard", "arm_controller_crash", "arm_crash") if hasattr(Fleet, m)]
    assert "fault_injector" in vars(Fleet)


def test_each_injector_call_reaches_the_controller_method_of_its_name_with_all_its_arguments():
    asked = []
    faults = FaultInjector(lambda method, *args, timeout: asked.append((method, args)) or True)
    assert faults.arm_fault(2, "generate", "poison", 0.0, 0, (7, 8)) is True
    assert faults.kill_shard(1) is True
    assert faults.arm_controller_crash("transfer", 0.5) is True
    assert asked == [("arm_fault", (2, "generate", "poison", 0.0, 0, [7, 8])), ("kill_shard", (1,)),
                     ("arm_crash", ("transfer", 0.5))]
    for method, args in asked:  # the controller takes exactly these (an actor call by name checks nothing)
        params = [p for p in inspect.signature(getattr(SingleController, method)).parameters.values() if p.name != "self"]
        assert len(args) == len(params), (method, args, [p.name for p in params])
