"""Re-admission through the real controller with fake shards in virtual time (issue 48): a restarted engine
serves again at the committed version, copied from a live peer, before the trainer's next refit and with no
new version number; a donor that dies is replaced by another; an engine whose copies keep failing backs
off and is evicted, never retried every tick; a refit that begins during a copy wins.

The witness is the fake shard's own calls and stamp, and the transport's attempt count (no refit ran)."""

from __future__ import annotations

import asyncio

from rlfleet.fleet.records import Readmit as ReadmitRecord
from tests.unit.fleet_fakes import client
from tests.unit.test_controller import make, run


async def _killed_and_back(ctl, door, slot: int, inc: int = 2, wait_s: float = 5.0) -> None:
    await ctl.kill_shard(slot)
    for _ in range(int(wait_s / 0.05)):
        await asyncio.sleep(0.05)
        if ctl.handles.get(slot, (0,))[0] == inc and ctl.ledger.raw(slot).phase.value == "live":
            return
    raise AssertionError(f"slot {slot} incarnation {inc} never came up: {ctl.ledger.record(slot)}")


async def _until(pred, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if pred():
            return True
        await asyncio.sleep(0.05)
    return pred()


def test_a_restarted_engine_serves_the_committed_version_again_without_a_refit_or_a_new_version(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(1)
        await ctl.sync_weights(2)
        attempts = len(transfer.attempts)
        await _killed_and_back(ctl, door, 1)
        assert await _until(lambda: ctl.ledger.state(1).value == "healthy"), ctl.ledger.record(1)
        shard = door.shards[(1, 2)]
        assert shard.version == 2 and ("receive_weights_from_peer", 1, 2) in door.calls  # a copy, then the stamp
        assert ctl.ledger.current_version == 2 and len(transfer.attempts) == attempts  # no refit, no new number
        ends = [r for r in ReadmitRecord.among(ctl.events()) if r.edge == "end"]
        assert [(r.slot, r.incarnation, r.version, r.outcome) for r in ends] == [(1, 2, 2, "readmitted")]
        assert ends[0].donor in ("slot 0", "slot 2") and ends[0].digests == 1
        assert 1 in ctl.ledger.serving_slots() and ctl.gate.is_open
        served = [await client(ctl).generate([1, 2]) for _ in range(20)]
        assert any(r.result.slot == 1 and r.result.incarnation == 2 and r.result.weight_version == 2 for r in served)
        await ctl.shutdown()

    run(go())


def test_a_donor_that_dies_mid_copy_leaves_the_engine_stale_and_another_donor_gives_the_weights(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, restart_backoff_s=30.0, restart_backoff_cap_s=30.0)
        await ctl.start()
        await ctl.sync_weights(1)
        door.on_spawn[(1, 2)] = {}
        first = min(s for s in (0, 2))  # the least busy donor goes first: both idle, the lower slot
        door.shards[(first, 1)].script["donate_weights"] = "die"
        await _killed_and_back(ctl, door, 1, wait_s=40.0)
        assert await _until(lambda: ctl.ledger.state(1).value == "healthy"), ctl.ledger.record(1)
        ends = [r for r in ReadmitRecord.among(ctl.events()) if r.edge == "end" and r.slot == 1]
        assert ends[-1].outcome == "readmitted" and ends[-1].donor == "slot 2", ends
        assert [t.split(":")[0] for t in ends[-1].tried or []] == ["slot 0"], ends  # the donor that died, named
        assert door.shards[(1, 2)].version == 1 and ("donate_weights", 0, 1) in door.calls
        await ctl.shutdown()

    run(go())


def test_an_engine_whose_copies_keep_failing_backs_off_and_is_evicted_never_retried_every_tick(model_dir):
    async def go():
        ctl, door, _ = make(model_dir, restart_budget=5)
        await ctl.start()
        await ctl.sync_weights(1)
        door.on_spawn[(1, 2)] = {"receive_weights_from_peer": "error"}  # sticky: every copy into it fails
        await _killed_and_back(ctl, door, 1)
        assert await _until(lambda: ctl.handles[1][0] == 3, 60.0), ctl.ledger.record(1)  # evicted, restarted
        tries = [r for r in ReadmitRecord.among(ctl.events()) if r.edge == "end" and (r.slot, r.incarnation) == (1, 2)]
        assert len(tries) == 3 and all(r.outcome == "failed" for r in tries), tries
        gaps = [b.t - a.t for a, b in zip(tries, tries[1:])]
        assert all(g >= 2.0 for g in gaps), gaps  # backed off: 4 s, then 8 s (virtual), never every tick
        assert await _until(lambda: ctl.ledger.state(1).value == "healthy", 10.0)  # the fresh incarnation takes one
        await ctl.shutdown()

    run(go())


def test_a_refit_that_begins_during_a_copy_wins_and_the_engine_joins_it_by_its_state(model_dir):
    async def go():
        ctl, door, transfer = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(1)
        slow = asyncio.Event()

        async def slow_receive(s, offer, manifest, version, timeout_s, digests=True):
            await slow.wait()  # the copy is still moving bytes when the trainer's refit begins
            raise AssertionError("a cancelled copy went on")

        door._receive_weights_from_peer = slow_receive
        await _killed_and_back(ctl, door, 1)
        assert await _until(lambda: ("receive_weights_from_peer", 1, 2) in door.calls)  # the copy is moving
        summary = await ctl.sync_weights(2)  # yields the copy, then refits every live engine, slot 1 included
        assert 1 in summary["participants"] and 1 in summary["complete"], summary
        ends = [r for r in ReadmitRecord.among(ctl.events()) if r.edge == "end" and r.slot == 1]
        assert [r.outcome for r in ends] == ["yielded"], ends
        donor = next(s for m, s, _ in door.calls if m == "donate_weights")
        closed = [c for c in door.calls if c[0] == "close_donation"]
        assert closed == [("close_donation", donor, 1)], closed  # the donor's side stopped: the receiver is free
        assert door.calls.index(closed[0]) < door.calls.index(("set_weight_version", 1, 2)), "closed before the refit stamped"
        assert door.shards[(1, 2)].version == 2 and ctl.ledger.state(1).value == "healthy"
        assert not ctl.readmissions.running
        await ctl.shutdown()

    run(go())
