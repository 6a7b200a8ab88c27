"""The SingleController on real Ray and real vLLM-CPU engines: a refit's weights really reach every engine,
and misuse of the API changes nothing.

Deaths at every phase, restarts, bad updates and a fleet killed below quorum are the fault matrix's
(``faults.matrix``: kill-step-boundary, kill-during-pause/transfer/resume, restart-readmission,
bad-update-*, kill-two-below-quorum), each with its evidence checks; this module no longer repeats them
on a fleet of its own (they cost 2.5 minutes of engine restarts here).
"""

from __future__ import annotations

import pytest

from rlfleet.fleet.errors import RefitArgumentError, RefitRefused
from tests.integration.fleet_helpers import Run, assert_invariants, logprob_gap

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(shared_fleet):
    r = Run(shared_fleet.fleet, shared_fleet.source)  # the session's fleet (tests/integration/conftest.py)
    r.version = shared_fleet.fleet.status()["version"]
    return r


def test_refit_moves_new_weights_into_every_engine(run):
    summary = run.refit()
    assert summary["complete"] == [0, 1] and summary["attempts"] == 1
    results = [r for g in run.fleet.generate([[1, 9, 8, 7]] * 4, n=2, sampling={"max_tokens": 12, "seed": 5}) for r in g]
    assert all(r.ok and r.result.weight_version == run.version for r in results)
    assert {r.result.slot for r in results} == {0, 1}
    gap = logprob_gap(run.source, results)
    print(f"engine vs trainer logprob max diff after refit: {gap:.2e}")
    assert gap < 1e-4
    assert_invariants(run.fleet)


def test_refit_misuse_changes_nothing(run):
    run.heal()
    version = run.fleet.status()["version"]
    with pytest.raises(RefitRefused, match=rf"version {version} is not greater than the committed version {version}"):
        run.fleet.sync_weights(version, run.source)
    with pytest.raises(RefitArgumentError, match="source must be a weight sender"):
        run.fleet.sync_weights(version + 1, None)
    with pytest.raises(RefitArgumentError, match="version must be an integer"):
        run.fleet.sync_weights(float(version + 1), run.source)
    status = run.fleet.status()
    assert status["gate_open"] and status["version"] == version and status["stopped"] is None
    with pytest.raises(TypeError, match="flat list of 3 integers"):
        run.fleet.generate([1, 2, 3])
    with pytest.raises(TypeError, match="fleet.collect takes what fleet.submit returned, got list"):
        run.fleet.collect(["not a pending group"])  # was an AttributeError from inside collect
    with pytest.raises(ValueError, match=r"no engine runs in slot 9; slots with one: \[0, 1\]"):
        run.fleet.fault_injector().kill_shard(9)  # was a KeyError raised in the controller actor
    after = run.fleet.status()
    assert after["gate_open"] and after["serving"] == status["serving"] and after["stopped"] is None
