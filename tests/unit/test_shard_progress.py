"""The shard's side of liveness-as-progress (issue 29, hole 0), in-process with a scripted backend.

A live actor over a stopped engine core: its ping must not say "alive". The ping makes one call the
core must answer (``is_paused``) within ``core_check_timeout_s``, and carries progress facts fed by
the backend's per-step listener. Virtual time; no engine.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.errors import DeadlineExceeded, EngineCrashedError
from rlfleet.fleet.shard.null_backend import NullBackend
from rlfleet.fleet.outcome import OK, TIMED_OUT, Outcome, with_progress
from rlfleet.fleet.shard.engine_shard import EngineShard
from tests.unit.fleet_fakes import run_virtual


class SteppingBackend(NullBackend):
    """A backend whose engine core can be frozen: while frozen nothing it is asked returns, and no step."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.step_listener = None
        self._running: asyncio.Event | None = None

    @property
    def thawed(self) -> bool:
        return self._gate().is_set()

    @thawed.setter
    def thawed(self, running: bool) -> None:
        self._gate().set() if running else self._gate().clear()

    def _gate(self) -> asyncio.Event:
        if self._running is None:
            self._running = asyncio.Event()
            self._running.set()
        return self._running

    async def _core(self):
        await self._gate().wait()  # a stopped process answers nothing until it is continued

    async def is_paused(self) -> bool:
        await self._core()
        return await super().is_paused()

    async def generate(self, prompt_token_ids, sampling, request_id, cache_salt=None):
        while True:  # one token per 0.1 s until 5 tokens, unless frozen
            await self._core()
            await asyncio.sleep(0.1)
            await self._core()
            self.step_listener(1)
            self.made = getattr(self, "made", 0) + 1
            if self.made >= 5:
                return await super().generate(prompt_token_ids, sampling, request_id, cache_salt)

    async def worker_rpc(self, method, args, kwargs, timeout):
        await self._core()
        return [{"ok": True}]


def shard_on(backend, model_dir, **engine):
    shard = EngineShard({"model": model_dir, "backend": "null", "core_check_timeout_s": 0.5, **engine}, 1, 3,
                        backend_factory=lambda cfg: backend)
    shard._now = lambda: asyncio.get_running_loop().time()  # the virtual loop's clock
    shard._progress = shard._watch_progress()
    return shard


def test_a_frozen_idle_core_fails_the_ping_naming_the_core_check(model_dir):
    async def go():
        b = SteppingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        assert (await shard.ping()).progress["stalled_s"] == 0.0
        b.thawed = False
        with pytest.raises(DeadlineExceeded, match=r"core check \(is_paused\) on shard slot 1 \(incarnation 3\) did "
                                                   r"not finish within 0.5 s"):
            await shard.ping()

    run_virtual(go())


def test_a_core_that_froze_with_a_request_in_flight_shows_a_stall_that_the_controller_reads_as_a_hang(model_dir):
    async def go():
        b = SteppingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        req = asyncio.ensure_future(shard.generate([1, 2, 3], {}, "r1"))
        await asyncio.sleep(0.25)  # two tokens made
        info = shard.ping_info()
        assert info.progress["in_flight"] == 1 and info.progress["stalled_s"] < 0.2
        b.thawed = False
        await asyncio.sleep(12.0)
        facts = shard.ping_info().progress
        assert facts["in_flight"] == 1 and facts["stalled_s"] == pytest.approx(12.0, abs=0.15)
        out = with_progress(Outcome(OK, value=shard.ping_info()), stall_timeout_s=10.0)
        assert out.kind == TIMED_OUT and "no progress" in str(out.error) and "1 request(s) in flight" in str(out.error)
        assert with_progress(Outcome(OK, value=shard.ping_info()), stall_timeout_s=20.0).ok
        b.thawed = True
        req.cancel()

    run_virtual(go())


def test_a_paused_engine_or_one_running_a_worker_call_is_not_stalled_and_the_ping_skips_the_busy_core(model_dir):
    async def go():
        b = SteppingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        req = asyncio.ensure_future(shard.generate([1], {}, "r1"))
        await asyncio.sleep(0.15)
        assert await shard.pause("keep", clear_cache=False)
        b.thawed = False  # paused: no step expected
        await asyncio.sleep(60.0)
        assert shard.ping_info().progress == {"in_flight": 1, "stalled_s": 0.0, "last_token_age_s": pytest.approx(
            60.05, abs=0.1), "held": "paused"}
        rpc = asyncio.ensure_future(shard.worker_rpc("rlfleet_receive", timeout=100.0))  # the core is in it
        await asyncio.sleep(1.0)
        answer = await shard.ping()  # answered: the busy core was not asked, and the answer says so
        assert answer.progress["held"] == "paused" and answer.core_checked is False
        b.thawed = True
        await rpc
        assert await shard.resume()
        await asyncio.sleep(0.05)
        assert shard.ping_info().progress["stalled_s"] < 0.1  # the clock restarts at the resume
        await req

    run_virtual(go())



def test_a_busy_engine_is_judged_by_its_steps_not_by_a_call_its_core_may_answer_late(model_dir):
    """A busy core answers a call only between steps; on a crowded host a step took over 2 s and a healthy
    engine was condemned by its core check. With work in flight the steps are the witness instead."""
    async def go():
        b = SteppingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        req = asyncio.ensure_future(shard.generate([1], {}, "r1"))
        await asyncio.sleep(0.15)
        b.thawed = False  # its core is stopped (or in a long step): no call is made, the answer says so
        answer = await shard.ping()
        assert answer.core_checked is True and answer.progress["stalled_s"] < 0.2
        await asyncio.sleep(11.0)
        answer = await shard.ping()
        assert with_progress(Outcome(OK, value=answer), stall_timeout_s=10.0).kind == TIMED_OUT
        b.thawed = True
        await req

    run_virtual(go())


class CrashingBackend(NullBackend):
    """An engine core that dies under a running request: the process is seen dead at once (``check_alive``),
    while the request learns it later, as vLLM propagates the death to its output queues."""

    def __init__(self, lag_s: float) -> None:
        super().__init__()
        self.lag_s = lag_s
        self.dead = asyncio.Event()

    def check_alive(self) -> None:
        if self.dead.is_set():
            raise EngineCrashedError("engine core died: EngineDeadError()")

    async def generate(self, prompt_token_ids, sampling, request_id, cache_salt=None):
        await self.dead.wait()
        await asyncio.sleep(self.lag_s)
        raise EngineCrashedError("engine core died: EngineDeadError()")


def test_a_probe_that_finds_the_core_dead_answers_only_after_the_requests_it_ran_named_themselves(model_dir):
    """The controller kills the actor on the probe's answer. Answered first, the requests' own answers never
    left the actor, and the client could not count the death against the request that caused it (the matrix's
    ``poison-request`` saw a poison prompt take down a third engine). The probe waits for them, a bounded time."""
    from rlfleet.fleet.shard.engine_shard import CRASH_REPORT_GRACE_S

    async def go(lag_s):
        b = CrashingBackend(lag_s)
        shard = shard_on(b, model_dir)
        await shard.start()
        ended = []

        async def request(rid):
            try:
                await shard.generate([1, 2], {}, rid)
            except EngineCrashedError as exc:
                ended.append((rid, exc.request_id))

        reqs = [asyncio.ensure_future(request(r)) for r in ("r1", "r2")]
        await asyncio.sleep(0.1)
        b.dead.set()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineCrashedError, match="engine core died"):
            await shard.ping()
        waited = asyncio.get_running_loop().time() - t0
        answered_first = list(ended)  # what had answered when the probe did
        await asyncio.gather(*reqs)
        return answered_first, waited

    ended, waited = run_virtual(go(0.3))
    assert ended == [("r1", "r1"), ("r2", "r2")]  # each named itself, before the probe answered
    assert 0.3 <= waited < 0.5
    ended, waited = run_virtual(go(30.0))  # requests that never learn it: the probe answers after the grace
    assert ended == [] and waited == pytest.approx(CRASH_REPORT_GRACE_S + 0.05, abs=0.01)


class ResumingBackend(SteppingBackend):
    """An engine core that steps as soon as it is told to resume: its step records can reach the shard before
    the resume call returns there (the loaded machine of CI, where vLLM's output handler ran first)."""

    async def resume(self) -> None:
        await super().resume()
        for _ in range(5):
            self.step_listener(3)
            await asyncio.sleep(0.01)


def test_only_steps_an_engine_makes_while_paused_and_unresumed_count_as_sampled_while_paused(model_dir):
    async def go():
        b = ResumingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        await shard.pause("keep", False)
        await asyncio.sleep(1.0)  # past the settling of the step that ran as the pause came
        await shard.resume()
        after_own_resume = shard.counters().sampled_while_paused
        await shard.pause("keep", False)
        await asyncio.sleep(1.0)
        b.step_listener(4)  # a step behind the pause's back: nothing here resumed the engine
        return after_own_resume, shard.counters().sampled_while_paused

    own, behind = run_virtual(go())
    assert own == 0, f"steps after the shard's own resume were counted as sampled while paused: {own}"
    assert behind == 4
