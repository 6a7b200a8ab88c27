"""Which Ray node each engine shard runs on, and what a lost node takes with it. Ray-free.

A shard names its node when it starts (and when a restarted controller re-adopts it);
the controller keeps the map here. When a probe finds shards failing, the controller
asks the door which nodes the cluster has declared dead. Every shard on such a node
is dead with it, and goes into the same health decision as the failures that revealed
it (one ``Batch``). So a lost node costs one membership change for all its shards,
never one per shard, and shards that merely timed out are not left quarantined.
They would otherwise wait out their probes.

The cluster's verdict can come later than a shard's own: a killed shard process refuses
connections at once, so its probes can reach ``unhealthy_threshold`` before Ray's health
checks declare the node dead (every shard of the node at once, when they were killed
together). So a node whose shard failed while the cluster still counted it alive is
*watched*: until the cluster judges it, or the slot serves again. When the verdict comes,
the node's shards still counted alive die with it, and the loss is recorded naming every
slot it took, those that died before the verdict too. Membership still changes once: the
next refit reconciles all these deaths together.

Guarantee on failure: nothing here raises on missing facts. A shard that never named
its node is simply not on any node: it is found dead by its own probes, as before.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from rlfleet.fleet.outcome import DIED, Outcome

__all__ = ["NodeLost", "NodeMap"]


class NodeLost(Exception):
    """The Ray node a shard ran on was declared dead by the cluster: the shard died with it."""


class NodeMap:
    """slot -> (incarnation, node id) of each shard that named its node."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[int, str]] = {}
        self.reported: set[str] = set()  # nodes whose loss was already logged
        self._watched: dict[str, dict[int, int]] = {}  # node -> {slot: incarnation that failed there}

    def place(self, slot: int, incarnation: int, node: Any) -> None:
        """Record that ``incarnation`` of ``slot`` runs on ``node`` (ignored when ``node`` is empty)."""
        if node:
            self._where[slot] = (incarnation, str(node))

    def forget(self, slot: int) -> None:
        """``slot`` runs nowhere any more (a resize removed it)."""
        self._where.pop(slot, None)

    def node_of(self, slot: int, incarnation: int) -> str | None:
        where = self._where.get(slot)
        return where[1] if where is not None and where[0] == incarnation else None

    def by_node(self) -> dict[str, list[int]]:
        """node id -> the slots placed on it, ascending (for status pages)."""
        out: dict[str, list[int]] = {}
        for slot, (_, node) in sorted(self._where.items()):
            out.setdefault(node, []).append(slot)
        return out

    def __bool__(self) -> bool:
        return bool(self._where)

    def watch(self, failed: Mapping[int, int]) -> None:
        """``failed`` (slot -> incarnation) failed a call while the cluster still counted their nodes
        alive: watch those nodes until the cluster judges them (``unwatch``) or the slots need no
        verdict any more (``settle``). Slots with no node, or on a node already judged, are skipped."""
        for slot, inc in failed.items():
            node = self.node_of(slot, inc)
            if node is not None and node not in self.reported:
                self._watched.setdefault(node, {})[slot] = inc

    @property
    def watching(self) -> bool:
        return bool(self._watched)

    def settle(self, done: Callable[[int], bool]) -> None:
        """Stop watching for the slots ``done`` clears (they serve again, or left the fleet)."""
        for node in list(self._watched):
            slots = {s: inc for s, inc in self._watched[node].items() if not done(s)}
            if slots:
                self._watched[node] = slots
            else:
                del self._watched[node]

    def watched_among(self, nodes: Iterable[str]) -> set[str]:
        """Those of ``nodes`` that are watched."""
        return set(nodes).intersection(self._watched)

    def unwatch(self, node: str) -> list[int]:
        """End the watch on ``node`` (the cluster judged it): the slots watched there, ascending."""
        return sorted(self._watched.pop(node, ()))

    def lost(self, dead_nodes: Iterable[str], current: Mapping[int, int]) -> dict[str, dict[int, tuple[int, Outcome]]]:
        """For every node in ``dead_nodes``: the slots whose current incarnation (``current``: slot ->
        incarnation) ran on it, each with a ``died`` outcome that names the node."""
        dead = set(dead_nodes)
        out: dict[str, dict[int, tuple[int, Outcome]]] = {}
        for slot, inc in current.items():
            node = self.node_of(slot, inc)
            if node is not None and node in dead:
                error = NodeLost(f"its Ray node {node[:12]} was declared dead by the cluster")
                out.setdefault(node, {})[slot] = (inc, Outcome(DIED, error=error))
        return out
