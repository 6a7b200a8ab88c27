"""Fault plans: validation names the field, resolution is deterministic per seed."""

import pytest

from faults.matrix import MATRIX, by_name
from health.faultplan import load_plan, resolve


def plan(**over):
    base = {"name": "p", "expect": "recovers", "steps": 3, "faults": [{"where": "transfer", "what": "kill", "shard": 1, "step": 2}]}
    base.update(over)
    return base


def test_yaml_plan_loads_and_resolves():
    p = load_plan("name: x\nexpect: stops\nsteps: 2\nfaults:\n  - {where: pause, what: hang, shard: 0, step: 1}\n")
    assert p.expect == "stops" and [(f.step, f.where, f.what, f.slot) for f in resolve(p, 3)] == [(1, "pause", "hang", 0)]


@pytest.mark.parametrize(
    "over, field",
    [
        ({"expect": "maybe"}, "expect"),
        ({"faults": [{"where": "lunch", "what": "kill", "shard": 0}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "pause", "what": "explode", "shard": 0}]}, r"faults\[0\]\.what"),
        ({"faults": [{"where": "generate", "what": "false_ack", "shard": 0}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "pause", "what": "kill", "shard": -1}]}, r"faults\[0\]\.shard"),
        ({"faults": [{"where": "pause", "what": "kill", "shard": 0, "step": 9}]}, r"faults\[0\]\.step"),
        ({"faults": [{"where": "pause", "what": "kill", "shard": 0, "times": 3}]}, r"faults\[0\]\.every"),
        ({"bogus": 1}, "unknown keys"),
    ],
)
def test_bad_plans_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        load_plan(plan(**over))


def test_random_shard_is_seeded_and_repeats_follow_every():
    p = load_plan(plan(seed=5, steps=6, faults=[{"where": "step_boundary", "what": "kill", "shard": "random", "every": 2, "times": 3}]))
    a, b = resolve(p, 4), resolve(p, 4)
    assert a == b and [f.step for f in a] == [1, 3, 5] and len({f.slot for f in a}) == 1
    with pytest.raises(ValueError, match="below the fleet"):
        resolve(load_plan(plan(faults=[{"where": "pause", "what": "kill", "shard": 7}])), 3)


def test_matrix_covers_every_required_variant_and_all_plans_are_valid():
    names = {v.name for v in MATRIX}
    required = {"kill-step-boundary", "kill-during-pause", "kill-during-transfer", "kill-during-resume",
                "kill-two-below-quorum", "freeze-during-transfer", "hang-past-deadline", "false-ack-on-resume",
                "restart-readmission", "engine-core-crash", "restart-budget-exhausted"}
    assert required <= names
    for v in MATRIX:
        load_plan(v.plan)
    with pytest.raises(ValueError, match="unknown matrix variant"):
        by_name(["nope"])
