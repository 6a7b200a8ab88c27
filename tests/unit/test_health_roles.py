"""Roles of warm spares (``health.roles``): who serves, who waits, who is promoted when a serving slot fails."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.health.roles import Demotion, Promotion, Roles, rebalance
from rlfleet.health.states import ShardState as S

H, ST, D, R, RS, SU, HU, RT = (S.HEALTHY, S.STALE, S.DEAD, S.RESTARTING, S.STARTING, S.SUSPECT, S.HUNG, S.RETIRED)


def states(*seq):
    return dict(enumerate(seq))


def test_a_new_fleet_serves_on_its_first_slots_and_the_rest_are_spares():
    roles = Roles.initial(2)
    assert roles.to_list() == [0, 1]
    assert [roles.role(s) for s in range(3)] == ["serving", "serving", "spare"]
    assert roles.spares(range(4)) == (2, 3)


def test_nothing_changes_while_every_serving_slot_is_healthy():
    roles = Roles.initial(2)
    out = rebalance(roles, states(H, H, H), 2)
    assert out.roles is roles and not out.changed


@pytest.mark.parametrize("bad", [D, R, RS, SU, HU, ST])
def test_a_serving_slot_that_is_not_healthy_swaps_roles_with_a_healthy_spare(bad):
    out = rebalance(Roles.initial(2), states(bad, H, H), 2)
    assert out.roles.to_list() == [1, 2]
    assert out.promotions == (Promotion(2, 0, f"slot 0 is {bad.value}"),)
    assert out.demotions == ()


@pytest.mark.parametrize("spare_state", [ST, R, RS, D, SU, HU, RT])
def test_a_spare_that_is_not_healthy_is_never_promoted(spare_state):
    roles = Roles.initial(2)
    out = rebalance(roles, states(D, H, spare_state), 2)
    assert out.roles is roles and not out.changed  # the dead slot keeps its role until a spare is healthy


def test_the_next_spare_that_becomes_healthy_is_promoted():
    roles = Roles.initial(2)
    waiting = rebalance(roles, states(R, H, ST), 2)  # the spare is stale: not promoted
    assert not waiting.changed
    after_refit = rebalance(waiting.roles, states(R, H, H), 2)  # the refit landed on the spare
    assert after_refit.promotions == (Promotion(2, 0, "slot 0 is restarting"),)
    back = rebalance(after_refit.roles, states(H, H, H), 2)  # the replaced slot restarted: it stays a spare
    assert not back.changed and back.roles.to_list() == [1, 2]


def test_lowest_healthy_spares_replace_lowest_failed_slots_first():
    out = rebalance(Roles.initial(3), states(H, D, D, ST, H, H), 3)
    assert out.promotions == (Promotion(4, 1, "slot 1 is dead"), Promotion(5, 2, "slot 2 is dead"))
    assert out.roles.to_list() == [0, 4, 5]


def test_a_retired_serving_slot_leaves_the_role_and_a_healthy_spare_fills_it():
    out = rebalance(Roles.initial(2), states(RT, H, H), 2)
    assert out.demotions == (Demotion(0, "slot 0 is retired"),)
    assert out.promotions == (Promotion(2, None, "1 of 2 serving slots filled"),)
    assert out.roles.to_list() == [1, 2]


def test_a_retired_serving_slot_leaves_the_role_even_without_a_spare():
    out = rebalance(Roles.initial(2), states(RT, H, ST), 2)
    assert out.roles.to_list() == [1] and out.promotions == ()
    later = rebalance(out.roles, states(RT, H, H), 2)  # the spare got the weights: it fills the role
    assert later.promotions == (Promotion(2, None, "1 of 2 serving slots filled"),)


def test_a_grown_ledger_fills_the_new_serving_size_from_healthy_new_slots():
    roles = Roles.initial(2)
    assert rebalance(roles, states(H, H, ST, RS), 3).roles is roles  # the new slots are not healthy yet
    out = rebalance(roles, states(H, H, ST, H), 3)
    assert out.roles.to_list() == [0, 1, 3]


def test_a_shrunk_serving_size_demotes_the_unhealthy_then_the_highest():
    out = rebalance(Roles(frozenset({0, 1, 2, 3})), states(H, D, H, H), 2)
    assert [d.slot for d in out.demotions] == [1, 3]
    assert out.roles.to_list() == [0, 2]


def test_slots_the_ledger_no_longer_has_leave_the_roles():
    out = rebalance(Roles(frozenset({0, 1, 5})), states(H, H, H), 3)
    assert out.roles.to_list() == [0, 1, 2]
    assert out.promotions == (Promotion(2, None, "2 of 3 serving slots filled"),)


def test_roles_restore_from_what_a_predecessor_stored():
    assert Roles.restore([2, 1], 2).to_list() == [1, 2]
    assert Roles.restore(None, 2).to_list() == [0, 1]
    with pytest.raises(ValueError, match="slot numbers >= 0"):
        Roles.restore([-1], 2)
    with pytest.raises(ValueError, match="num_engines"):
        Roles.initial(-1)


_STATES = st.sampled_from(list(S))


@settings(max_examples=400, deadline=None)
@given(
    first=st.lists(_STATES, min_size=1, max_size=9),
    later=st.lists(st.lists(_STATES, min_size=1, max_size=9), max_size=6),
    size=st.integers(0, 6),
    start=st.frozensets(st.integers(0, 9), max_size=6),
)
def test_any_sequence_serves_exactly_min_healthy_size_and_promotes_only_healthy_spares(first, later, size, start):
    roles = Roles(start)
    for seq in [first, *later]:
        sts = states(*seq)
        out = rebalance(roles, sts, size)
        new = out.roles
        healthy = {s for s, x in sts.items() if x is H}
        served = {s for s in new.serving if sts[s] is H}
        assert len(served) == min(len(healthy), size)  # what quorum counts is what serves
        assert new.serving <= set(sts) and len(new.serving) <= size
        assert not any(sts[s] is RT for s in new.serving)
        for p in out.promotions:  # only a healthy spare, never stale weights
            assert sts[p.spare] is H and p.spare not in roles.serving and p.spare in new.serving
            assert p.replaced is None or (p.replaced in roles.serving and p.replaced not in new.serving)
        again = rebalance(new, sts, size)
        assert again.roles is new and not again.changed  # stable: no flapping
        roles = new
