"""A lost Ray node, on the controller with a fake door in virtual time: its shards die in one decision
(one membership change, not one per shard), and a restart Ray cannot place yet waits (restarting, not
failing its start). The real thing runs on the local Slurm cluster (tests/integration/test_slurm.py)."""

from __future__ import annotations

import asyncio

import msgspec

from rlfleet.fleet.control.controller import SingleController
from rlfleet.fleet.control.nodes import NodeMap
from rlfleet.fleet.outcome import TIMED_OUT, Outcome
from tests.unit.fleet_fakes import FakeDoor, FakeTransfer, LoopClock, run_virtual
from rlfleet.fleet.records import Health, NodeLost, Placement

NODE = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


class NodeDoor(FakeDoor):
    """Shards name their node at start; ``dead`` is what the GCS would report; ``pending`` holds
    (slot, incarnation) actors Ray has not placed yet."""

    def __init__(self) -> None:
        super().__init__()
        self.dead: set[str] = set()
        self.pending: set[tuple[int, int]] = set()

    async def _start(self, s):
        return msgspec.structs.replace(await super()._start(s), node=NODE[s.slot])

    def dead_nodes(self) -> set[str]:
        return set(self.dead)

    def actor_state(self, handle) -> str:
        return "PENDING_CREATION" if (handle.slot, handle.incarnation) in self.pending else "ALIVE"

    async def call(self, handle, method, *args, timeout, **kw):
        if (handle.slot, handle.incarnation) in self.pending:  # Ray queues the call until it places the actor
            await asyncio.sleep(timeout)
            return Outcome(TIMED_OUT, error=TimeoutError(f"{method}: actor not placed"))
        return await super().call(handle, method, *args, timeout=timeout, **kw)

    def lose(self, node: str) -> None:
        """The node's processes are gone: calls to its shards hang (unreachable), the GCS says dead."""
        for (slot, _), shard in self.shards.items():
            if NODE[slot] == node:
                shard.sticky["ping"] = "hang"
        self.dead.add(node)


def make(model_dir, **over):
    cfg = dict(engine={"model": model_dir}, num_engines=4, min_healthy_engines=2, refit_timeout_s=0.3,
               lifecycle_grace_s=0.1, probe_timeout_s=0.2, suspect_timeout_s=5.0, unhealthy_threshold=3,
               restart_backoff_s=60.0, restart_backoff_cap_s=60.0, metrics=False)
    cfg.update(over)
    door = NodeDoor()
    return SingleController(cfg, door=door, transfer=FakeTransfer(door), clock=LoopClock()), door


def test_the_node_map_names_only_current_incarnations_on_dead_nodes():
    nodes = NodeMap()
    nodes.place(0, 1, "a")
    nodes.place(1, 1, "b")
    nodes.place(2, 1, None)  # never named its node: found by its own probes
    lost = nodes.lost({"b"}, {0: 1, 1: 1, 2: 1})
    assert list(lost) == ["b"] and list(lost["b"]) == [1]
    inc, out = lost["b"][1]
    assert inc == 1 and out.kind == "died" and "declared dead" in out.describe()
    assert nodes.lost({"b"}, {1: 2}) == {}  # slot 1 was restarted elsewhere meanwhile
    assert nodes.by_node() == {"a": [0], "b": [1]}
    nodes.forget(1)  # removed by a resize
    assert nodes.by_node() == {"a": [0]} and nodes.lost({"b"}, {1: 1}) == {}


def test_a_lost_node_takes_all_its_shards_in_one_decision_and_one_epoch(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        await ctl.sync_weights(1)
        epoch = ctl.plan.epoch
        mark = len(ctl.log.records())
        door.lose("node-b")
        await asyncio.sleep(2.0)  # one monitor round: pings time out, the GCS says node-b is dead
        lost = NodeLost.among(ctl.log.records(mark))
        assert [(e.node, e.slots) for e in lost] == [("node-b", [2, 3])]
        deaths = [e for e in Health.among(ctl.log.records(mark)) if e.after == "dead"]
        assert sorted(e.slot for e in deaths) == [2, 3]
        assert len({e.seq - i for i, e in enumerate(deaths)}) == 1  # consecutive rows of one decision
        assert ctl.gate.is_open and sorted(ctl.ledger.serving_slots()) == [0, 1]  # quorum (2) holds on node-a
        summary = await ctl.sync_weights(2)
        assert summary["epoch"] == epoch + 1 and summary["participants"] == [0, 1]
        await ctl.shutdown()

    run_virtual(go())


def test_without_a_dead_node_a_timed_out_probe_only_quarantines(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.shards[(2, 1)].sticky["ping"] = "hang"  # frozen, but its node is alive
        await asyncio.sleep(1.5)
        assert ctl.ledger.state(2).value == "hung" and ctl.ledger.state(3).value == "healthy"
        assert NodeLost.among(ctl.log.records()) == []
        await ctl.shutdown()

    run_virtual(go())


def test_a_restart_ray_cannot_place_waits_restarting_then_starts_when_placed(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_backoff_s=0.0, restart_backoff_cap_s=0.0,
                         engine={"model": model_dir, "start_timeout_s": 5.0})  # a bound the wait outlasts
        await ctl.start()
        door.pending.add((1, 2))  # the restart of slot 1 finds no node with room
        door.shards[(1, 1)].dead = True
        await asyncio.sleep(60.0)  # far past the start bound (5 + 30 s)
        assert ctl.ledger.state(1).value == "restarting" and ctl.ledger.record(1).restarts == 1
        waits = Placement.among(ctl.log.records())
        assert [(e["slot"], e["incarnation"], e["edge"]) for e in waits] == [(1, 2, "waiting")]
        assert not any(m == "start" and s == 1 and i == 2 for m, s, i in door.calls)  # never started, never failed
        door.pending.clear()
        await asyncio.sleep(2.0)
        assert ctl.ledger.state(1).value == "stale" and Placement.among(ctl.log.records())[-1].edge == "placed"
        await ctl.shutdown()


def test_shutdown_kills_a_restart_still_waiting_for_placement_instead_of_waiting_on_it(model_dir):
    async def go():
        ctl, door = make(model_dir, restart_backoff_s=0.0, restart_backoff_cap_s=0.0)
        await ctl.start()
        door.pending.add((1, 2))
        door.shards[(1, 1)].dead = True
        await asyncio.sleep(10.0)
        assert ctl.ledger.state(1).value == "restarting"
        t0 = ctl.clock.now()
        summary = await ctl.shutdown()
        assert ctl.clock.now() - t0 < 1.0  # not the 60 s a shutdown call to an unplaced actor waits
        assert summary["shards"][1] == "killed_while_starting" and door.shards[(1, 2)].dead
        assert all(("shutdown", s, 1) in door.calls for s in (0, 2, 3))  # the started ones were asked
        assert not any(m == "shutdown" and s == 1 for m, s, _ in door.calls)

    run_virtual(go())


def test_status_reports_the_hang_detection_bound_and_the_nodes(model_dir):
    async def go():
        ctl, _ = make(model_dir, monitor_interval_s=1.0, probe_interval_s=0.5)
        await ctl.start()
        status = ctl.status()
        assert status["hang_detection_bound_s"] == 1.0 + 3 * 0.2 + 2 * 0.5
        assert status["nodes"] == {"node-a": [0, 1], "node-b": [2, 3]}
        await ctl.shutdown()

    run_virtual(go())


def test_the_node_map_watches_a_failed_slots_node_until_the_cluster_judges_it_or_the_slot_recovers():
    nodes = NodeMap()
    for slot, node in NODE.items():
        nodes.place(slot, 1, node)
    nodes.watch({0: 1, 2: 1, 3: 1})
    nodes.watch({1: 2})  # an incarnation that never named its node: nothing to watch
    assert nodes.watching
    nodes.settle(lambda s: s == 0)  # slot 0 serves again: node-a needs no verdict
    assert nodes.watched_among({"node-a", "node-b"}) == {"node-b"} and nodes.watching
    assert nodes.unwatch("node-b") == [2, 3] and not nodes.watching
    assert nodes.unwatch("node-b") == []


def _dead_by_probes(ctl, slots):
    return all(ctl.ledger.state(s).value in ("dead", "restarting") for s in slots)


def test_shards_their_own_probes_condemned_before_the_verdict_are_named_when_the_node_is_declared_dead(model_dir):
    """Every shard of node-b refuses connections (its processes were killed) and reaches its probe
    threshold before the cluster's health checks declare the node dead; the verdict, when it comes,
    is still recorded, naming both slots as having died before it."""

    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        mark = len(ctl.log.records())
        for slot in (2, 3):
            door.shards[(slot, 1)].sticky["ping"] = "unavailable"
        for _ in range(40):
            await asyncio.sleep(0.5)
            if _dead_by_probes(ctl, (2, 3)):
                break
        deaths = [e for e in Health.among(ctl.log.records(mark)) if e.after == "dead"]
        assert sorted(e.slot for e in deaths) == [2, 3] and all("failed probe" in e.reason for e in deaths), deaths
        assert NodeLost.among(ctl.log.records()) == [] and ctl.nodes.watching  # no verdict yet
        door.dead.add("node-b")
        await asyncio.sleep(2.0)  # one monitor round
        lost = NodeLost.among(ctl.log.records(mark))
        assert [(e.node, e.slots, e.died_before) for e in lost] == [("node-b", [2, 3], [2, 3])]
        assert not ctl.nodes.watching and ctl.gate.is_open
        await ctl.shutdown()

    run_virtual(go())


def test_the_verdict_takes_the_nodes_shards_still_counted_alive_in_one_decision(model_dir):
    """Slot 2 dies by its own probes; slot 3, on the same node, still answered when the verdict came:
    it dies with the node, and the loss names both."""

    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        mark = len(ctl.log.records())
        door.shards[(2, 1)].sticky["ping"] = "unavailable"
        for _ in range(40):
            await asyncio.sleep(0.5)
            if _dead_by_probes(ctl, (2,)):
                break
        assert ctl.ledger.state(3).value == "healthy"
        door.dead.add("node-b")
        await asyncio.sleep(2.0)
        lost = NodeLost.among(ctl.log.records(mark))
        assert [(e.node, e.slots, e.died_before) for e in lost] == [("node-b", [2, 3], [2])]
        slot3 = [e for e in Health.among(ctl.log.records(mark)) if e.slot == 3 and e.after == "dead"]
        assert len(slot3) == 1 and "NodeLost" in slot3[0].reason, slot3
        assert sorted(ctl.ledger.serving_slots()) == [0, 1] and ctl.gate.is_open
        await ctl.shutdown()

    run_virtual(go())


def test_a_failed_shard_that_serves_again_ends_the_watch_on_its_node(model_dir):
    async def go():
        ctl, door = make(model_dir)
        await ctl.start()
        door.shards[(2, 1)].script["ping"] = "unavailable"  # one refused ping, then it answers
        await asyncio.sleep(1.5)
        assert ctl.nodes.watching
        await asyncio.sleep(4.0)
        assert ctl.ledger.state(2).value == "healthy" and not ctl.nodes.watching
        assert NodeLost.among(ctl.log.records()) == []
        await ctl.shutdown()

    run_virtual(go())
