"""A refit's two fused control calls on the real ``EngineShard``, in-process over an engine-less backend.

``begin_refit`` with ``pause`` fences, aborts what is too old for the new version and pauses, in one call;
``end_refit`` stamps, aborts what an unstamped engine held, and resumes, in one call. The order inside each
call is the order the controller used to make as separate calls, and a failing stamp is reported, not
raised: the engine still resumes. Virtual time; no engine, no Ray.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.errors import ShardUnavailableError
from rlfleet.fleet.shard.null_backend import NullBackend
from rlfleet.fleet.data.routing_state import Ticket, VersionPolicy
from rlfleet.fleet.wire import BeginRefit, EndRefit
from tests.unit.fleet_fakes import run_virtual
from tests.unit.test_shard_progress import shard_on  # the real shard in-process, on the virtual loop's clock


class RecordingBackend(NullBackend):
    """Requests run until aborted (or 30 s); every pause is recorded with the cache decision it carried."""

    def __init__(self) -> None:
        super().__init__()
        self._generate_s = 30.0
        self.pauses: list[tuple[str, bool]] = []

    async def pause(self, mode, clear_cache):
        self.pauses.append((mode, clear_cache))
        await super().pause(mode, clear_cache)


KEEP = {"mode": "keep", "clear_cache": False, "clear_if_idle": True}


def test_begin_refit_with_its_pause_fences_aborts_the_too_old_and_pauses_clearing_only_when_idle(model_dir):
    async def go():
        b = RecordingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        assert shard.set_route(0, True, 0)  # a member of routing epoch 0: its tickets are admitted
        old = asyncio.ensure_future(shard.generate([1], {}, "old", ticket=Ticket(0, VersionPolicy("latest"))))
        kept = asyncio.ensure_future(shard.generate([2], {}, "kept", ticket=Ticket(0, VersionPolicy("any"))))
        await asyncio.sleep(0.1)
        out = await shard.begin_refit(3, 1, pause=KEEP)
        assert out == BeginRefit(aborted=1, in_flight=1, paused=True)
        assert b.pauses == [("keep", False)], "a shard still holding a request keeps its cache under keep"
        assert (await old).aborted and not kept.done()
        assert shard.gate.paused and shard.gate.refusal(Ticket(2), 0) is not None, "work routed before 3 refused"
        answer = await shard.end_refit(1)
        assert answer == EndRefit(stamp="ok", stamp_error=None, aborted=0, resumed=True, paused_for=None)
        assert shard.get_weight_version() == 1 and not shard.gate.paused
        kept.cancel()

        idle = RecordingBackend()
        shard = shard_on(idle, model_dir)
        await shard.start()
        assert (await shard.begin_refit(1, 1, pause=KEEP)).paused is True
        assert idle.pauses == [("keep", True)], "an idle shard clears under keep (free)"

    run_virtual(go())


def test_a_stamp_that_fails_is_reported_the_held_requests_aborted_and_the_engine_still_resumes(model_dir):
    async def go():
        b = RecordingBackend()
        shard = shard_on(b, model_dir)
        await shard.start()
        held = asyncio.ensure_future(shard.generate([1], {}, "held"))
        await asyncio.sleep(0.1)
        await shard.begin_refit(1, 1, pause={"mode": "keep", "clear_cache": True})
        shard.arm_fault("set_weight_version", "unavailable")
        answer = await shard.end_refit(1)
        assert answer.stamp == "unavailable" and isinstance(answer.stamp_error, ShardUnavailableError)
        assert answer.aborted == 1 and answer.resumed is True
        assert (await held).aborted, "its results would carry the old tag on the new weights"
        assert shard.get_weight_version() == 0 and not shard.gate.paused

    run_virtual(go())


def test_an_engine_without_the_update_has_its_held_requests_aborted_and_a_lying_resume_says_so(model_dir):
    async def go():
        shard = shard_on(RecordingBackend(), model_dir)
        await shard.start()
        held = asyncio.ensure_future(shard.generate([1], {}, "held"))
        await asyncio.sleep(0.1)
        await shard.begin_refit(1, 1, pause={"mode": "keep", "clear_cache": False})
        shard.arm_fault("resume", "false_ack")
        answer = await shard.end_refit(None, abort_held=True)
        assert answer == EndRefit(stamp=None, stamp_error=None, aborted=1, resumed=False, paused_for=None)
        assert (await held).aborted and shard.get_weight_version() == 0

    run_virtual(go())


@pytest.mark.parametrize("action", ["hang", "unavailable"])
def test_a_resume_that_fails_fails_the_whole_call_after_the_stamp(model_dir, action):
    async def go():
        shard = shard_on(RecordingBackend(), model_dir)
        await shard.start()
        await shard.begin_refit(1, 1, pause={"mode": "keep", "clear_cache": False})
        shard.arm_fault("resume", action)
        call = asyncio.ensure_future(shard.end_refit(1))
        done, _ = await asyncio.wait({call}, timeout=60.0)
        if action == "hang":
            assert not done, "a hung resume answers nothing"
            call.cancel()
        else:
            with pytest.raises(ShardUnavailableError):
                call.result()
        assert shard.get_weight_version() == 1  # stamped before the resume failed; the controller counts it unstamped

    run_virtual(go())
