"""Fault plans: validation names the field, resolution is deterministic per seed; where they act, the shard's
fault hooks journal each fault before it acts."""

import asyncio
import os

import pytest

from rlfleet.faults.matrix import BASE_FLEET, MATRIX, by_name
from rlfleet.faults.timeline import read_log
from rlfleet.fleet.shard.fault_hooks import ArmedFault, FaultHooks
from rlfleet.fleet.wire import ServeRequest
from rlfleet.health.faultplan import load_plan, resolve


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
        ({"faults": [{"where": "generate", "what": "unavailable", "shard": 0}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "pause", "what": "corrupt_shape", "shard": 0}]}, r"faults\[0\]\.where.*update"),
        ({"faults": [{"where": "update", "what": "kill"}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "update", "what": "corrupt_colour"}]}, r"faults\[0\]\.what"),
        ({"faults": [{"where": "update", "what": "corrupt_shape", "shard": 1}]}, r"faults\[0\]\.shard.*leave shard out"),
        ({"faults": [{"where": "call", "what": "stale_version", "shard": "random"}]}, r"faults\[0\]\.shard"),
        ({"faults": [{"where": "update", "what": "stale_version"}]}, r"faults\[0\]\.where.*call"),
        ({"faults": [{"where": "call", "what": "concurrent_refit", "step": 0}]}, r"faults\[0\]\.step"),
        ({"faults": [{"where": "between_refits", "what": "hang", "shard": 0}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "pause", "what": "kill_controller", "shard": 1}]},
         r"faults\[0\]\.shard: kill_controller acts on the fleet's controller.*leave shard out"),
        ({"faults": [{"where": "between_refits", "what": "kill_controller", "shard": "random"}]}, r"faults\[0\]\.shard"),
        ({"faults": [{"where": "generate", "what": "kill_controller"}]}, r"faults\[0\]\.where: kill_controller is only"),
        ({"faults": [{"where": "update", "what": "kill_controller"}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "between_refits", "what": "kill_controller", "delay_s": 1.0}]},
         r"faults\[0\]\.delay_s: only a kill_controller at a refit phase"),
        ({"faults": [{"where": "shutdown", "what": "kill_controller", "delay_s": 0.5}]}, r"faults\[0\]\.delay_s"),
        ({"faults": [{"where": "transfer", "what": "kill_controller", "delay_s": 600}]}, r"faults\[0\]\.delay_s.*below 600"),
        ({"faults": [{"where": "stamp", "what": "kill", "shard": 0}]}, r"faults\[0\]\.where: kill is only"),
        ({"faults": [{"where": "shutdown", "what": "slow", "shard": 0}]}, r"faults\[0\]\.where"),
        ({"faults": [{"where": "stream", "what": "kill", "shard": 0, "after_calls": -1}]}, r"faults\[0\]\.after_calls"),
        ({"faults": [{"where": "stream", "what": "kill", "shard": 0, "after_calls": 2.5}]}, r"faults\[0\]\.after_calls"),
        ({"faults": [{"where": "step_boundary", "what": "kill", "shard": 0, "after_calls": 2}]},
         r"faults\[0\]\.after_calls: counts the calls at a shard's hook point"),
        ({"faults": [{"where": "pause", "what": "slow", "shard": 0, "delay_s": 1, "after_calls": 2}]},
         r"faults\[0\]\.after_calls: a slow shard slows every call"),
        ({"faults": [{"where": "transfer", "what": "kill_controller", "after_calls": 1}]}, r"faults\[0\]\.after_calls"),
    ],
)
def test_bad_plans_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        load_plan(plan(**over))


def test_a_count_of_calls_to_let_pass_reaches_the_firing_and_defaults_to_none():
    p = load_plan(plan(faults=[{"where": "stream", "what": "kill", "shard": 1, "step": 2, "after_calls": 40},
                               {"where": "pause", "what": "hang", "shard": 0, "step": 1}]))
    assert [(f.where, f.slot, f.after_calls) for f in resolve(p, 3)] == [("pause", 0, 0), ("stream", 1, 40)]


def test_random_shard_is_seeded_and_repeats_follow_every():
    p = load_plan(plan(seed=5, steps=6, faults=[{"where": "step_boundary", "what": "kill", "shard": "random", "every": 2, "times": 3}]))
    a, b = resolve(p, 4), resolve(p, 4)
    assert a == b and [f.step for f in a] == [1, 3, 5] and len({f.slot for f in a}) == 1
    with pytest.raises(ValueError, match="below the fleet"):
        resolve(load_plan(plan(faults=[{"where": "pause", "what": "kill", "shard": 7}])), 3)


def test_trainer_faults_name_no_shard_and_resolve_to_no_slot():
    p = load_plan(plan(steps=2, faults=[{"where": "call", "what": "concurrent_refit", "step": 2},
                                        {"where": "update", "what": "corrupt_missing_layer", "step": 1, "every": 1, "times": 2},
                                        {"where": "between_refits", "what": "kill", "shard": 2, "step": 2}]))
    got = [(f.step, f.where, f.what, f.slot) for f in resolve(p, 3)]
    assert got == [(1, "update", "corrupt_missing_layer", None), (2, "call", "concurrent_refit", None),
                   (2, "update", "corrupt_missing_layer", None), (2, "between_refits", "kill", 2)]


def test_controller_faults_name_no_shard_and_resolve_to_no_slot():
    p = load_plan(plan(steps=2, faults=[{"where": "transfer", "what": "slow", "shard": 0, "delay_s": 2.0},
                                        {"where": "transfer", "what": "kill_controller", "delay_s": 0.75},
                                        {"where": "between_refits", "what": "kill_controller", "step": 2},
                                        {"where": "shutdown", "what": "kill_controller", "step": 2}]))
    got = [(f.step, f.where, f.what, f.slot, f.delay_s) for f in resolve(p, 3)]
    assert got == [(1, "transfer", "kill_controller", None, 0.75), (1, "transfer", "slow", 0, 2.0),
                   (2, "between_refits", "kill_controller", None, 0.0), (2, "shutdown", "kill_controller", None, 0.0)]
    for phase in ("close", "reconcile", "pause", "commit", "resume", "reopen"):
        load_plan(plan(faults=[{"where": phase, "what": "kill_controller", "delay_s": 0.1}]))
    for gone in ("staleness", "stamp"):  # phases that merged into pause and resume: refused, naming the field
        with pytest.raises(ValueError, match=r"faults\[0\]\.(where|delay_s)"):
            load_plan(plan(faults=[{"where": gone, "what": "kill_controller", "delay_s": 0.1}]))


def test_the_plans_refit_phases_are_the_lifecycles():
    from rlfleet.fleet.control.lifecycle import PHASES
    from rlfleet.health.faultplan import REFIT_PHASES

    assert REFIT_PHASES == PHASES


def test_matrix_covers_every_required_variant_and_all_plans_are_valid():
    names = {v.name for v in MATRIX}
    required = {"kill-step-boundary", "kill-during-pause", "kill-during-transfer", "kill-during-resume",
                "kill-two-below-quorum", "freeze-during-transfer", "hang-past-deadline", "false-ack-on-resume",
                "restart-readmission", "engine-core-crash", "restart-budget-exhausted",
                "unavailable-at-resume", "hang-at-resume", "bad-update-wrong-shape", "bad-update-missing-layer",
                "misuse-stale-version", "two-concurrent-refits", "below-quorum-between-refits", "refit-under-load",
                "controller-kill-between-refits", "controller-kill-during-pause", "controller-kill-during-transfer",
                "controller-kill-during-resume", "controller-kill-during-shutdown", "spare-promotion",
                "hang-at-pause-evicted", "hang-at-resume-evicted", "freeze-between-refits", "resize-under-load",
                "stamp-unavailable", "stamp-error", "relay-commit-under-controller-kill", "sender-killed-mid-transfer",
                "poison-request", "poison-in-batch", "freeze-core-between-refits", "freeze-core-during-transfer",
                "long-refit-keeps-admission-caps", "readmit-donor-dies-mid-copy", "readmit-engine-dies-mid-copy",
                "readmit-yields-to-refit", "controller-kill-during-readmit"}
    assert required <= names and len(MATRIX) == len(names) == 48
    for v in MATRIX:
        load_plan(v.plan)
    controller = [v for v in MATRIX if any(f["what"] == "kill_controller" for f in v.plan["faults"])]
    assert [v.plan["expect"] for v in controller] == ["recovers"] * 6
    kills = sum(f["what"] == "kill_controller" and f["where"] != "shutdown" for v in controller for f in v.plan["faults"])
    assert kills < BASE_FLEET["controller_max_restarts"], "the recovering ones share a fleet: its restarts must last"
    transfer = by_name(["controller-kill-during-transfer"])[0].plan["faults"]
    slow = next(f for f in transfer if f["what"] == "slow")
    crash = next(f for f in transfer if f["what"] == "kill_controller")
    assert 0 < crash["delay_s"] < slow["delay_s"] < BASE_FLEET["probe_timeout_s"], "dies mid-transfer; probes still answer"
    with pytest.raises(ValueError, match="unknown matrix variant"):
        by_name(["nope"])


def test_a_fault_is_in_the_journal_before_it_acts(tmp_path, monkeypatch):
    journal = tmp_path / "fired.jsonl"
    hooks = FaultHooks(lambda: [], slot=2, incarnation=3, journal=str(journal))
    hooks.arm(ArmedFault("pause", "false_ack"))
    hooks.arm(ArmedFault("transfer", "kill"))
    on_disk_at_exit = []

    def exit_now(code):
        on_disk_at_exit.extend(read_log(journal))
        raise RuntimeError(f"exit {code}")

    monkeypatch.setattr(os, "_exit", exit_now)
    assert asyncio.run(hooks.at("ping")) is False and read_log(journal) == [], "nothing armed there: no record"
    assert asyncio.run(hooks.at("pause")) is True, "the lie"
    with pytest.raises(RuntimeError, match="exit 137"):
        asyncio.run(hooks.at("transfer"))
    got = [(r["slot"], r["incarnation"], r["point"], r["action"]) for r in on_disk_at_exit]
    assert got == [(2, 3, "pause", "false_ack"), (2, 3, "transfer", "kill")]
    assert on_disk_at_exit == hooks.fired and not hooks.armed


def test_unavailable_raises_from_its_one_call_after_it_is_journaled(tmp_path):
    from rlfleet.fleet.errors import ShardUnavailableError

    journal = tmp_path / "fired.jsonl"
    hooks = FaultHooks(lambda: [], slot=2, incarnation=1, journal=str(journal))
    hooks.arm(ArmedFault("resume", "unavailable"))
    with pytest.raises(ShardUnavailableError, match=r"slot 2 \(incarnation 1\) unavailable at resume"):
        asyncio.run(hooks.at("resume"))
    assert [(r["point"], r["action"]) for r in read_log(journal)] == [("resume", "unavailable")]
    assert asyncio.run(hooks.at("resume")) is False, "only the one call"


def test_slow_is_journaled_once_and_a_journal_that_cannot_be_written_refuses_the_arming(tmp_path):
    journal = tmp_path / "fired.jsonl"
    hooks = FaultHooks(lambda: [], slot=0, incarnation=1, journal=str(journal))
    hooks.arm(ArmedFault("ping", "slow", delay_s=0.001))
    for point in ("ping", "generate", "pause"):
        assert asyncio.run(hooks.at(point)) is False
    assert [(r["point"], r["action"]) for r in read_log(journal)] == [("ping", "slow")]
    bad = str(tmp_path / "missing" / "fired.jsonl")
    with pytest.raises(OSError, match="missing"):
        FaultHooks(lambda: [], journal=bad).arm(ArmedFault("pause", "kill"))


def test_a_shard_journals_its_faults_under_its_slot_and_incarnation(tmp_path, monkeypatch):
    from rlfleet.fleet.config.engine import EngineConfig
    from rlfleet.fleet.shard.null_backend import NullBackend
    from rlfleet.fleet.shard.engine_shard import EngineShard

    (tmp_path / "config.json").write_text("{}")
    cfg = EngineConfig(model=str(tmp_path), fault_journal=str(tmp_path / "fired.jsonl"))
    for k, v in cfg.process_env().items():
        monkeypatch.setenv(k, v)  # the shard sets its process env; restored after the test
    shard = EngineShard(cfg, slot=1, incarnation=4, backend_factory=NullBackend)

    async def lie_at_pause():
        await shard.start()
        shard.arm_fault("pause", "false_ack")
        return await shard.pause()

    assert asyncio.run(lie_at_pause()) is False
    assert [(r["slot"], r["incarnation"], r["point"], r["action"]) for r in read_log(cfg.fault_journal)] == [
        (1, 4, "pause", "false_ack")]


def test_a_fault_at_stream_goes_off_mid_generation_once_output_went_out(tmp_path):
    """Point ``stream``: a streamed request reaches it before each chunk of output it sends; after one chunk
    (``after_calls`` 1) the fault acts while the client holds part of the output (``unavailable`` here: a
    ``kill`` would end the test process). A ``slow`` shard is not slowed chunk by chunk. Virtual time."""
    from rlfleet.fleet.errors import ShardUnavailableError
    from rlfleet.fleet.shard.engine_shard import EngineShard
    from rlfleet.fleet.shard.null_backend import NullBackend
    from rlfleet.fleet.types import Chunk, Piece
    from tests.unit.fleet_fakes import run_virtual

    class Dripping(NullBackend):  # one token per 0.05 s, each its own output
        async def stream(self, prompt_token_ids, sampling, request_id, cache_salt=None, final_only=False, gather=1):
            n = int(sampling["max_tokens"])
            for i in range(n):
                await asyncio.sleep(0.05)
                yield [Piece(0, (7,), (0.0,), "x", finish_reason="length" if i == n - 1 else None)]

    (tmp_path / "config.json").write_text("{}")
    shard = EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1, backend_factory=Dripping)

    async def served(max_tokens: int, rid: str):
        got, loop = [], asyncio.get_running_loop()
        t0 = loop.time()
        request = ServeRequest([1, 2], {"max_tokens": max_tokens}, rid, None, 0, "any", 0, None, True, 0.1, None, 0)
        assert await shard.submit("client", [request.encode()]) == [True]
        try:  # first token at once, then one answer per 0.1 s, the result at once
            while not got or isinstance(got[-1], Chunk):
                got += [item for _, item in await shard.take_output("client", 1.0)]
        except ShardUnavailableError as exc:
            got.append(exc)
        return got, round(loop.time() - t0, 2)

    async def scenario():
        await shard.start()
        shard.set_route(0, True, 0)
        shard.arm_fault("ping", "slow", 1.0)  # every hooked call slowed by 1 s: the request's start, once
        clean = await served(6, "r1")
        shard.arm_fault("stream", "unavailable", after_calls=1)
        cut = await served(40, "r2")  # still generating after the first answer, slowed 1 s by the slow fault
        return clean, cut, shard.faults_fired()

    (clean, clean_s), (cut, _), fired = run_virtual(scenario())
    assert clean_s == 1.3, "slowed once, at the request's start (1 s), then 6 tokens at 0.05 s: not per chunk"
    names = [type(x).__name__ for x in clean]
    assert names[-1] == "GenerationResult" and set(names[:-1]) == {"Chunk"} and len(names) >= 3, names
    assert [(r["point"], r["action"]) for r in fired if r["action"] != "slow"] == [("stream", "unavailable")]
    assert isinstance(cut[-1], ShardUnavailableError) and [type(x) for x in cut[:-1]] == [Chunk]
    assert sum(len(p.token_ids) for p in cut[0].pieces) == 1, "the client held the first token when it went off"
