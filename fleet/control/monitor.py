"""The liveness monitor: finds deaths and freezes between refits, without traffic, and the shards of lost nodes.

Every ``monitor_interval_s`` it pings every live shard (not while a refit holds the gate closed:
paused engines are not probed); the failures of one round are one health decision. Each ping carries
the routing epoch: it is the controller's heartbeat, which renews the shard's lease on its routing state
(``fleet.shard.lease``). A shard that answers but whose engine made no progress for ``stall_timeout_s``
while it held work is a failure too (``with_progress``). ``probe`` is the health core's ``Probe`` action: one ping,
spaced as the core asks. A node the cluster declared dead takes all its shards still counted
alive in the decision that found the first of them (``fleet.control.nodes``); a failure on a node the
cluster still counts alive puts the node under watch until the cluster judges it.

Decides nothing: every outcome goes to the controller (``Parts.act.observe``/``observe_all``).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from rlfleet.fleet.outcome import Outcome, with_progress
from rlfleet.fleet.control.parts import Parts
from rlfleet.health import CallKind, SlotPhase
from rlfleet.fleet import records as ev
from rlfleet.fleet.wire import Ping


class LivenessMonitor:
    def __init__(self, parts: Parts, holding: Callable[[], bool], epoch: Callable[[], int]) -> None:
        """``holding()``: a refit holds the gate closed now (its engines are paused: not probed); ``epoch()``: the
        routing epoch published now (``RoutingPublisher.current``), which each ping carries."""
        self.p = parts
        self._holding = holding
        self._epoch = epoch

    async def probe(self, slot: int, incarnation: int, not_before: float | None = None) -> None:
        """Probe ``incarnation`` of ``slot`` once, not before ``not_before`` (the health core spaces the
        probes of a quarantine by ``probe_interval_s``: a killed process fails every probe at once, and
        probing it back to back would find it dead before the cluster can say its node was lost)."""
        wait = (not_before - self.p.clock.now()) if not_before is not None else 0.0
        if wait > 0:
            await asyncio.sleep(wait)
        handle = self.p.slots.handle_of(slot, incarnation)
        if handle is None:
            return
        out = with_progress(await self.p.door.call(handle, "ping", self._epoch(), timeout=self.p.cfg.probe_timeout_s),
                            self.p.cfg.stall_timeout_s)
        if out.ok and isinstance(out.value, Ping) and out.value.core_checked is False:
            # its core runs a bounded worker call, so the ping did not ask it: no verdict; ask again after that
            self.p.act.in_background(self.probe(slot, incarnation, self.p.clock.now() + max(self.p.cfg.probe_interval_s, 0.1)))
        elif out.ok:
            self.p.act.observe(slot, incarnation, CallKind.PROBE, out)
        else:
            self.p.act.observe_all(CallKind.PROBE, self._with_lost_nodes({slot: (incarnation, out)}))

    def _with_lost_nodes(self, failed: dict[int, tuple[int, Outcome]]) -> dict[int, tuple[int, Outcome]]:
        """``failed`` probes, plus every shard on a node the cluster declared dead (``fleet.control.nodes``): a lost
        node's shards all die in the decision that found the first of them. The nodes of failures the
        cluster has not judged yet are watched (``_node_verdicts``)."""
        if not failed or not self.p.slots.nodes:
            return failed
        out = {**failed, **self._lost_nodes(self.p.door.dead_nodes())}
        self.p.slots.nodes.watch({s: inc for s, (inc, _) in failed.items()})
        return out

    def _node_verdicts(self) -> None:
        """The cluster's verdict on a watched node (one whose shard failed while the node still counted
        alive), once it comes: the node's shards still counted alive die with it in one decision."""
        ledger = self.p.slots.ledger
        self.p.slots.nodes.settle(lambda s: s >= ledger.num_slots or ledger.raw(s).phase in (SlotPhase.LIVE, SlotPhase.RETIRED))
        if self.p.slots.nodes.watching:
            dead = self.p.slots.nodes.watched_among(self.p.door.dead_nodes())
            condemned = self._lost_nodes(dead) if dead else {}
            if condemned:
                self.p.act.observe_all(CallKind.PROBE, condemned)

    def _lost_nodes(self, dead_nodes: set[str]) -> dict[int, tuple[int, Outcome]]:
        """Every shard still counted alive on a node in ``dead_nodes``, with a ``died`` outcome naming the
        node. Each such node's loss is recorded once, with every slot it took: those whose own probes
        condemned them before the verdict (the node's watch) too."""
        ledger = self.p.slots.ledger
        alive = {s: inc for s, inc in self.p.slots.current_incarnations().items() if ledger.raw(s).phase is not SlotPhase.DEAD}
        lost = self.p.slots.nodes.lost(dead_nodes, alive)
        out: dict[int, tuple[int, Outcome]] = {}
        for node in sorted(set(lost) | self.p.slots.nodes.watched_among(dead_nodes)):
            slots = lost.get(node, {})
            out.update(slots)
            before = [s for s in self.p.slots.nodes.unwatch(node) if s not in slots]
            if node not in self.p.slots.nodes.reported:
                self.p.slots.nodes.reported.add(node)
                self.p.log.emit(ev.NodeLost(node=node, slots=sorted({*slots, *before}), died_before=before))
        return out

    async def round(self) -> None:
        """One round (the controller runs it every ``monitor_interval_s``, ``fleet.control.loops``): ping every
        live shard between refits so deaths and freezes are found without traffic; the failures of one round
        (and the shards of a lost node) are one health decision."""
        if self._holding():
            return  # paused engines are not probed; while a refit stages, the fleet serves and is watched
        self._node_verdicts()
        live = self.p.slots.live_handles()
        outs = await self.p.door.fan_out(
            {s: (h, "ping", (self._epoch(),), {}) for s, (_, h) in live.items()}, timeout=self.p.cfg.probe_timeout_s
        )
        outs = {slot: with_progress(out, self.p.cfg.stall_timeout_s) for slot, out in outs.items()}  # answering != alive
        handles = self.p.slots.handles
        failed = {slot: (live[slot][0], out) for slot, out in outs.items()
                  if not out.ok and handles.get(slot, (None,))[0] == live[slot][0]}
        if failed:
            self.p.act.observe_all(CallKind.PROBE, self._with_lost_nodes(failed))

