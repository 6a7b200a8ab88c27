"""scripts/bench_readmit.py's arithmetic on a fake event log and fake token samples (no Ray): which records
each figure is read from, the refit that would have brought the engine back, the donor's windows."""

from __future__ import annotations


import pytest

from rlfleet.fleet.records import Fault, Phase, Readmit, Restart
from tests.scripts import load


def bench():
    return load("bench_readmit")


def at(t: float, rec) -> dict:
    return {**rec.as_dict(), "t": t}


def refit(version: int, reconcile_t: float, commit_t: float | None) -> list[dict]:
    out = [at(reconcile_t, Phase(phase="reconcile", edge="begin", version=version))]
    if commit_t is not None:
        out.append(at(commit_t, Phase(phase="commit", edge="end", version=version, seconds=0.01)))
    return out


def timeline(readmit_outcome: str = "readmitted") -> list[dict]:
    """Slot 0 incarnation 1 killed at 10; restart 12 -> 30; re-admitted from slot 1 over 30.2 -> 30.3; refit 3
    reconciled at 20 (the engine not ready: it could not have joined), refit 4 at 40, committed at 41."""
    return sorted([
        at(10.0, Fault(point="step_boundary", action="kill", slot=0, incarnation=1, armed=True)),
        at(12.0, Restart(slot=0, incarnation=2, edge="begin", attempt=1)),
        at(30.0, Restart(slot=0, incarnation=2, edge="end", outcome="ok")),
        at(30.2, Readmit(slot=0, incarnation=2, version=3, edge="begin", donor="slot 1")),
        at(30.3, Readmit(slot=0, incarnation=2, version=3, edge="end", donor="slot 1", outcome=readmit_outcome,
                         seconds=0.1, bytes=100, digests=15)),
        *refit(3, 20.0, 21.0), *refit(4, 40.0, 41.0), *refit(5, 70.0, None),
    ], key=lambda e: e["t"])


# the donor (slot 1, incarnation 1): 400 tokens/s until 30.2, 200 tokens/s during the copy, 400 after
DONOR = [(9.0, 0), (10.0, 400), (30.2, 8480), (30.3, 8500), (31.0, 8780)]


def test_tokens_between_sampled_steps_are_interpolated_and_none_outside():
    b = bench()
    assert b.count_at(DONOR, 9.5) == pytest.approx(200)
    assert b.count_at(DONOR, 30.3) == 8500
    assert b.count_at(DONOR, 8.0) is None and b.count_at(DONOR, 32.0) is None
    assert b.rate(DONOR, 30.2, 30.3) == pytest.approx(200)
    assert b.rate(DONOR, 9.0, 9.5) == pytest.approx(400)
    assert b.rate(DONOR, 30.0, 31.5) is None, "a window the samples do not cover has no rate"


def test_a_round_reads_the_kill_the_ready_the_readmission_and_the_refit_that_would_have_brought_it_back():
    b = bench()
    row = b.round_figures(timeline(), slot=0, incarnation=1, samples={(1, 1): DONOR})
    assert row["restart_s"] == 20.0 and row["launch_s"] == 18.0
    assert row["readmit_s"] == pytest.approx(20.3) and row["readmit_minus_restart_s"] == pytest.approx(0.3)
    # refit 3 reconciled before the engine was ready: without re-admission refit 4 (committed at 41) brings it back
    assert row["next_refit_version"] == 4 and row["kill_to_next_refit_s"] == 31.0
    assert row["readmit_vs_next_refit"] == pytest.approx(20.3 / 31.0, abs=1e-3)
    assert row["after_ready_readmit_vs_next_refit"] == pytest.approx(0.3 / 11.0, abs=1e-4)
    assert row["donor"] == "slot 1" and row["version"] == 3 and row["window_s"] == pytest.approx(0.1)
    assert row["donor_tokens_during"] == pytest.approx(20)  # 200 tokens/s over the 0.1 s copy
    assert row["donor_tokens_before"] == pytest.approx(40)  # 400 tokens/s over the 0.1 s before it
    assert row["donor_tokens_before_kill"] == pytest.approx(40)


def test_a_round_not_readmitted_says_so_and_keeps_its_restart():
    b = bench()
    row = b.round_figures(timeline("yielded"), slot=0, incarnation=1, samples={(1, 1): DONOR})
    assert "not re-admitted" in row["error"] and row["readmit_outcomes"] == ["yielded"]
    assert row["restart_s"] == 20.0 and "readmit_s" not in row
    missing = b.round_figures(timeline(), slot=2, incarnation=1, samples={})
    assert "no kill record for slot 2" in missing["error"]


def test_the_summary_means_over_readmitted_rounds_and_pools_the_donor_tokens():
    b = bench()
    good = b.round_figures(timeline(), slot=0, incarnation=1, samples={(1, 1): DONOR})
    other = {**good, "readmit_s": 22.3, "readmit_vs_next_refit": 0.5, "donor_tokens_during": 60,
             "donor_tokens_before": 40}
    failed = b.round_figures(timeline("failed"), slot=0, incarnation=1, samples={(1, 1): DONOR})
    s = b.summarize([good, other, failed])
    assert s["readmit_s"] == pytest.approx(21.3) and s["readmitted_rounds"] == 2
    assert s["restart_s"] == 20.0, "a round not re-admitted still measured its restart"
    assert s["readmit_vs_next_refit"] == pytest.approx((20.3 / 31 + 0.5) / 2, abs=1e-3)
    assert s["donor_tokens_per_s_during_copy_vs_before"] == pytest.approx(80 / 80)  # pooled, not 0.5 and 1.5 averaged
    assert s["donor_ratio_rounds"] == [0.5, 1.5, None]
    assert s["readmit_s_rounds"] == [pytest.approx(20.3), 22.3, None]
