"""Every launch of an engine (``start``, a restart, a grown slot) is bounded and never leaves a slot
``restarting`` forever (``fleet.control.launch``), and a restarted engine at the checkpoint serves at once.
Fakes, virtual time."""

from __future__ import annotations

import asyncio

from rlfleet.fleet.control.controller import SingleController
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, client, run_virtual
from rlfleet.fleet.records import Launch, Retire

START_TIMEOUT_S = 5.0


class LaunchDoor(FakeDoor):
    """A fake door whose ``spawn_shard`` raises for the (slot, incarnation) pairs in ``spawn_raises``, and
    whose ``start`` never answers (the door's own bound broken too) for those in ``start_stalls``."""

    def __init__(self) -> None:
        super().__init__()
        self.spawn_raises: set[tuple[int, int]] = set()
        self.start_stalls: set[tuple[int, int]] = set()
        self.spawned: list[tuple[int, int]] = []

    def spawn_shard(self, config, slot, incarnation, weight_version=0, **options):
        self.spawned.append((slot, incarnation))
        if (slot, incarnation) in self.spawn_raises:
            raise RuntimeError(f"placement group for slot {slot} could not be created")
        return super().spawn_shard(config, slot, incarnation, weight_version, **options)

    async def _start(self, s):
        if (s.slot, s.incarnation) in self.start_stalls:
            await asyncio.Event().wait()  # never answers, whatever the call's timeout
        return await super()._start(s)


def make(model_dir, **over):
    cfg = dict(engine={"model": model_dir, "start_timeout_s": START_TIMEOUT_S}, num_engines=3, min_healthy_engines=2,
               refit_timeout_s=0.3, lifecycle_grace_s=0.1, probe_timeout_s=0.1, suspect_timeout_s=0.3,
               unhealthy_threshold=2, restart_backoff_s=0.0, restart_backoff_cap_s=0.0, metrics=False,
               monitor_interval_s=0.5, restart_budget=3)
    cfg.update(over)
    door = LaunchDoor()
    return SingleController(cfg, door=door, transfer=FakeTransfer(door), clock=LoopClock()), door


async def until(pred, seconds=600.0, step=0.5):
    for _ in range(int(seconds / step)):
        if pred():
            return True
        await asyncio.sleep(step)
    return pred()


def launches(ctl, slot):
    return [e for e in Launch.among(ctl.events()) if e.slot == slot]


def test_a_restart_whose_spawn_raises_spends_an_attempt_and_the_next_one_serves(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.spawn_raises.add((2, 2))
        door.kill(door.shards[(2, 1)])
        assert await until(lambda: ctl.ledger.raw(2).incarnation == 3 and ctl.ledger.state(2).value == "healthy"), \
            ctl.ledger.raw(2)
        rec = ctl.ledger.raw(2)
        assert rec.incarnation == 3 and rec.restarts == 2  # the raising launch cost one attempt, as a death does
        [failed] = [e for e in launches(ctl, 2) if e.outcome != "ok"]
        assert failed.incarnation == 2 and "could not be created" in failed.error
        assert 2 not in ctl.launching and 2 in ctl.serving_slots()
        await ctl.shutdown()

    run_virtual(go())


def test_a_slot_whose_every_launch_raises_is_retired_when_its_budget_is_spent(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_budget=2)
        await ctl.start()
        door.spawn_raises |= {(2, 2), (2, 3)}
        door.kill(door.shards[(2, 1)])
        assert await until(lambda: ctl.ledger.state(2).value == "retired"), ctl.ledger.raw(2)
        assert [(e.incarnation, e.outcome) for e in launches(ctl, 2)] == [(2, "error"), (3, "error")]
        [retire] = Retire.among(ctl.events())
        assert retire.slot == 2 and retire.incarnation == 3 and "budget spent" in retire.reason
        assert ctl.gate.is_open and sorted(ctl.serving_slots()) == [0, 1] and 2 not in ctl.launching
        await ctl.shutdown()

    run_virtual(go())


def test_a_restart_whose_start_never_answers_is_cut_by_the_watchdog_and_retried(model_dir):
    async def go():
        from rlfleet.fleet.control.launch import watchdog_s

        ctl, door = make(model_dir)
        await ctl.start()
        door.start_stalls.add((2, 2))
        door.kill(door.shards[(2, 1)])
        t0 = ctl.clock.now()
        assert await until(lambda: ctl.ledger.raw(2).incarnation == 3 and ctl.ledger.state(2).value == "healthy"), \
            ctl.ledger.raw(2)
        [cut] = [e for e in launches(ctl, 2) if e.outcome != "ok"]
        assert cut.incarnation == 2 and cut.outcome == "timed_out" and cut.bound_s == watchdog_s(ctl.cfg)
        assert f"{watchdog_s(ctl.cfg):g} s" in cut.error
        assert ctl.clock.now() - t0 < watchdog_s(ctl.cfg) + 5  # bounded by the watchdog, not hanging forever
        assert door.shards[(2, 2)].dead and ctl.ledger.raw(2).incarnation == 3
        await ctl.shutdown()

    run_virtual(go())


def test_a_spawn_that_raises_at_start_is_a_failed_start_restarted_within_budget(model_dir):
    async def go():
        ctl, door = make(model_dir)
        door.spawn_raises.add((1, 1))
        await ctl.start()  # quorum 2 of 3 serves; slot 1 is relaunched
        assert ctl.gate.is_open
        assert await until(lambda: ctl.ledger.raw(1).incarnation == 2 and ctl.ledger.state(1).value == "healthy"), \
            ctl.ledger.raw(1)
        await ctl.shutdown()

    run_virtual(go())


def test_a_grown_slot_whose_spawn_raises_is_relaunched_not_left_starting(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.spawn_raises.add((3, 1))
        await ctl.resize(4)
        assert await until(lambda: ctl.ledger.raw(3).incarnation == 2 and ctl.ledger.state(3).value == "healthy"), \
            ctl.ledger.raw(3)
        await ctl.shutdown()

    run_virtual(go())


# ------------------------------------------------------------------------------ hole 10: restarts at version 0
def test_an_engine_restarted_at_the_checkpoint_serves_at_once_as_a_grown_one_does(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.kill(door.shards[(2, 1)])
        assert await until(lambda: ctl.ledger.raw(2).incarnation == 2 and ctl.ledger.state(2).value != "restarting")
        assert ctl.ledger.state(2).value == "healthy" and 2 in ctl.serving_slots()
        await ctl.publisher.publish()
        assert sorted(m.slot for m in ctl.publisher.current.members) == [0, 1, 2]
        results = await asyncio.gather(*(client(ctl).generate([1, 2], {"max_tokens": 2}) for _ in range(30)))
        assert any(r.result.slot == 2 and r.result.incarnation == 2 for r in results)
        await ctl.shutdown()

    run_virtual(go())


def test_an_engine_restarted_after_a_refit_stays_stale_until_the_next_one(model_dir):
    async def go():
        ctl, door = make(model_dir, readmit=False)
        await ctl.start()
        await ctl.sync_weights(1)
        door.kill(door.shards[(2, 1)])
        assert await until(lambda: ctl.ledger.raw(2).incarnation == 2 and ctl.ledger.state(2).value != "restarting")
        assert ctl.ledger.state(2).value == "stale" and 2 not in ctl.serving_slots()
        await ctl.sync_weights(2)
        assert 2 in ctl.serving_slots()
        await ctl.shutdown()

    run_virtual(go())


def test_a_launch_whose_task_was_lost_is_made_again_by_the_reconcile_step(model_dir):
    """Issue 48: the reconcile is level-triggered. A restart whose task ended without settling the slot (here:
    cancelled while its engine stalled in start) leaves the ledger launching that incarnation; the next step
    of the health-timer loop finds no launch under way for it and launches it again: its actor exists, so the
    launch watches it (and starts it: the lost start's call stalls), and it serves."""
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.start_stalls.add((2, 2))
        door.kill(door.shards[(2, 1)])
        assert await until(lambda: 2 in ctl.launching and (2, 2) in door.spawned, 30, 0.1)
        lost = ctl.launching[2]
        door.start_stalls.clear()
        door.shards[(2, 2)].state = "new"  # its engine never began to start
        lost.cancel()  # the launch is lost: nothing settles incarnation 2
        assert await until(lambda: ctl.ledger.state(2).value == "healthy", 30, 0.1), ctl.ledger.raw(2)
        rec = ctl.ledger.raw(2)
        assert lost.cancelled() and rec.incarnation == 2 and rec.restarts == 1  # the same incarnation, no attempt spent
        assert door.spawned.count((2, 2)) == 1 and 2 in ctl.serving_slots() and 2 not in ctl.launching
        assert [(m, i) for m, s, i in door.rpcs if s == 2 and m in ("start", "describe")] == [
            ("start", 1), ("start", 2), ("describe", 2), ("start", 2)]  # the lost start; the reconcile's watch
        await ctl.shutdown()

    run_virtual(go())
