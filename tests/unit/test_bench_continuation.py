"""scripts/bench_continuation.py's pure parts: each arm's batch, the fleet config, and a round's figures
(wasted tokens split between the arms, latency, lost) from results and counters, and the summary's ratios
(no Ray)."""

from __future__ import annotations

import argparse

from rlfleet.fleet.data.dispatch import COMPLETED, FleetResult
from rlfleet.fleet.types import Completion, GenerationResult
from tests.scripts import load


def bench():
    return load("bench_continuation")


ARGS = argparse.Namespace(requests=4, max_tokens=10, prompt_tokens=3, kill_at=0.5, seed=7, model=None)


def _result(i: int, tokens: int, latency: float, attempts: int = 1, continued: int = 0, reused: int = 0,
            discarded: int = 0) -> FleetResult:
    gen = GenerationResult(request_id=f"r{i}", prompt_token_ids=(1, 2, 3),
                           completions=(Completion(tuple(range(tokens)), (0.0,) * tokens, "length"),),
                           version_start=0, weight_version=0, slot=1, incarnation=1)
    return FleetResult(f"r{i}", COMPLETED, gen, attempts=attempts, latency_s=latency, continued=continued,
                       tokens_reused=reused, tokens_discarded=discarded)


def test_each_arm_has_its_own_prompts_with_the_same_seeds_and_lengths():
    b = bench()
    cont, resend = b.batch(ARGS, 0), b.batch(ARGS, 1)
    assert cont == b.batch(ARGS, 0) and cont != b.batch(ARGS, 0, round_=1), "deterministic per (seed, round, arm)"
    assert [p for p, _ in cont] != [p for p, _ in resend], "a continued prompt must not meet the other arm's tokens"
    assert [s for _, s in cont] == [s for _, s in resend] and len({s["seed"] for _, s in cont}) == 4
    assert all(s["ignore_eos"] and s["max_tokens"] == 10 and len(p) == 3 for p, s in cont + resend)
    cfg = b.fleet_config("m", ARGS)
    assert cfg["continuation"] is True and cfg["engine"]["max_model_len"] == 13
    assert cfg["num_engines"] == 2 and cfg["restart_dead_engines"] is False and cfg["admission"] == {"enabled": False}


def _round(b):
    """Killed engine's counter 14 (read before the kill); continuation received 6 + 6 from it and reused them,
    resend received 5 + 3 and threw them away; the survivor made 2 x 10 (own) x 2 arms + 2 x 4 (continued)
    + 2 x 10 (re-sent) = 68. Delivered 80; wasted 14 + 68 - 80 = 2 unreceived + 8 discarded."""
    results = {
        "continuation": [_result(0, 10, 1.0), _result(1, 10, 1.2), _result(2, 10, 2.0, attempts=2, continued=1, reused=6),
                         _result(3, 10, 2.2, attempts=2, continued=1, reused=6)],
        "resend": [_result(4, 10, 1.0), _result(5, 10, 1.4), _result(6, 10, 3.0, attempts=2, discarded=5),
                   _result(7, 10, 3.4, attempts=2, discarded=3)],
    }
    counters = {"continuation": {"accepted": 4, "completed": 4, "returned": 0, "tokens_reused": 12, "tokens_discarded": 0},
                "resend": {"accepted": 5, "completed": 4, "returned": 0, "tokens_reused": 0, "tokens_discarded": 8}}
    return b.figures(0, results, counters, ARGS, target=0, incarnation=1, on_target=4, killed_counter=22,
                     survivor={1: 68}, proof={}, t_kill=0.5)


def test_a_rounds_wasted_tokens_add_up_to_what_the_engines_counted():
    b = bench()
    row = _round(b)
    assert (row["generated"], row["generated_killed"], row["delivered"], row["wasted_check"]) == (90, 22, 80, 10)
    cont, resend = row["continuation"], row["resend"]
    assert (cont["received"], resend["received"]) == (12, 8)
    # the 2 tokens nobody received are shared by interrupted requests (2 each arm); the discarded are resend's own
    assert (cont["wasted"], resend["wasted"]) == (1.0, 9.0) and cont["wasted"] + resend["wasted"] == row["wasted_check"]
    assert row["kill_progress"] == 0.55 and (cont["interrupted"], resend["interrupted"]) == (2, 2)
    assert (cont["p50_s"], cont["batch_p50_s"], cont["after_kill_p50_s"]) == (2.1, 1.6, 1.6)
    assert (resend["p50_s"], resend["batch_p50_s"]) == (3.2, 2.2)
    assert (cont["lost"], resend["lost"]) == (0, 1), "a request accepted and never ended shows as lost"
    assert cont["continued"] == 2 and resend["continued"] == 0


def test_the_killed_engine_counts_at_least_what_the_clients_received_from_it():
    """The counter is read just before the kill and the engine generates on until it dies: what the clients
    received from it is a floor of what it generated, and nothing is then counted as unreceived."""
    b = bench()
    results = {"continuation": [_result(0, 10, 2.0, attempts=2, continued=1, reused=7)],
               "resend": [_result(1, 10, 3.0, attempts=2, discarded=6)]}
    counters = {arm: {"accepted": 1, "completed": 1, "returned": 0} for arm in results}
    row = b.figures(0, results, counters, ARGS, target=0, incarnation=1, on_target=2, killed_counter=9,
                    survivor={1: 13}, proof={}, t_kill=0.5)
    assert row["generated_killed"] == 13 and row["generated_killed_counter"] == 9
    assert (row["continuation"]["wasted"], row["resend"]["wasted"]) == (0.0, 6.0) == (0.0, row["wasted_check"])


def test_the_summary_compares_the_arms_within_each_round():
    b = bench()
    row = _round(b)
    slower = {**row, "continuation": {**row["continuation"], "p50_s": 4.2}, "resend": {**row["resend"], "p50_s": 6.0}}
    s = b.summary([row, slower, slower])
    assert s["completion_p50_continuation_vs_resend"] == 0.7  # per round 0.656, 0.7, 0.7: the median
    assert s["wasted_tokens_continuation_vs_resend"] == 0.111 and (s["wasted_continuation"], s["wasted_resend"]) == (3.0, 27.0)
    assert (s["lost_continuation"], s["lost_resend"]) == (0, 3)
    assert s["continuation"]["p50_s"] == 4.2 and s["resend"]["interrupted"] == 6
    assert b.ratio(2, 7) == 0.286 and b.ratio(1, 0) is None and b.ratio(None, 3) is None
