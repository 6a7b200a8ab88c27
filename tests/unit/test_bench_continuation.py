"""scripts/bench_continuation.py's pure parts: the same batch in both arms, the fleet config of each arm,
and the arm's figures (generated, delivered, wasted, latency, lost) from results and counters (no Ray)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

from fleet.data.dispatch import COMPLETED, FleetResult
from fleet.types import Completion, GenerationResult

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_continuation.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_continuation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGS = argparse.Namespace(requests=4, max_tokens=10, prompt_tokens=3, kill_at=0.5, seed=7, model=None)


def _result(i: int, tokens: int, latency: float, attempts: int = 1, continued: int = 0, reused: int = 0,
            discarded: int = 0) -> FleetResult:
    gen = GenerationResult(request_id=f"r{i}", prompt_token_ids=(1, 2, 3),
                           completions=(Completion(tuple(range(tokens)), (0.0,) * tokens, "length"),),
                           version_start=0, weight_version=0, slot=1, incarnation=1)
    return FleetResult(f"r{i}", COMPLETED, gen, attempts=attempts, latency_s=latency, continued=continued,
                       tokens_reused=reused, tokens_discarded=discarded)


def test_both_arms_send_the_same_batch_and_differ_only_in_continuation():
    b = bench()
    assert b.batch(ARGS) == b.batch(ARGS), "same prompts and seeds in every arm"
    prompts = b.batch(ARGS)
    assert len(prompts) == 4 and len({s["seed"] for _, s in prompts}) == 4
    assert all(s["ignore_eos"] and s["max_tokens"] == 10 and len(p) == 3 for p, s in prompts)
    on, off = b.fleet_config("m", True, ARGS), b.fleet_config("m", False, ARGS)
    assert on["continuation"] is True and off["continuation"] is False
    assert {k: v for k, v in on.items() if k != "continuation"} == {k: v for k, v in off.items() if k != "continuation"}
    assert on["engine"]["max_model_len"] == 13 and on["num_engines"] == 2 and on["restart_dead_engines"] is False


def test_figures_of_a_continuation_arm():
    """Two requests continued (12 tokens reused from the killed engine), two never interrupted: the killed
    engine's counter (14, read before the kill) and the survivor's (2 x 10 + 2 x 4) against 40 delivered."""
    b = bench()
    results = [_result(0, 10, 1.0), _result(1, 10, 1.2), _result(2, 10, 2.0, attempts=2, continued=1, reused=6),
               _result(3, 10, 2.2, attempts=2, continued=1, reused=6)]
    counters = {"accepted": 4, "completed": 4, "returned": 0, "tokens_reused": 12, "tokens_discarded": 0}
    row = b.figures("continuation", results, counters, ARGS, target=0, incarnation=1, on_target=2,
                    killed_counter=14, survivor={1: 28}, proof={}, t_kill=0.5)
    assert (row["generated"], row["generated_killed"], row["delivered"], row["wasted"]) == (42, 14, 40, 2)
    assert row["kill_progress"] == 0.7 and row["interrupted"] == 2 and row["continued"] == 2
    assert (row["p50_s"], row["p50_interrupted_s"], row["after_kill_p50_interrupted_s"]) == (1.6, 2.1, 1.6)
    assert (row["kill_after_s"], row["kill_to_last_result_s"]) == (0.5, 1.7)
    assert (row["lost"], row["returned"], row["tokens_reused"]) == (0, 0, 12)


def test_the_killed_engine_counts_at_least_what_the_client_received_from_it():
    """The counter is read just before the kill, and the engine generates on until it dies: what the client
    received from it (reused + discarded) is a floor of what it generated. A re-sent request's tokens all
    count as wasted; a lost request shows in ``lost``."""
    b = bench()
    results = [_result(0, 10, 1.0), _result(1, 10, 3.0, attempts=2, discarded=7)]
    counters = {"accepted": 3, "completed": 2, "returned": 0, "tokens_reused": 0, "tokens_discarded": 7}
    row = b.figures("resend", results, counters, ARGS, target=0, incarnation=1, on_target=1,
                    killed_counter=5, survivor={1: 20}, proof={}, t_kill=0.5)
    assert row["generated_killed"] == 7 and row["generated_killed_counter"] == 5
    assert (row["generated"], row["delivered"], row["wasted"]) == (27, 20, 7)
    assert row["lost"] == 1 and row["started_over"] == []
    summary = b.arm_summary([row, {**row, "wasted": 9, "p50_s": 4.0, "lost": 0}])
    assert (summary["wasted"], summary["p50_s"], summary["lost"]) == (8, 3.0, 1) and len(summary["per_round"]) == 2
    assert b.ratio(2, 7) == 0.286 and b.ratio(1, 0) is None and b.ratio(None, 3) is None
