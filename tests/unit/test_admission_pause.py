"""A paused engine's silence is not an absent engine (``fleet.control.admission``, issue 47).

A paused vLLM engine takes no step, so its stat logger records nothing and its record only grows old. With
requests held on it, the admission law used to read that as missing stats and, after ``absent_fallback_s``,
cut the shard to ``fallback_cap`` (a long refit, or the operator's pause TRL sends around each sync). The law
holds while the engines are paused (a refit runs, or the operator's pause holds: the health core's record) and
restarts its absence clock at the resume, so a genuine absence after it still falls back.

Through the real controller in virtual time, with the fake door's shards; each engine's stats record
advances with the clock while it steps (``EngineRecords``), as vLLM's stat logger does.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.config.admission import AdmissionConfig
from rlfleet.fleet.control.admission import AdmissionController
from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.records import Admission
from rlfleet.fleet.types import EngineStats
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, run_virtual
from tests.unit.test_recovery import config

HELD = 12  # requests held on slot 0 across the pause
ADMISSION = {"ceiling": 256, "fallback_cap": 4, "stats_max_age_s": 5.0, "absent_fallback_s": 30.0}
CAP = 64  # the fake engine's KV capacity: 32768 tokens / max length 512


class EngineRecords:
    """vLLM's stat logger as the shard reads it: a shard's record (``updated_at``) advances with the clock at
    every poll while its engine steps: not paused, and not ``silent`` (an engine that takes no step though
    nothing paused it: a genuine absence). Slot 0 holds ``HELD`` requests, the others none."""

    def __init__(self) -> None:
        self.silent: set[int] = set()
        self.last: dict[int, float] = {}

    async def stats(self, s) -> EngineStats:
        now = asyncio.get_running_loop().time()
        if not s.paused and s.slot not in self.silent:
            self.last[s.slot] = now
        held = HELD if s.slot == 0 else 0
        return EngineStats(kv_cache_usage=0.1, kv_cache_tokens=32768, max_model_len=512, running=held,
                           in_flight=held, updated_at=self.last.get(s.slot),
                           extra={"load": {"finished": 0, "peak": held, "trough": held}})


async def fleet(model_dir):
    door, engines = FakeDoor(), EngineRecords()
    door._stats = engines.stats  # type: ignore[method-assign]
    transfer = FakeTransfer(door)
    ctl = SingleController(config(model_dir, refit_timeout_s=60.0, admission=ADMISSION), door=door,
                           transfer=transfer, clock=LoopClock())
    await ctl.start()
    await asyncio.sleep(2.0)  # a few polls of engines that step
    assert ctl.admission.cap(0) == CAP and ctl.admission.state(0).data == "fresh"
    return ctl, transfer, engines


def falls_back_only_after_the_resume(ctl, resumed: float):
    """The engine stays silent after the resume: the cap holds for ``absent_fallback_s`` from the resume (the
    pause's silence does not count), then drops to ``fallback_cap`` (the fallback still works)."""
    async def check():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(resumed + ADMISSION["absent_fallback_s"] - 1.0 - loop.time())
        assert ctl.admission.cap(0) == CAP, "fell back before absent_fallback_s of silence after the resume"
        await asyncio.sleep(2.0)
        assert ctl.admission.cap(0) == ADMISSION["fallback_cap"], "a genuine absence after the resume never fell back"
        assert ctl.admission.metrics()[0]["fallbacks"] == 1
    return check()


def test_a_40_s_refit_with_requests_held_keeps_the_cap_and_an_absence_after_it_still_falls_back(model_dir):
    async def go():
        ctl, transfer, engines = await fleet(model_dir)
        transfer.delay_s = 40.0  # the engines stay paused through a 40 s transfer
        engines.silent.add(0)  # and slot 0 takes no step after the resume either
        out = await ctl.sync_weights(1)
        resumed = asyncio.get_running_loop().time()
        assert out["version"] == 1 and ctl.gate.is_open
        assert ctl.admission.cap(0) == CAP, [r.reason for r in Admission.among(ctl.log.records())]
        assert ctl.admission.metrics()[0]["fallbacks"] == 0
        seen = [r.reason for r in Admission.among(ctl.log.records()) if r.slot == 0]
        assert any("with 12 in flight, engine paused" in r for r in seen), seen  # the law saw the silence
        await falls_back_only_after_the_resume(ctl, resumed)

    run_virtual(go())


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_an_operator_pause_keeps_the_cap_and_an_absence_after_its_resume_still_falls_back(model_dir, mode):
    async def go():
        ctl, _, engines = await fleet(model_dir)
        await ctl.pause(mode, 5.0)
        engines.silent.add(0)  # no record from here on (a keep pause stops its steps; the others as well here)
        await asyncio.sleep(40.0)
        assert ctl.admission.cap(0) == CAP, [r.reason for r in Admission.among(ctl.log.records())]
        out = await ctl.resume()
        resumed = asyncio.get_running_loop().time()
        assert out["resumed"] and out["gate_open"]
        await falls_back_only_after_the_resume(ctl, resumed)

    run_virtual(go())


# ---------------------------------------------------------------- the tracker alone
CFG = AdmissionConfig(ceiling=256, fallback_cap=4, stats_max_age_s=5.0, absent_fallback_s=30.0)


def held(updated_at: float) -> EngineStats:
    return EngineStats(kv_cache_usage=0.1, kv_cache_tokens=32768, max_model_len=512, in_flight=HELD,
                       updated_at=updated_at, extra={"load": {"finished": 0, "peak": HELD, "trough": HELD}})


def test_a_pause_between_two_polls_restarts_the_absence_clock_at_its_resume():
    ac = AdmissionController(CFG)
    ac.observe(0, held(1.0), 0.0)
    ac.observe(0, held(1.0), 10.0)  # stale from here: missing
    assert ac.state(0).missing_since == 10.0
    ac.refit_started()
    ac.refit_finished(25.0)  # a refit paused the engine between two polls
    ac.observe(0, held(1.0), 41.0)  # 31 s missing, but only 16 s since the resume
    assert ac.cap(0) == CAP and ac.state(0).missing_since == 25.0
    ac.observe(0, held(1.0), 55.5)
    assert ac.cap(0) == 4 and ac.state(0).rule == "fallback"


def test_the_operators_pause_is_read_from_its_decider_and_its_resume_restarts_the_clock():
    pause: dict = {"mode": None}
    ac = AdmissionController(CFG, operator_pause=lambda: pause["mode"])
    ac.observe(0, held(1.0), 0.0)
    pause["mode"] = "keep"
    assert ac.paused()
    why = ac.observe(0, held(1.0), 10.0)
    assert why == ("slot 0: hold: stats record 10.0 s old > 5 s with 12 in flight, engine paused (a refit or the "
                   "operator's pause): its silence is not absence")
    ac.observe(0, held(1.0), 100.0)
    assert (ac.cap(0), ac.state(0).rule, ac.state(0).missing_since) == (CAP, "paused", None)
    pause["mode"] = None
    ac.operator_resumed(100.5)
    assert not ac.paused()
    ac.observe(0, held(1.0), 101.0)
    assert ac.state(0).missing_since == 101.0
    ac.observe(0, held(1.0), 130.9)
    assert ac.cap(0) == CAP
    ac.observe(0, held(1.0), 131.0)
    assert ac.cap(0) == 4
