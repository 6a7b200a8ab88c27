"""Seed rows that had no test of their own (issue 47): what a cache reset's answer counts as, and what a vLLM
error from a reset of running requests is (seed 002); the default KV-cache policy across weight updates (seed 000);
a cut of a shard's admission cap cancels nothing in flight (seed 004)."""

from __future__ import annotations

import pytest

from rlfleet.fleet.shard.backend import confirmed


@pytest.mark.parametrize("answer,ok", [
    (True, True), ([True], True), ((True, True), True),
    (None, False), ([], False), ((), False), ([None], False), ([None, None], False), ([True, None], False),
    ([True, False], False), (False, False), (1, False), ([1], False), ("True", False), ({}, False),
])
def test_a_cache_reset_counts_only_true_or_all_true_and_never_none_or_empty(answer, ok):
    """Seed 002: a result made only of ``None``s, or an empty one, is a failure, not a success."""
    assert confirmed(answer) is ok


def test_the_default_kv_policy_is_recompute_and_a_refits_pause_clears_the_cache(model_dir):
    """Seed 000: with no ``kv_policy`` set, every refit pauses its engines with ``clear_cache=True`` (in-flight
    requests re-prefill under the new weights)."""
    from types import SimpleNamespace

    from rlfleet.fleet.config.fleet import load_fleet_config
    from rlfleet.fleet.control.lifecycle.pause import pause_kw

    cfg = load_fleet_config({"engine": {"model": model_dir}, "num_engines": 2})
    assert cfg.kv_policy == "recompute"
    run = SimpleNamespace(p=SimpleNamespace(cfg=cfg))
    assert pause_kw(run) == {"mode": "keep", "clear_cache": True, "clear_if_idle": False}  # type: ignore[arg-type]


# ------------------------------------------------------------------ seed 002: a reset of running requests that vLLM fails
class _VllmThatFailsResets:
    """What the shard reaches of vLLM's ``AsyncLLM``: alive, and its engine core answers a prefix-cache reset with
    ``raises`` (vLLM's ``Exception("Call to reset_prefix_cache method failed: ...")`` of a utility call, or its
    ``EngineDeadError``)."""

    errored = False

    def __init__(self, raises: BaseException) -> None:
        self.raises = raises
        self.resets: list[bool] = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        raise self.raises

    async def is_paused(self) -> bool:
        return False

    async def update_weight_version(self, version: str) -> None:
        pass


@pytest.fixture
def no_start_records(monkeypatch):
    """A shard over a stand-in engine starts nothing: not an engine start the suite counts (``start_records``)."""
    from rlfleet.fleet.shard.start_records import ENV

    monkeypatch.delenv(ENV, raising=False)


def _shard_over(llm, model_dir):
    from rlfleet.fleet.shard.engine_shard import EngineShard
    from rlfleet.fleet.shard.vllm_backend import VllmBackend

    class Backend(VllmBackend):
        async def start(self) -> None:
            self._engine = llm

    return EngineShard({"model": model_dir}, slot=2, incarnation=3, backend_factory=lambda cfg: Backend({}))


VLLM_FAILED = Exception("Call to reset_prefix_cache method failed: Failed to reset KV cache even when all the running "
                        "requests are preempted and moved to the waiting queue.")


@pytest.mark.parametrize("call,args", [("reset_prefix_cache", (True,)), ("invalidate_cache", ())])
def test_a_vllm_error_from_a_reset_of_running_requests_is_an_answer_naming_the_shard_and_it_serves_on(
        call, args, model_dir, no_start_records):
    """Seed 002: the shard resets the cache with ``reset_running_requests=True`` (``invalidate_cache`` too). When
    vLLM fails that call, the engine is alive: the answer is ``CacheResetFailed`` naming the shard and vLLM's words,
    an error outcome that is no death (the shard is not replaced for it), and the shard goes on answering."""
    import asyncio

    from rlfleet.fleet.errors import CacheResetFailed
    from rlfleet.fleet.outcome import ERROR, answer_outcome, is_unusable, observed
    from rlfleet.health import CallKind, FailureClass

    async def go():
        llm = _VllmThatFailsResets(VLLM_FAILED)
        shard = _shard_over(llm, model_dir)
        await shard.start()
        with pytest.raises(CacheResetFailed) as err:
            await getattr(shard, call)(*args)
        assert llm.resets == [True]
        ping = await shard.ping()  # still ready, its engine still answers
        return err.value, ping.state

    error, state = asyncio.run(go())
    assert state == "ready"
    assert f"{call} on shard slot 2 (incarnation 3)" in str(error) and "reset_running_requests=True" in str(error)
    assert "Failed to reset KV cache" in str(error)
    outcome = answer_outcome(error)
    assert outcome.kind == ERROR and not is_unusable(outcome)
    assert observed(2, 3, CallKind.PAUSE, outcome).failure is FailureClass.ERROR


def test_an_engine_that_dies_during_a_cache_reset_is_an_unusable_shard_not_a_reset_answer(model_dir, no_start_records):
    """Seed 002's other side: vLLM's ``EngineDeadError`` from the reset means the engine core is gone: the shard
    answers ``EngineCrashedError`` (unusable: it is replaced), as a request that was running there does. It was the
    bare vLLM error, an answer of a live shard."""
    import asyncio

    from vllm.v1.engine.exceptions import EngineDeadError

    from rlfleet.fleet.errors import EngineCrashedError
    from rlfleet.fleet.outcome import answer_outcome, is_unusable

    async def go():
        shard = _shard_over(_VllmThatFailsResets(EngineDeadError()), model_dir)
        await shard.start()
        with pytest.raises(EngineCrashedError) as err:
            await shard.reset_prefix_cache(True)
        return err.value

    assert is_unusable(answer_outcome(asyncio.run(go())))


@pytest.mark.parametrize("policy,busy,commits", [("recompute", False, False), ("keep", True, True),
                                                 ("keep", False, False), ("salt", False, True)])
def test_a_cache_reset_that_fails_is_treated_by_the_kv_policy_and_never_takes_the_shard_down(model_dir, policy, busy,
                                                                                             commits):
    """Seed 002 in a refit: an engine without native pause must confirm the cache reset its policy asks for. One
    whose reset fails (``CacheResetFailed``) stops a refit that needed the cache cleared (``recompute``; ``keep`` on
    an idle engine) with ``CacheInvalidationUnsupported`` naming it, and a refit that keeps the cache (``salt``;
    ``keep`` with requests in flight) never asks and commits. Either way the shard is not killed, replaced or
    counted failed."""
    import asyncio

    from rlfleet.fleet.errors import CacheInvalidationUnsupported, CacheResetFailed
    from rlfleet.fleet.records import Kill
    from tests.unit.fleet_fakes import client
    from tests.unit.test_controller import make, run

    failed = CacheResetFailed("invalidate_cache on shard slot 1 (incarnation 1): vLLM did not reset the prefix "
                              "cache (reset_running_requests=True): Call to reset_prefix_cache method failed")

    async def go():
        ctl, door, _ = make(model_dir, kv_policy=policy, request_timeout_s=60)
        door.on_spawn[(1, 1)] = {"no_native_pause": True, "invalidate_answer": failed}
        door.gen_delay = 1.0
        await ctl.start()
        held = [asyncio.ensure_future(client(ctl).generate([1])) for _ in range(6)] if busy else []
        await asyncio.sleep(0.1)
        try:
            await ctl.sync_weights(1)
            error = None
        except CacheInvalidationUnsupported as exc:
            error = exc
        results = await asyncio.gather(*held)
        asked = [s for m, s, _ in door.calls if m == "invalidate_cache"]
        shard = door.shards[(1, 1)]
        state = (shard.dead, ctl.ledger.state(1).value, Kill.among(ctl.events()))
        await ctl.shutdown()
        return error, asked, state, results

    error, asked, (dead, health, kills), results = run(go())
    assert not dead and health == "healthy" and kills == [], (dead, health, kills)
    assert all(r.ok for r in results)
    if commits:
        assert error is None and asked == []
    else:
        assert asked == [1]
        assert isinstance(error, CacheInvalidationUnsupported) and "slot(s) [1]" in str(error)
        assert "CacheResetFailed" in str(error) and "Call to reset_prefix_cache method failed" in str(error)


# ------------------------------------------------------------------ seed 004: a cap cut only gates admission
def test_a_cap_cut_with_requests_in_flight_cancels_none_of_them_and_only_gates_new_ones(model_dir):
    """Seed 004: "Only admission is gated; nothing in flight is cancelled." A shard holds 8 requests at its cap of
    8 when its engine reports a spike (preemptions): the law cuts the cap to 5 and the controller publishes it.
    None of the 8 is aborted, re-sent or cut short (each completes on its first attempt, finish reason
    ``length``); the shard keeps holding all 8 above the new cap; requests sent after the cut are refused
    ``full`` until the 8 drain below it, then run."""
    import asyncio
    import random

    from rlfleet.fleet.control.controller import SingleController
    from rlfleet.fleet.data.client import InProcessClient
    from rlfleet.fleet.types import EngineStats
    from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual

    class LoadDoor(FakeDoor):
        """The engine reports ``load`` (EngineStats fields); each record new (``updated_at``: the loop's time)."""

        def __init__(self):
            super().__init__(gen_delay=5.0)
            self.load: dict = {}

        async def _stats(self, s):
            return EngineStats(kv_cache_tokens=8 * 512, max_model_len=512, in_flight=len(s.in_flight),
                               updated_at=asyncio.get_running_loop().time(), **self.load)

    async def go():
        door = LoadDoor()
        cfg = dict(engine={"model": model_dir}, num_engines=1, min_healthy_engines=1, refit_timeout_s=5.0,
                   lifecycle_grace_s=0.1, probe_timeout_s=0.1, suspect_timeout_s=0.3, metrics=False,
                   request_timeout_s=600.0, admission={"ceiling": 16, "poll_interval_s": 3600.0})
        ctl = SingleController(cfg, door=door, transfer=FakeTransfer(door), clock=LoopClock())
        await ctl.start()
        await ctl.poll_admission()
        await asyncio.sleep(0.01)  # published
        assert ctl.publisher.current.cap_map == {0: 8}
        c = client(ctl)
        held = [asyncio.ensure_future(c.generate([1, 2], request_id=f"held-{i}")) for i in range(8)]
        await asyncio.sleep(0.5)
        shard = door.shards[(0, 1)]
        assert len(shard.in_flight) == 8
        door.load = {"kv_cache_usage": 0.95, "preemptions": 3}  # the spike
        await ctl.poll_admission()
        door.load = {"kv_cache_usage": 0.5, "preemptions": 3}  # and it passes
        await asyncio.sleep(0.01)
        assert ctl.admission.cap(0) == 5 and ctl.publisher.current.cap_map == {0: 5}
        assert sorted(shard.in_flight) == [f"held-{i}" for i in range(8)]  # all 8 still run, above the new cap
        assert all(v is not None for v in shard.in_flight.values())  # none aborted
        other = InProcessClient(ctl, rng=random.Random(1))  # another client: its own count says the shard has room
        later = [asyncio.ensure_future(other.generate([3], request_id=f"later-{i}")) for i in range(2)]
        await asyncio.sleep(1.0)
        assert len(shard.in_flight) == 8 and not any(f.done() for f in later)
        assert other.dispatcher.refused["full"] > 0  # the shard turned the new ones away at its new cap
        done = await asyncio.gather(*held)
        after = await asyncio.gather(*later)
        calls = [m for m, _, _ in door.calls]
        await ctl.shutdown()
        return done, after, calls, [c.dispatcher.counters(), other.dispatcher.counters()]

    done, after, calls, counters = run_virtual(go())
    assert all(r.ok and r.attempts == 1 for r in done), [(r.reason, r.attempts) for r in done]
    assert {c.finish_reason for r in done for c in r.result.completions} == {"length"}
    assert all(r.ok for r in after)
    assert "abort" not in calls and "abort_in_flight" not in calls and [n["requeued"] for n in counters] == [0, 0]
