"""The refit's stamp, pause, resume and refusal paths off the happy path (issue 29: hole 1 and the
small items of hole 10), driven through the real controller and lifecycle with fakes in virtual time.

The witness is always the shard's own state (the fake shard's ``version`` tag, ``paused`` flag, gate),
never the ledger alone: the ledger is what is being checked."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.fleet.shard.null_backend import NullBackend
from rlfleet.fleet.shard.engine_shard import EngineShard
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run
from rlfleet.fleet.records import LeaveNotice, Stamp


async def _serve_while_checking(ctl, door, n: int = 30) -> list:
    """``n`` requests, one at a time; every result served while the gate is open carries the gate's version
    and the shard's own tag agrees (the gate is never open on a version a serving shard lacks)."""
    results = []
    for _ in range(n):
        res = await client(ctl).generate([1, 2])
        assert res.ok, res
        if ctl.gate.is_open:
            assert res.result.weight_version == ctl.gate.version, (
                f"slot {res.result.slot} served version {res.result.weight_version} with the gate open on "
                f"{ctl.gate.version}")
        results.append(res.result)
        await asyncio.sleep(0.05)
    for slot in ctl.ledger.serving_slots():
        inc = ctl.handles[slot][0]
        assert door.shards[(slot, inc)].version == ctl.gate.version, f"serving slot {slot} is tagged otherwise"
    return results


@pytest.mark.parametrize("failure", ["unavailable"])  # an error or a lie at the stamp stops the refit (health)
def test_a_stamp_that_fails_leaves_the_version_unknown_until_a_refit_lands_again(model_dir, failure):
    """The stamp fails on the engine (``end_refit`` reports it and still resumes); a stamp that hangs hangs the
    refit's last call to that engine: a hung resume (``test_controller``'s hang at resume)."""
    async def go():
        ctl, door, _ = make(model_dir, unhealthy_threshold=3, readmit=False)
        await ctl.start()
        door.shards[(1, 1)].script["set_weight_version"] = failure  # once: its probes answer
        await ctl.sync_weights(1)
        assert ctl.gate.is_open and ctl.gate.version == 1
        assert door.shards[(1, 1)].version == 0  # the witness: its own tag is still the old version
        assert ctl.ledger.raw(1).weight_version is None  # unknown, not the new version
        for _ in range(60):  # probes find it alive again (virtual time)
            await asyncio.sleep(0.2)
            if ctl.ledger.state(1).value not in ("suspect", "hung"):
                break
        assert ctl.ledger.state(1).value == "stale" and 1 not in ctl.ledger.serving_slots()
        served = await _serve_while_checking(ctl, door)
        assert {r.slot for r in served} <= {0, 2}
        await ctl.sync_weights(2)  # the next refit re-transfers and re-stamps it: it serves again
        assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2] and door.shards[(1, 1)].version == 2
        served = await _serve_while_checking(ctl, door)
        assert 1 in {r.slot for r in served}
        stamp = Stamp.among(ctl.events())
        assert [m[0] for m in stamp[-2].members] == [0, 2] and stamp[-2].failed[0][0] == 1
        await ctl.shutdown()

    run(go())


@pytest.mark.parametrize("failure", ["error", "lie"])
def test_a_stamp_that_raises_or_lies_leaves_that_engine_stale_and_the_fleet_serving_on_quorum(model_dir, failure):
    """Issue 47: a stamp that raised or lied after the commit stopped the whole fleet (the health core's
    bad-answer rule aborted a refit already committed on every engine, quorum intact). Now that engine alone
    is stale until a refit stamps it, the gate reopens on the others, and a second failed stamp in a row
    evicts it (a fresh incarnation takes the next stamp)."""
    async def go():
        ctl, door, _ = make(model_dir, readmit=False)
        await ctl.start()
        door.shards[(1, 1)].script["set_weight_version"] = failure
        summary = await ctl.sync_weights(1)
        assert ctl.stopped is None and summary["gate_open"], summary
        assert ctl.gate.is_open and ctl.gate.version == 1
        assert door.shards[(1, 1)].version == 0  # the witness: the engine kept its old tag
        assert ctl.ledger.state(1).value == "stale" and sorted(ctl.ledger.serving_slots()) == [0, 2]
        served = await _serve_while_checking(ctl, door)
        assert {r.slot for r in served} <= {0, 2}
        stamp = Stamp.among(ctl.events())
        assert [m[0] for m in stamp[-1].members] == [0, 2] and stamp[-1].failed[0][0] == 1

        await ctl.sync_weights(2)  # a refit that stamps it: it serves again, its count cleared
        assert sorted(ctl.ledger.serving_slots()) == [0, 1, 2] and door.shards[(1, 1)].version == 2
        assert ctl.ledger.raw(1).stamp_failures == 0

        door.shards[(1, 1)].script["set_weight_version"] = failure
        await ctl.sync_weights(3)  # one failure again: stale, not evicted (the count started over)
        assert ctl.ledger.state(1).value == "stale" and ctl.handles[1][0] == 1
        door.shards[(1, 1)].script["set_weight_version"] = failure
        await ctl.sync_weights(4)  # the second in a row: evicted, the slot restarts
        assert ctl.gate.is_open and ctl.gate.version == 4 and ctl.stopped is None
        assert ctl.ledger.raw(1).incarnation == 2 and door.shards[(1, 1)].dead
        await ctl.shutdown()

    run(go())


def test_every_refusal_names_the_version_the_fleet_serves(model_dir):
    """Issue 29 hole 10: a refusal ended "the fleet serves version ;" (nothing committed to name). Each
    refusal names a version, or says there is none yet; never "None"."""
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(3)
        messages = []
        for bad in (3, "4"):
            with pytest.raises(Exception) as err:
                await ctl.sync_weights(bad)
            messages.append(str(err.value))
        transfer.fail[len(transfer.attempts) + 1] = {s: "refuse" for s in range(3)}
        with pytest.raises(Exception) as err:
            await ctl.sync_weights(4)
        messages.append(str(err.value))
        assert all(m.endswith("serves version 3") or m.endswith("serving version 3") for m in messages), messages
        await ctl.shutdown()
        fresh, _, _ = make(model_dir)  # a controller that has not committed a version yet (not started)
        with pytest.raises(Exception) as err:
            await fresh.sync_weights("5")
        assert "None" not in str(err.value) and str(err.value).endswith("the fleet serves no committed version yet")

    run(go())


@pytest.mark.parametrize("ending", ["commit", "roll_back"])
def test_a_pause_whose_reply_was_lost_is_resumed_and_its_held_request_finishes(model_dir, ending):
    """Issue 29 hole 10: the engine paused but its ack never came back (unavailable). Resume, and the roll
    back, cover every engine a pause was sent to that is still the same incarnation, not only the acked."""
    async def go():
        ctl, door, transfer = make(model_dir, unhealthy_threshold=3)
        await ctl.start()
        door.gen_delay = 0.05
        lost = door.shards[(2, 1)]
        held = [asyncio.ensure_future(client(ctl).generate([1])) for _ in range(9)]
        await asyncio.sleep(0.01)
        lost.script["pause"] = "lost"
        lost.script["ping"] = "unavailable"  # its first probe fails too: it stays out of this refit
        if ending == "roll_back":
            transfer.fail[1] = {s: "refuse" for s in range(3)}
            with pytest.raises(Exception, match="refused"):
                await ctl.sync_weights(1)
        else:
            await ctl.sync_weights(1)
        assert ("pause", 2, 1) in door.calls and not lost.paused, "the engine that paused without an ack stays paused"
        done, pending = await asyncio.wait(held, timeout=5.0)
        assert not pending, f"{len(pending)} request(s) held on a paused engine forever"
        assert all(r.result().ok for r in done)
        await ctl.shutdown()

    run(go())


class PauseRecorder(NullBackend):
    """A backend that records each pause's ``clear_cache`` and holds requests until released."""

    def __init__(self) -> None:
        super().__init__(None)
        self.pauses: list[bool] = []
        self.release = asyncio.Event()

    async def generate(self, prompt_token_ids, sampling, request_id, cache_salt=None):
        await self.release.wait()
        return await super().generate(prompt_token_ids, sampling, request_id, cache_salt)

    async def pause(self, mode, clear_cache):
        self.pauses.append(clear_cache)
        await super().pause(mode, clear_cache)


def test_under_keep_a_shard_idle_at_pause_invalidates_its_prefix_cache_even_if_busy_at_refit_start(tmp_path):
    """Issue 29 hole 10: the keep decision was taken at refit start (``begin_refit``'s in_flight); a shard
    busy then but idle at its pause kept its prefix cache. The shard decides from what it holds at pause."""
    async def go():
        (tmp_path / "config.json").write_text("{}")
        backend = PauseRecorder()
        shard = EngineShard({"model": str(tmp_path), "backend": "null"}, 0, 1, backend_factory=lambda cfg: backend)
        await shard.start()
        request = asyncio.ensure_future(shard.generate([1, 2], {}, "r1"))
        await asyncio.sleep(0.01)
        assert (await shard.begin_refit(1, 1)).in_flight == 1  # busy at refit start
        assert await shard.pause(mode="keep", clear_cache=False, clear_if_idle=True, owner="refit") is True
        assert (await shard.end_refit()).resumed is True  # the refit's pause is the refit's to release
        backend.release.set()
        await request  # idle from here on
        assert await shard.pause(mode="keep", clear_cache=False, clear_if_idle=True) is True
        await shard.resume()
        assert await shard.pause(mode="keep", clear_cache=False) is True  # salt: never clears
        assert backend.pauses == [False, True, False]

    asyncio.run(go())


def test_under_keep_every_pause_lets_an_idle_shard_clear_its_cache(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, kv_policy="keep")
        await ctl.start()
        door.gen_delay = 0.2
        reqs = [asyncio.ensure_future(client(ctl).generate([1])) for _ in range(6)]
        await asyncio.sleep(0.05)
        door.kwargs.clear()
        await ctl.sync_weights(1)
        await asyncio.gather(*reqs)
        asked = [kw["pause"] for m, _, kw in door.kwargs if m == "begin_refit"]
        assert len(asked) == 3 and all(p == {"mode": "keep", "clear_cache": False, "clear_if_idle": True}
                                       for p in asked), asked  # the shard decides at its pause
        pauses = [kw for m, _, kw in door.kwargs if m == "pause"]  # what each did: a busy one keeps its cache
        assert len(pauses) == 3 and any(not kw["clear_cache"] for kw in pauses), pauses
        await ctl.shutdown()

    run(go())


def _quarantine(ctl, door, slot: int) -> None:
    from rlfleet.fleet.outcome import UNAVAILABLE, Outcome
    from rlfleet.health import CallKind

    ctl.observe(slot, 1, CallKind.GENERATE, Outcome(UNAVAILABLE, error=ConnectionError("unavailable")))
    assert ctl.ledger.state(slot).value == "suspect"


def test_a_suspect_shard_is_fenced_at_refit_start(model_dir):
    """Issue 29 hole 10: begin_refit went to live shards only; a suspect one that never heard it left the
    serving set kept admitting work routed before the refit. Every handle is fenced at the refit's epoch."""
    async def go():
        ctl, door, _ = make(model_dir, unhealthy_threshold=50, suspect_timeout_s=60.0)
        await ctl.start()
        shard = door.shards[(2, 1)]
        shard.sticky.update(ping="unavailable", set_route="unavailable")  # it never hears it left
        _quarantine(ctl, door, 2)
        await asyncio.sleep(0.5)
        assert shard.gate.member  # the witness: it still believes it serves
        await ctl.sync_weights(1)
        assert ("fence", 2, 1) in door.calls or ("begin_refit", 2, 1) in door.calls
        assert shard.gate.floor >= ctl.publisher.refit_epoch, "work routed before the refit is still admitted"
        await ctl.shutdown()

    run(go())


def test_a_leave_notice_is_retried_until_acknowledged(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, unhealthy_threshold=50, suspect_timeout_s=60.0)
        await ctl.start()
        shard = door.shards[(2, 1)]
        shard.sticky["ping"] = "unavailable"
        shard.script["set_route"] = "unavailable"  # the first leave notice is lost
        _quarantine(ctl, door, 2)
        for _ in range(100):
            await asyncio.sleep(0.1)
            if not shard.gate.member:
                break
        assert not shard.gate.member, "a lost leave notice was never sent again"
        assert sum(1 for c in door.calls if c[:2] == ("set_route", 2)) >= 2
        notes = [e for e in LeaveNotice.among(ctl.events()) if e.slot == 2]
        assert notes and notes[-1].acknowledged and notes[-1].attempts >= 2
        await ctl.shutdown()

    run(go())


def test_a_leave_notice_sent_again_never_undoes_a_later_join():
    from rlfleet.fleet.shard.request_gate import ShardGate

    gate = ShardGate()
    gate.route(5, True, 1)
    gate.route(7, False, 1)  # left
    gate.route(9, True, 2)  # rejoined
    gate.route(7, False, 1)  # the first leave notice, sent again, arrives late
    assert gate.member and gate.floor == 9 and gate.committed == 2


def test_requests_held_on_an_engine_whose_stamp_failed_are_aborted_and_re_sent_not_tagged_with_the_old_version(model_dir):
    """Found by the fault matrix on engine-less shards: requests held across the pause on the engine whose
    stamp failed finished after the resume on the new weights, tagged with its old version (its tag is what
    the failed stamp left), while the gate was open on the new one. They are aborted before the resume, as on
    an engine the transfer missed, and re-sent to an engine that holds (and says) the new version."""
    async def go():
        ctl, door, _ = make(model_dir, unhealthy_threshold=3, readmit=False)
        await ctl.start()
        door.gen_delay = 0.5  # every request is in flight when the refit pauses
        door.shards[(1, 1)].script["set_weight_version"] = "unavailable"
        c = client(ctl)
        pending = [asyncio.ensure_future(c.generate([1, 2])) for _ in range(9)]
        await asyncio.sleep(0.1)
        assert door.shards[(1, 1)].in_flight, "no request was held on the engine whose stamp fails"
        await ctl.sync_weights(1)
        results = await asyncio.gather(*pending)
        assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
        assert [(r.result.slot, r.result.weight_version) for r in results if r.result.weight_version != 1] == []
        assert door.shards[(1, 1)].version == 0 and 1 not in ctl.ledger.serving_slots()
        await ctl.shutdown()

    run(go())
